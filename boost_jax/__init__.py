"""boost_jax: pre-training low-rank bottleneck (CoLA) LLMs in JAX with bottleneck-aware parallelism."""

__version__ = "0.1.0"

# The registered linear kinds declare their own `model` config fields (tt_cores, sparse_block, ...):
# importing the registry (no JAX) declares the built-in kinds' ones before any `base_config()`.
from boost_jax.model import kinds as _kinds  # noqa: E402,F401
