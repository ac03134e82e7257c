"""Projections: dense W, low-rank B·A, or CoLA B·σ(A·x) with σ = SiLU.

Every projection is split into two stages so that parallel strategies and kernels can act on the
bottleneck: `compress` (x -> the r-wide σ(A·x), or the whole output for dense) and `expand`
(B·h, identity for dense). The r-wide tensor is tagged `lowrank` for activation checkpointing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.parallel.rules import constrain


def factor_init(key, shape, d_in: int, d_out: int, rank: int, dtype):
    # CoLA init: each factor N(0,1)·r^-1/4·(d_in+d_out)^-1/4, so B·A has entry variance 1/(d_in+d_out).
    std = rank ** -0.25 * (d_in + d_out) ** -0.25
    return std * jax.random.normal(key, shape, dtype)


def dense_init(key, shape, d_in: int, d_out: int, dtype):
    # Same per-entry variance as the factorised product, so dense and low-rank start alike.
    return (d_in + d_out) ** -0.5 * jax.random.normal(key, shape, dtype)


class Projection(nnx.Module):
    """One linear map d_in -> d_out whose parameters name their logical axes (`axes` = in, out)."""

    def __init__(self, d_in: int, d_out: int, *, kind: str, rank: int, axes: tuple[str, str],
                 rngs: nnx.Rngs, param_dtype=jnp.float32):
        self.kind = kind
        self.axes = axes
        if kind == "dense":
            self.w = nnx.Param(dense_init(rngs.params(), (d_in, d_out), d_in, d_out, param_dtype), axes=axes)
        else:
            self.a = nnx.Param(factor_init(rngs.params(), (d_in, rank), d_in, d_out, rank, param_dtype),
                               axes=(axes[0], "rank"))
            self.b = nnx.Param(factor_init(rngs.params(), (rank, d_out), d_in, d_out, rank, param_dtype),
                               axes=("rank", axes[1]))

    @property
    def factored(self) -> bool:
        return self.kind != "dense"

    def compress(self, x: jax.Array) -> jax.Array:
        if not self.factored:
            return x @ self.w[...].astype(x.dtype)
        return self.activate(x @ self.a[...].astype(x.dtype))

    def activate(self, h: jax.Array) -> jax.Array:
        """σ on a (fully reduced) A output, then pin and tag the r-wide tensor."""
        if self.kind == "cola":
            h = jax.nn.silu(h)
        h = constrain(h, ("act_batch", "act_seq", "act_rank"))
        return checkpoint_name(h, "lowrank")

    def expand(self, h: jax.Array) -> jax.Array:
        if not self.factored:
            return h
        return h @ self.b[...].astype(h.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.expand(self.compress(x))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        # Statistics in float32 whatever the compute dtype.
        xf = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * inv * self.scale[...].astype(jnp.float32)).astype(x.dtype)
