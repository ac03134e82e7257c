from boost_jax.model.transformer import Transformer, build_model, flops_per_token

__all__ = ["Transformer", "build_model", "flops_per_token"]
