"""Projections: dense W, low-rank B·A, or CoLA B·σ(A·x) with σ = SiLU.

Every projection has two stages so that parallel strategies and kernels can act on the bottleneck:
the first (`A`, or the whole `W` for dense) and the second (`B`, nothing for dense). Projections
that read the same input run their first stages as ONE GEMM over stacked weights, and their second
stages as one batched dot_general (BOOST's linear layer grouping); parameters keep their own names.
The r-wide σ(A·x) tensor is tagged `lowrank` for activation checkpointing.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.kernels.rmsnorm import rmsnorm as rmsnorm_rows
from boost_jax.parallel import rules
from boost_jax.parallel.rules import constrain, gathered, logical_spec

RANK_ACT = ("act_batch", "act_seq", None, "act_rank")  # [B, T, group, r]


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
                 rngs: nnx.Rngs, param_dtype=jnp.float32, group: str = ""):
        self.kind = kind
        self.group = group  # qkv | o | mlp_in | mlp_out: the unit a parallel plan partitions
        self.first_axes = axes if kind == "dense" else (axes[0], "rank")
        self.second_axes = ("rank", axes[1])
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

    def first(self):
        return self.a if self.factored else self.w

    def first_weight(self) -> jax.Array:
        return gathered((self.a if self.factored else self.w)[...], self.first_axes)

    def second_weight(self) -> jax.Array:
        return gathered(self.b[...], self.second_axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        return project([self], x, grouped=False)[0]


class RMSNorm(nnx.Module):
    """RMSNorm (statistics in float32). `impl="pallas"` runs the fused kernel, which also yields the
    per-row sum of squares that online RMSNorm sends with the A partial products."""

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32, axis: str = "norm", impl: str = "xla"):
        self.eps = eps
        self.impl = impl
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), axes=(axis,))

    def rows(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(normalised rows, Σx² per row) of an unsharded (or local) x."""
        return rmsnorm_rows(x, self.scale[...], self.eps, impl=self.impl)

    def __call__(self, x: jax.Array, names=("act_batch", "act_res_seq", "act_embed")) -> jax.Array:
        if self.impl == "xla":
            return self.rows(x)[0]
        spec = logical_spec(names, x.shape)
        if spec is None:
            return self.rows(x)[0]
        if len(spec) == x.ndim and spec[-1] is not None:
            # Rows split along d (BTP without online norm): the kernel needs whole rows.
            return rmsnorm_rows(x, self.scale[...], self.eps, impl="xla")[0]
        # A pallas_call is not partitioned by GSPMD: run it per shard.
        mesh = rules.current()[0]
        return jax.shard_map(lambda v, w: rmsnorm_rows(v, w, self.eps, impl=self.impl)[0], mesh=mesh,
                             in_specs=(spec, jax.sharding.PartitionSpec()), out_specs=spec,
                             check_vma=False)(x, self.scale[...])  # a pallas_call has no vma types


def _runs(projs, weight):
    """Consecutive projections whose `weight(p)` shapes agree: each run is one grouped GEMM."""
    i = 0
    for _, run in itertools.groupby(projs, key=lambda p: weight(p).shape):
        run = list(run)
        yield i, run
        i += len(run)


def _bottleneck(projs, h, tag: bool = True):
    """σ on the fully reduced [B, T, g, r] first-stage output. The reduced tensor (before σ) is
    what low-rank checkpointing saves: recomputing from it needs no collective."""
    h = constrain(h, RANK_ACT)
    if tag:
        h = checkpoint_name(h, "lowrank")
    return jax.nn.silu(h) if projs[0].kind == "cola" else h


def _first_stage(projs, x, grouped: bool, norm=None):
    """[(run, [B, T, g, width])] for the first stages of `projs` reading x (after `norm`, if given)."""
    ctx = rules.current()
    if (norm is not None and ctx is not None and ctx[1].online_norm and ctx[0].shape["tensor"] > 1
            and all(p.factored for p in projs)):
        # BTP: norm statistics travel in the same all-reduce as the A partial products.
        from boost_jax.parallel.online_norm import online_norm_matmul
        a = jnp.stack([p.first_weight() for p in projs]).astype(x.dtype)
        h = online_norm_matmul(x, norm.scale[...], a, eps=norm.eps, mesh=ctx[0], impl=norm.impl)
        return [(projs, _bottleneck(projs, h, tag=False))]  # tagged inside, before the division
    if norm is not None:
        x = norm(x)
    out = []
    runs = _runs(projs, lambda p: p.first()) if grouped else ((i, [p]) for i, p in enumerate(projs))
    for _, run in runs:
        w = jnp.stack([p.first_weight() for p in run]).astype(x.dtype)  # [g, d_in, width]
        h = jnp.einsum("btd,gdr->btgr", x, w)
        out.append((run, _bottleneck(run, h) if run[0].factored else h))
    return out


def _spatial_temporal(p: Projection, x, mesh) -> jax.Array:
    """One projection as PrimePar P(n x n) GEMMs on the (fsdp, tensor) grid: the sequence splits over
    fsdp, the contracted width over tensor, the batch over data; only point-to-point traffic inside.
    Weights are stored in the ordinary layout and skewed at use (a block permutation)."""
    from boost_jax.parallel.spatial_temporal import skew_sharded, skew_weight, st_matmul
    n = mesh.shape["tensor"]
    kw = dict(mesh=mesh, row_axis="fsdp", col_axis="tensor", batch_axes="data" if mesh.shape["data"] > 1 else None)

    def matmul(v, w):
        return st_matmul(skew_sharded(v, **kw), skew_weight(w.astype(v.dtype), n), **kw)

    if not p.factored:
        return matmul(x, p.w[...])
    h = checkpoint_name(matmul(x, p.a[...]), "lowrank")
    return matmul(jax.nn.silu(h) if p.kind == "cola" else h, p.b[...])


def project(projs, x, *, grouped: bool = True, norm=None) -> list[jax.Array]:
    """Apply projections that share input x (optionally normalised by `norm` first): one GEMM per
    run of equal first-stage shapes, one batched dot_general per run of equal B shapes."""
    ctx = rules.current()
    if ctx is not None and projs[0].group in ctx[1].st_groups:
        x = norm(x) if norm is not None else x
        return [_spatial_temporal(p, x, ctx[0]) for p in projs]
    outs = []
    for run, h in _first_stage(projs, x, grouped, norm):
        if not run[0].factored:
            outs.extend(h[:, :, i] for i in range(len(run)))
            continue
        sub = _runs(run, lambda p: p.b) if grouped else ((i, [p]) for i, p in enumerate(run))
        for i, group in sub:
            b = jnp.stack([p.second_weight() for p in group]).astype(h.dtype)  # [g, r, d_out]
            y = jnp.einsum("btgr,gro->btgo", h[:, :, i:i + len(group)], b)
            outs.extend(y[:, :, j] for j in range(len(group)))
    return outs
