"""130M CoLA (B·σ(A·x), r = d/4), CoLA's shape.

Recipe: CoLA's official one (AdamW betas (0.9, 0.999), wd 0.01, clip 0.5, peak lr 3e-3, 20k steps,
10% warmup, cosine to 0.1x, seq 256, global batch 512), not BOOST's AdamW (0.9, 0.95) at seq 4096.
Point data.path at your tokenized corpus.
"""
from boost_jax.config import sized_config


def get_config():
    return sized_config("130m", linear="cola")
