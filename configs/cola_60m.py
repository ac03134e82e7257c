"""60M CoLA (B·σ(A·x), r = d/4), CoLA's shape (BOOST rounds I to 1344).

Recipe: CoLA's official one (AdamW betas (0.9, 0.999), wd 0.01, clip 0.5, peak lr 6e-3, 10k steps,
10% warmup, cosine to 0.1x, seq 256, global batch 512), not BOOST's AdamW (0.9, 0.95) at seq 4096.
Point data.path at your tokenized corpus.
"""
from boost_jax.config import sized_config


def get_config():
    return sized_config("60m", linear="cola")
