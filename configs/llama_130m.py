"""130M full-rank LLaMA baseline, CoLA's shape.

Recipe: CoLA's official recipe, as its code runs it (boost_jax/config/presets.py COLA_RECIPE, COLA_OFFICIAL):
AdamW betas (0.9, 0.999), wd 0.01 on every parameter (norm scales too), clip 0.5, peak lr 0.003,
20k steps, 2,000 warmup steps, cosine to 0.1x, seq 256, global batch 512, one document
per row (data.batching=document), perplexity over the first 10M eval tokens. Not BOOST's AdamW (0.9, 0.95) at seq 4096.
Point data.path at your tokenized corpus.
"""

from boost_jax.config import sized_config


def get_config():
    return sized_config("130m", linear="dense")
