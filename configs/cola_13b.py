"""13B CoLA (B·σ(A·x), r = d/4) with the CoLA recipe's hyper-parameters. Point data.path at your tokenized corpus."""
from boost_jax.config import sized_config


def get_config():
    return sized_config("13b", linear="cola")
