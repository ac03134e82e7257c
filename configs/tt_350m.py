"""350M tensor-train LLaMA (BOOST's TT model: 6 cores through r_mid, see boost_jax.config.tt_config). Point data.path at your tokenized corpus."""
from boost_jax.config import tt_config


def get_config():
    return tt_config("350m")
