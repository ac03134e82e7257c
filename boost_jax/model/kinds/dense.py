"""Dense W: the full-rank LLaMA baseline (one stage, no bottleneck)."""

from __future__ import annotations

from flax import nnx

from boost_jax.model.kinds.base import HFLayout, LinearKind, dense_init
from boost_jax.parallel.rules import gathered


class Dense(LinearKind):
    factored = False
    family = "llama"
    # A plain LlamaForCausalLM: X_proj.weight is our w transposed to HF's [out, in].
    hf = HFLayout("llama", "LlamaForCausalLM", (("w", "weight", True),))

    def __init__(self, m, d_in, d_out, *, axes, group, rngs, param_dtype):
        super().__init__(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)
        self.w = nnx.Param(
            dense_init(rngs.params(), (d_in, d_out), d_in, d_out, param_dtype), axes=axes, compute_only=True
        )

    @classmethod
    def bottleneck_width(cls, m, d_in, d_out):
        return d_out

    @classmethod
    def flops(cls, m, d_in, d_out):
        return 2 * d_in * d_out

    @classmethod
    def n_params(cls, m, d_in, d_out):
        return d_in * d_out

    @classmethod
    def validate(cls, m, widths):
        return None

    def first_weight(self, use=gathered):
        return use(self.w[...], self.first_axes)

    def second_weight(self, use=gathered):
        return None
