"""The model. Its names are loaded on first use (PEP 562), so that importing a registry of this
package (`boost_jax.model.kinds`, which `import boost_jax` does to declare the kinds' config fields)
imports no JAX: the tools set XLA_FLAGS before JAX is imported."""

__all__ = ["Transformer", "build_model", "flops_per_token", "model_from_config"]


def __getattr__(name):
    if name in __all__:
        from boost_jax.model import transformer  # lazy: importing the package (kinds' registry) must not load JAX

        return getattr(transformer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
