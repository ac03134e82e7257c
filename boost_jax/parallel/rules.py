"""Logical-axis sharding: a strategy is a table of logical axis -> mesh axes, never a model fork.

Modules name the axes of their parameters (`embed`, `rank`, `heads`, ...) and of the activations
they produce (`act_batch`, `act_embed`, ...). `use_rules(mesh, strategy)` makes a strategy current;
`constrain(x, names)` then pins an activation's layout, and `spec_for(names, shape)` turns a
parameter's names into a PartitionSpec. With no strategy active both are no-ops, so single-device
code pays nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# (logical name, mesh axis | tuple of axes | None). A name may appear several times: first fit wins,
# so a later row is a fallback used when the earlier axes are taken by another dim of the same array,
# do not divide it, or have size 1 on this mesh. An explicit None row means "replicate, stop looking".
Rules = Sequence[tuple[str, object]]


@dataclasses.dataclass(frozen=True)
class Strategy:
    name: str
    rules: tuple
    online_norm: bool = False  # BTP: a norm in front of row-parallel A's sends its statistics with them
    st_groups: frozenset = frozenset()  # projection groups run as PrimePar P(n x n) on (fsdp, tensor)
    microbatches: int = 1  # pipeline micro-batches per pass (used when the mesh has pipeline > 1)
    pipeline_schedule: str = "gpipe"  # gpipe | circular | 1f1b (boost_jax/parallel/pipeline/)
    pipeline_repeats: int = 1  # circular: layer chunks per stage (V)
    grad_reduce_dtype: str = "float32"  # dtype of the once-per-step gradient all-reduce over `data`
    context_attention: str = "ring"  # ring | all_gather: attention when `context` splits the sequence
    context_kv: str = "full"  # full | bottleneck: what the ring passes (boost_jax/parallel/context.py)

    @property
    def compute_rules(self) -> tuple:
        """The rules a weight is used under: its stored layout without `fsdp` (gathered for use)."""
        return tuple((name, axes) for name, axes in self.rules if "fsdp" not in as_tuple(axes))


_CURRENT: contextvars.ContextVar[tuple[Mesh, Strategy] | None] = contextvars.ContextVar("rules", default=None)


@contextlib.contextmanager
def use_rules(mesh: Mesh, strategy: Strategy):
    token = _CURRENT.set((mesh, strategy))
    try:
        yield
    finally:
        _CURRENT.reset(token)


def current() -> tuple[Mesh, Strategy] | None:
    return _CURRENT.get()


def traced_mesh(mesh: Mesh):
    """`mesh` as the current trace sees it: inside a `shard_map` that made some of its axes manual (the
    1F1B pipeline's stages), the context's abstract mesh with those axes manual, which a sharding or a
    nested `shard_map` must name; elsewhere `mesh` itself."""
    here = jax.sharding.get_abstract_mesh()
    if here.empty or not here.manual_axes or tuple(here.axis_names) != tuple(mesh.axis_names):
        return mesh
    return here


def as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def spec_for(names: Sequence[str | None], shape: Sequence[int], mesh: Mesh, rules: Rules) -> P:
    """PartitionSpec for an array whose dims carry `names` (see `Rules` for the first-fit order)."""
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape):
        chosen = None
        for logical, axes in rules:
            if logical != name:
                continue
            if axes is None:
                break
            axes = tuple(a for a in as_tuple(axes) if mesh.shape.get(a, 1) > 1)
            size = 1
            for a in axes:
                size *= mesh.shape[a]
            if axes and used.isdisjoint(axes) and dim % size == 0:
                chosen = axes
                break
        if chosen:
            used.update(chosen)
            out.append(chosen[0] if len(chosen) == 1 else chosen)
        else:
            out.append(None)
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def logical_spec(names: Sequence[str | None], shape: Sequence[int]) -> P | None:
    """The current strategy's spec for an activation, or None outside a strategy."""
    ctx = _CURRENT.get()
    if ctx is None:
        return None
    mesh, strategy = ctx
    return spec_for(names, shape, mesh, strategy.rules)


def per_shard(fn, args: Sequence[jax.Array], names: Sequence[Sequence[str | None]], out_names: Sequence[str | None]):
    """`fn(*args)` -> one array laid out as `out_names`, where XLA cannot partition `fn` inside a region
    manual over some mesh axes (the 1F1B pipeline's stages): jax's custom partitioning (cuDNN's fused
    attention) needs the whole mesh there. Then `fn` runs on each device's shard, in a `shard_map`
    over the axes left automatic, its arguments laid out as `names` say under the current rules (fn
    must treat shards independently: attention over a head shard). Elsewhere: `fn(*args)` as XLA
    partitions it."""
    ctx = _CURRENT.get()
    here = jax.sharding.get_abstract_mesh()
    if ctx is None or here.empty or not here.manual_axes:
        return fn(*args)
    mesh, strategy = ctx
    specs = tuple(spec_for(n, a.shape, mesh, strategy.rules) for n, a in zip(names, args))
    out = jax.eval_shape(fn, *args)
    return jax.shard_map(
        fn,
        mesh=traced_mesh(mesh),
        in_specs=specs,
        check_vma=False,
        out_specs=spec_for(out_names, out.shape, mesh, strategy.rules),
    )(*args)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pin an activation to the current strategy's layout (no-op without one)."""
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    mesh, strategy = ctx
    return jax.lax.with_sharding_constraint(
        x, NamedSharding(traced_mesh(mesh), spec_for(names, x.shape, mesh, strategy.rules))
    )


def regathered(x: jax.Array, names: Sequence[str | None], stored: Sequence[str | None]) -> jax.Array:
    """An activation laid out as `stored`, pinned to the layout `names` for the GEMM reading it; its
    gradient goes back to `stored` directly. Megatron-SP's pair: the residual split along the sequence
    over `tensor` is all-gathered in front of the column-parallel GEMMs (left to GSPMD, it gathers the
    weight over `tensor` instead where the tokens outweigh it, and moves the output's columns by an
    all-to-all), and the GEMM's partial input gradient is reduce-scattered into the sequence split
    (pinned to `names` on its way back, it would be all-reduced, then sliced). Where both names give
    one layout, or outside a strategy: x."""
    ctx = _CURRENT.get()
    if ctx is None:
        return x
    mesh, strategy = ctx
    to, back = (spec_for(n, x.shape, mesh, strategy.rules) for n in (names, stored))
    if to == back:
        return x
    return _regather(x, NamedSharding(traced_mesh(mesh), to), NamedSharding(traced_mesh(mesh), back))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _regather(x, to, back):
    return jax.lax.with_sharding_constraint(x, to)


_regather.defvjp(
    lambda x, to, back: (_regather(x, to, back), None),
    lambda to, back, _, g: (jax.lax.with_sharding_constraint(g, back),),
)


def gathered(w: jax.Array, names: Sequence[str | None], dtype=None) -> jax.Array:
    """A weight in its compute layout and `dtype` (default: its own): FSDP's all-gather happens here,
    right before use, on the local shard already cast to `dtype` (a bf16 gather moves half the bytes
    of the float32 master weight). The backward casts the incoming gradient to the strategy's
    `grad_reduce_dtype` first and lays it out as the parameter is stored, so the reduction over
    `fsdp` that this layout change implies runs in that dtype; it is returned in `w`'s dtype.
    Being explicit also keeps XLA from choosing a weight-gradient layout it mis-partitions (seen with
    jax 0.10: a weight split (tensor, fsdp) under a batch split over fsdp got its gradient
    all-reduced across different fsdp blocks). Outside a strategy: `w.astype(dtype)`."""
    dtype = jnp.dtype(dtype or w.dtype)
    ctx = _CURRENT.get()
    if ctx is None:
        return w.astype(dtype)
    mesh, strategy = ctx
    stored = NamedSharding(traced_mesh(mesh), spec_for(names, w.shape, mesh, strategy.rules))
    compute = NamedSharding(traced_mesh(mesh), spec_for(names, w.shape, mesh, strategy.compute_rules))
    if not jnp.issubdtype(w.dtype, jnp.floating):  # integer indices: no gradient, no cast
        return jax.lax.with_sharding_constraint(w, compute)
    return _gather(w, stored, compute, dtype, jnp.dtype(strategy.grad_reduce_dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(w, stored, compute, dtype, reduce_dtype):
    # Cast where the shard lives (pinned there), then change layout: the all-gather carries `dtype`.
    local = jax.lax.with_sharding_constraint(w.astype(dtype), stored)
    return jax.lax.with_sharding_constraint(local, compute)


def _gather_fwd(w, stored, compute, dtype, reduce_dtype):
    return _gather(w, stored, compute, dtype, reduce_dtype), jnp.zeros((0,), w.dtype)


def _gather_bwd(stored, compute, dtype, reduce_dtype, like, g):
    # Widen first, in the compute layout (where autodiff's transpose would put it: XLA partitions the
    # gradient as before), then lay out as stored: whatever reduction is left runs in reduce_dtype.
    g = jax.lax.with_sharding_constraint(g.astype(reduce_dtype), compute)
    return (jax.lax.with_sharding_constraint(g, stored).astype(like.dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def weight_einsum(spec: str, x: jax.Array, w: jax.Array, preferred_element_type=None) -> jax.Array:
    """einsum(spec, x, w) with w cast to x's dtype (the GEMM runs in x's dtype), for a weight w whose
    gradient is computed with OUTPUT in the strategy's `grad_reduce_dtype`: the reduction over the
    batch axes that GSPMD places right on that product (x's rows are split over data/fsdp) then runs
    in that dtype instead of x's (left to autodiff it would be x's: bf16 under bf16 compute). The
    input gradient is computed in x's dtype. `spec`: two operands, no ellipsis, every index in two of
    x, w and the output. On a mesh with a `tensor` axis the backward computes the weight gradient
    together with the input gradient (`_gradients_together`). Outside a strategy: the plain einsum."""
    ctx = _CURRENT.get()
    if ctx is None:
        return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=preferred_element_type)
    # Not inside shard_map: an optimization barrier there gives its outputs the union of their manual
    # axes (and the maps' GEMMs are local: no all-reduce of their input gradient to run beside).
    manual = jax.sharding.get_abstract_mesh().manual_axes
    together = _gradients_together if ctx[0].shape.get("tensor", 1) > 1 and not manual else lambda *a: a
    if not _batch_is_split(*ctx):
        x, wc = together(x, w.astype(x.dtype))  # the barrier before the gradient's cast to w's dtype
        return jnp.einsum(spec, x, wc, preferred_element_type=preferred_element_type)
    x, w = together(x, w)
    return _weight_einsum(spec, preferred_element_type, jnp.dtype(ctx[1].grad_reduce_dtype), x, w)


@jax.custom_vjp
def _gradients_together(x, w):
    """(x, w) unchanged; the backward hands on their cotangents through one optimization barrier, so
    the weight gradient is computed before the input gradient is used. Where the input gradient is
    all-reduced over `tensor` (a GEMM whose output dim is split there: BTP's B, Megatron's
    column-parallel weights), XLA's latency-hiding scheduler then runs the weight-gradient GEMM beside
    that all-reduce; left free, it schedules every weight gradient of the backward at its end, beside
    the last all-reduce alone (benchmarks/RESULTS.md 2026-11-28, weight gradients beside the all-reduces)."""
    return x, w


_gradients_together.defvjp(lambda x, w: ((x, w), None), lambda _, g: tuple(jax.lax.optimization_barrier(g)))


def _batch_is_split(mesh: Mesh, strategy: Strategy) -> bool:
    """Whether the current rules split the batch over devices, i.e. a weight gradient is summed
    across them right at its GEMM. Not so on one device, under tensor parallelism alone, or inside
    the data island (parallel/grad_reduce.py) and the pipeline without fsdp, which sum per-replica
    float32 accumulators once instead. Only then does `weight_einsum` need its custom rule, which
    costs something under `dots`/`lowrank` remat: the backward recomputes the rule's forward GEMM
    for its residuals besides the output itself (an extra second-stage GEMM per projection)."""
    # The tokens are split over the batch axes and, under context parallelism, the sequence axis.
    axes = {
        a
        for row in ("act_batch", "act_seq")
        for a in next((as_tuple(a) for name, a in strategy.rules if name == row), ())
    }
    return math.prod(mesh.shape.get(a, 1) for a in axes) > 1


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _weight_einsum(spec, out_dtype, reduce_dtype, x, w):
    return jnp.einsum(spec, x, w.astype(x.dtype), preferred_element_type=out_dtype)


def _weight_einsum_fwd(spec, out_dtype, reduce_dtype, x, w):
    wc = w.astype(x.dtype)
    return jnp.einsum(spec, x, wc, preferred_element_type=out_dtype), (x, wc, jnp.zeros((0,), w.dtype))


def _weight_einsum_bwd(spec, out_dtype, reduce_dtype, res, g):
    x, wc, like = res
    (xs, ws), out = (part.split(",") for part in spec.replace(" ", "").split("->"))
    g = g.astype(x.dtype)
    dx = jnp.einsum(f"{out[0]},{ws}->{xs}", g, wc)
    dw = jnp.einsum(f"{xs},{out[0]}->{ws}", x, g, preferred_element_type=reduce_dtype)
    # Inside shard_map: sum over the manual axes x varies on and w does not (autodiff's own rule).
    spread = tuple(sorted(_varying(dw) - _varying(wc)))
    if spread:
        dw = jax.lax.psum(dw, spread)
    return dx, dw.astype(like.dtype)


def _varying(x) -> set:
    """The shard_map axes x varies over (empty outside shard_map)."""
    t = jax.typeof(x)
    manual = getattr(t, "manual_axis_type", None)
    return set(manual.varying) if manual is not None else set(getattr(t, "vma", ()))


_weight_einsum.defvjp(_weight_einsum_fwd, _weight_einsum_bwd)


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids] for a weight table (an embedding) in its compute dtype, whose gradient (a
    scatter-add of the rows' gradients, then reduced over the batch axes) is accumulated in the
    strategy's `grad_reduce_dtype` when that is wider. Outside a strategy: table[ids]."""
    ctx = _CURRENT.get()
    if ctx is None:
        return table[ids]
    wide = jnp.promote_types(table.dtype, ctx[1].grad_reduce_dtype)  # widen only: the rows are unchanged
    return table.astype(wide)[ids].astype(table.dtype)
