"""60M tensor-train LLaMA: BOOST's TT shape (d 512, I 1344, 8 heads, 8 layers, 6 cores, tt_rank 128);
inner ranks tt_rank/4 (our choice), no bottleneck activation (BOOST's TT is linear through r_mid).

Recipe: CoLA's official recipe, as its code runs it (boost_jax/config/presets.py COLA_RECIPE, COLA_OFFICIAL):
AdamW betas (0.9, 0.999), wd 0.01 on every parameter (norm scales too), clip 0.5, peak lr 0.006,
10k steps, 2,000 warmup steps, cosine to 0.1x, seq 256, global batch 512, one document
per row (data.batching=document), perplexity over the first 10M eval tokens. BOOST publishes no separate TT schedule.
Point data.path at your tokenized corpus.
"""

from boost_jax.config import tt_config


def get_config():
    return tt_config("60m")
