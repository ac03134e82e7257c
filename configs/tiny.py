"""The CPU default: a 4-layer CoLA model (d=128, r=32) on the embedded corpus, a few minutes on 2 cores."""

from boost_jax.config import base_config


def get_config():
    return base_config()
