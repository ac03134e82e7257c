"""Low-rank B·A and CoLA B·σ(A·x) (σ = SiLU): two factors through an r-wide bottleneck."""
from __future__ import annotations

import jax
from flax import nnx

from boost_jax.model.kinds.base import LinearKind, factor_init
from boost_jax.parallel.rules import gathered


class LowRank(LinearKind):
    def __init__(self, m, d_in, d_out, *, axes, group, rngs, param_dtype):
        super().__init__(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)
        r = self.width
        self.a = nnx.Param(factor_init(rngs.params(), (d_in, r), d_in, d_out, r, param_dtype), axes=(axes[0], "rank"))
        self.b = nnx.Param(factor_init(rngs.params(), (r, d_out), d_in, d_out, r, param_dtype), axes=("rank", axes[1]))

    @classmethod
    def n_params(cls, m, d_in, d_out):
        return int(m.rank) * (d_in + d_out)

    def first_weight(self, use=gathered):
        return use(self.a[...], self.first_axes)

    def second_weight(self, use=gathered):
        return use(self.b[...], self.second_axes)


class CoLA(LowRank):
    @classmethod
    def nonlinear(cls, m):
        return True

    def bottleneck(self, h):
        return jax.nn.silu(h)
