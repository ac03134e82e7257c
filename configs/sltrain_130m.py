"""130M sparse + low-rank LLaMA with SLTrain's recipe (see boost_jax.config.sltrain_config). Point data.path at your tokenized corpus."""
from boost_jax.config import sltrain_config


def get_config():
    return sltrain_config("130m")
