"""7B full-rank LLaMA baseline with the CoLA recipe's hyper-parameters. Point data.path at your tokenized corpus."""
from boost_jax.config import sized_config


def get_config():
    return sized_config("7b", linear="dense")
