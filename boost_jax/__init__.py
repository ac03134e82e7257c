"""boost_jax: pre-training low-rank bottleneck (CoLA) LLMs in JAX with bottleneck-aware parallelism."""

__version__ = "0.1.0"
