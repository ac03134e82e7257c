from boost_jax.model.transformer import Transformer, build_model, flops_per_token, model_from_config

__all__ = ["Transformer", "build_model", "flops_per_token", "model_from_config"]
