"""Applying projections: every projection is a linear kind (`model/kinds/`: dense W, low-rank B·A,
CoLA B·σ(A·x), tensor-train, sparse + low-rank), seen here only through the kind interface.

Every projection has two stages so that parallel strategies and kernels can act on the bottleneck:
the first ([d_in, width]) and the second ([width, d_out], nothing for dense). Projections that read
the same input run their first stages as ONE GEMM over stacked weights, and their second stages as
one batched dot_general (BOOST's linear layer grouping); parameters keep their own names. The r-wide
first-stage output is tagged `lowrank` for activation checkpointing (before σ).
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from boost_jax.kernels.rmsnorm import rmsnorm as rmsnorm_rows
from boost_jax.model.kinds import kind_class
from boost_jax.model.kinds.base import LinearKind
from boost_jax.parallel import rules
from boost_jax.parallel.rules import constrain, gathered, logical_spec, spec_for, weight_einsum

RANK_ACT = ("act_batch", "act_seq", None, "act_rank")  # [B, T, group, r]
WHOLE_ROWS = ("act_batch", "act_seq", None)


def Projection(m, d_in: int, d_out: int, *, axes: tuple[str, str], group: str, rngs: nnx.Rngs,
               param_dtype=jnp.float32) -> LinearKind:
    """A projection of the kind `m.linear` names (`m`: the model config section)."""
    return kind_class(m.linear)(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)


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


def _runs(projs, shape):
    """Consecutive projections whose `shape(p)` agree: each run is one grouped GEMM."""
    i = 0
    for _, run in itertools.groupby(projs, key=shape):
        run = list(run)
        yield i, run
        i += len(run)


def _bottleneck(projs, h, tag: bool = True):
    """σ on the fully reduced [B, T, g, r] first-stage output. The reduced tensor (before σ) is
    what low-rank checkpointing saves: recomputing from it needs no collective."""
    h = constrain(h, RANK_ACT)
    if tag:
        h = checkpoint_name(h, "lowrank")
    return projs[0].bottleneck(h)


def _use(dtype):
    """The `use` hook for stage weights feeding a GEMM in `dtype`: gathered (FSDP) in that dtype."""
    return lambda w, names: gathered(w, names, dtype)


def _first_stage(projs, x, grouped: bool, norm=None):
    """[(run, [B, T, g, width])] for the first stages of `projs` reading x (after `norm`, if given)."""
    ctx = rules.current()
    if (norm is not None and ctx is not None and ctx[1].online_norm and ctx[0].shape["tensor"] > 1
            and all(p.factored for p in projs)):
        # BTP: norm statistics travel in the same all-reduce as the A partial products.
        from boost_jax.parallel.online_norm import online_norm_matmul
        a = jnp.stack([p.first_weight(_use(x.dtype)) for p in projs])
        h = online_norm_matmul(x, norm.scale[...], a, eps=norm.eps, mesh=ctx[0], impl=norm.impl)
        return [(projs, _bottleneck(projs, h, tag=False))]  # tagged inside, before the division
    if norm is not None:
        x = norm(x)
    out = []
    runs = _runs(projs, lambda p: p.first_shape) if grouped else ((i, [p]) for i, p in enumerate(projs))
    for _, run in runs:
        w = jnp.stack([p.first_weight(_use(x.dtype)) for p in run])  # [g, d_in, width]
        h = weight_einsum("btd,gdr->btgr", x, w)
        out.append((run, _bottleneck(run, h) if run[0].factored else h))
    return out


def _spatial_temporal(p: LinearKind, x, ctx) -> jax.Array:
    """One projection as PrimePar P(n x n) GEMMs on the (fsdp, tensor) grid. The grid takes the
    activations as the trainer holds them (batch over data x fsdp, features over tensor: the M-block
    of grid row r is fsdp shard r's sequences), so only the skew enters: one collective-permute per
    GEMM input, the Cannon rings inside, and one permute per weight from its stored layout (its
    transpose returns dW), with no gather of any tensor."""
    from boost_jax.parallel.spatial_temporal import skew_sharded, skew_weight_sharded, st_matmul
    mesh, strategy = ctx
    grid = dict(mesh=mesh, row_axis="fsdp", col_axis="tensor")
    kw = dict(grid, batch_axes="data" if mesh.shape["data"] > 1 else None, row_dim=0)

    def skewed(get, dtype):
        held = []

        def use(w, names):  # the parameter as stored; remember where its blocks are
            held.append((w, tuple(spec_for(names, w.shape, mesh, strategy.rules)) + (None, None)))
            return w

        w = get(use)
        dims = held[0][1][:2] if len(held) == 1 and held[0][0] is w else None
        if dims is None or not set(dims) <= {"fsdp", "tensor", None}:
            dims = ("fsdp", "tensor")  # built from several parameters: laid out plainly by GSPMD first
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(*dims)))
        return skew_weight_sharded(w.astype(dtype), dims, **grid)

    def matmul(v, get):
        return st_matmul(skew_sharded(v, **kw), skewed(get, v.dtype), **kw)

    if not p.factored:
        return matmul(x, p.first_weight)
    h = checkpoint_name(matmul(x, p.first_weight), "lowrank")
    return matmul(p.bottleneck(h), p.second_weight)


def project(projs, x, *, grouped: bool = True, norm=None) -> list[jax.Array]:
    """Apply projections that share input x (optionally normalised by `norm` first): one GEMM per
    run of equal first-stage shapes, one batched dot_general per run of equal B shapes."""
    ctx = rules.current()
    if ctx is not None and projs[0].group in ctx[1].st_groups:
        x = norm(x) if norm is not None else x
        return _with_extra(projs, [_spatial_temporal(p, x, ctx) for p in projs], x, None)
    outs = []
    for run, h in _first_stage(projs, x, grouped, norm):
        if not run[0].factored:
            outs.extend(h[:, :, i] for i in range(len(run)))
            continue
        sub = _runs(run, lambda p: p.second_shape) if grouped else ((i, [p]) for i, p in enumerate(run))
        for i, group in sub:
            b = jnp.stack([p.second_weight(_use(h.dtype)) for p in group])  # [g, r, d_out]
            y = weight_einsum("btgr,gro->btgo", h[:, :, i:i + len(group)], b)
            outs.extend(y[:, :, j] for j in range(len(group)))
    return _with_extra(projs, outs, x, norm)


def _with_extra(projs, outs, x, norm):
    """Add the kinds' extra terms (e.g. a sparse S·x), computed from the normalised input in whole
    rows: a strategy that splits the input features gathers it once for the group."""
    if not any(p.has_extra for p in projs):
        return outs
    rows = constrain(x, WHOLE_ROWS)
    if norm is not None:  # normalised locally on the gathered rows, with the (small) scale gathered
        scale = gathered(norm.scale[...], (None,))
        rows = constrain(rmsnorm_rows(rows, scale, norm.eps, impl="xla")[0], WHOLE_ROWS)
    return [y + p.extra(rows).astype(y.dtype) if p.has_extra else y for p, y in zip(projs, outs)]
