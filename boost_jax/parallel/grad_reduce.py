"""Gradient accumulation with one reduction over `data` per optimizer step, in `parallel.grad_reduce_dtype`.

Left to GSPMD, a step of `grad_accum` micro-batches all-reduces the gradient over `data` once per
micro-batch, in the backward's dtype. Here each data replica computes its own gradient: the
micro-batch is viewed as [data, rows/data, T+1] and the loss vmapped over that dim with
`spmd_axis_name="data"`, under the strategy's rules with `data` removed; the per-replica gradients
are accumulated in float32, still split over `data`, and summed once at the end (at grad_accum 1
no loop and no accumulator: each weight's gradient summed as the backward makes it). Over `fsdp` the
gradient is still reduce-scattered once per micro-batch: that keeps the accumulator sharded like
the parameters, and deferring it would need an unsharded gradient buffer on every device.

Used when the mesh has data > 1 and no pipeline or spatial-temporal projections (whose schedules
place their own reductions); otherwise the plain accumulation loop runs. The mesh and strategy are
passed in by the step builder (runtime/step.py), never read from the ambient rules, so the step
compiles to one program wherever it is traced.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.kernels import platform
from boost_jax.parallel import rules


def without_axis(strategy: rules.Strategy, *axis: str) -> rules.Strategy:
    """The strategy with the `axis` names removed from every rule (a rule left with no axes replicates)."""

    def drop(axes):
        kept = tuple(a for a in rules.as_tuple(axes) if a not in axis)
        return kept[0] if len(kept) == 1 else (kept or None)

    return dataclasses.replace(strategy, rules=tuple((name, drop(axes)) for name, axes in strategy.rules))


def _leading(batch) -> tuple[int, int]:
    """(grad_accum, micro-batch rows) of a batch pytree [grad_accum, rows, ...]."""
    return jax.tree.leaves(batch)[0].shape[:2]


def hides_trip_count() -> bool:
    """Whether `each_micro_batch` hides its loop's trip count: in a step built for GPUs."""
    return platform.name() == "gpu"


def each_micro_batch(micro, init, batch, loss_shape: tuple = (), first_loss=None):
    """`jax.lax.scan(micro, init, batch)` over an accumulation loop's micro-batches (`micro(carry,
    x) -> (carry, loss)`, a float32 loss of `loss_shape`): (carry, the mean loss). `first_loss`: the
    loss of a micro-batch run before the loop (its gradient in `init`), counted in the mean.

    In a step built for GPUs (kernels/platform.py) the loop's trip count is hidden from XLA (passed
    through an optimization barrier), so XLA:GPU runs it as written, one micro-batch per iteration.
    With a known count its while-loop double buffering (a project GPU flag) unrolls the loop, two
    micro-batches per iteration or all of them at grad_accum 2, and the scheduler ran a micro-batch's
    forward before the previous one's backward: both kept their activations (the deviceless peaks,
    known against hidden count: benchmarks/RESULTS.md, 2026-11-27 "the GPU step's accumulation loop
    runs one micro-batch per iteration"). The inner layer scans keep their known counts and their
    double buffering. The price: the GPU reads the loop's predicate back once per
    micro-batch (a loop of unknown count), not measured. The collectives inside this loop have no
    known trip count in the GPU program: they run grad_accum times (tools/aot.py counts them so).
    The CPU program keeps the scan (no such flag there; its comm report reads every trip count)."""
    if not hides_trip_count():
        carry, losses = jax.lax.scan(micro, init, batch)
        return carry, (losses if first_loss is None else jnp.concatenate([first_loss[None], losses])).mean()
    a = _leading(batch)[0]

    def step(i, carry):
        acc, total = carry
        acc, loss = micro(acc, jax.tree.map(lambda t: jax.lax.dynamic_index_in_dim(t, i, keepdims=False), batch))
        return acc, total + loss

    trips = jax.lax.optimization_barrier(jnp.int32(a))  # a count XLA cannot read: no unrolling
    total = jnp.zeros(loss_shape, jnp.float32) if first_loss is None else first_loss
    carry, total = jax.lax.fori_loop(0, trips, step, (init, total))
    return carry, total.mean() / (a + (first_loss is not None))


# `_plain` runs the first micro-batch before its loop from this many on (a loop of at least two
# trips left: XLA:CPU inlines a loop of one, whose count it reads through the barrier).
PEEL_FROM = 3


def loop_trips(grad_accum: int, mesh=None, strategy=None) -> int:
    """How many times the accumulation loop of `accumulate_grads` runs: `_plain` runs its first
    micro-batch before the loop (the pipeline's loop runs them all). What a tool counts for a loop
    whose trip count the GPU step hides."""
    if grad_accum < PEEL_FROM or (
        mesh is not None and (mesh.shape.get("pipeline", 1) > 1 or island_applies(mesh, strategy))
    ):
        return grad_accum
    return grad_accum - 1


def _plain(grad_fn, params, batch):
    """GSPMD's own placement: the scan's gradients are reduced where XLA puts it (per micro-batch).
    From PEEL_FROM micro-batches on, the first runs before the loop and its gradient starts the
    accumulator: no zero fill and one pass over the gradients fewer (the sums are the same)."""
    a = _leading(batch)[0]
    if a == 1:
        return grad_fn(params, jax.tree.map(lambda x: x[0], batch))

    def micro(acc, tokens):
        l, g = grad_fn(params, tokens)
        return jax.tree.map(jnp.add, acc, g), l

    if a < PEEL_FROM:
        grads, loss = each_micro_batch(micro, jax.tree.map(jnp.zeros_like, params), batch)
        return loss, jax.tree.map(lambda g: g / a, grads)
    loss, grads = grad_fn(params, jax.tree.map(lambda x: x[0], batch))
    init = jax.tree.map(lambda p, g: g.astype(jnp.result_type(p, g)), params, grads)  # 0 + g's dtype
    grads, loss = each_micro_batch(micro, init, jax.tree.map(lambda x: x[1:], batch), first_loss=loss)
    return loss, jax.tree.map(lambda g: g / a, grads)


def island_applies(mesh, strategy) -> bool:
    return mesh.shape.get("data", 1) > 1 and mesh.shape.get("pipeline", 1) == 1 and not strategy.st_groups


def accumulation_pieces(batch, mesh=None, strategy=None) -> int:
    """How many losses `accumulate_grads` averages: one per micro-batch, per data replica where the
    island runs. A loss that is a sum scaled by pieces / count comes out as the mean over `count`."""
    a = _leading(batch)[0]
    if mesh is None or not island_applies(mesh, strategy):
        return a
    return a * mesh.shape["data"]


def accumulate_grads(grad_fn, params, batch, mesh=None, strategy=None):
    """(mean loss, mean gradient) of `grad_fn(params, tokens) -> (loss, grads)` over a batch
    [grad_accum, micro_batch, T+1] (or a pytree of such leading dims) on `mesh` under `strategy`
    (None: one device), reduced over `data` once (see the module docstring)."""
    if mesh is None or not island_applies(mesh, strategy):
        return _plain(grad_fn, params, batch)
    d, fsdp = mesh.shape["data"], mesh.shape.get("fsdp", 1)
    a, b = _leading(batch)
    # Rows are split data-major (P(None, ("data", "fsdp"))): replica i owns rows [i*b/d, (i+1)*b/d).
    rows = NamedSharding(mesh, P(None, "data", "fsdp" if fsdp > 1 else None))
    x = jax.tree.map(lambda t: jax.lax.with_sharding_constraint(t.reshape(a, d, b // d, *t.shape[2:]), rows), batch)
    inner = without_axis(strategy, "data")

    def local(p, tokens):
        with rules.use_rules(mesh, inner):
            return grad_fn(p, tokens)

    per_replica = jax.vmap(local, in_axes=(None, 0), spmd_axis_name="data")
    split = lambda t: jax.lax.with_sharding_constraint(  # noqa: E731 - [data, ...] stays split over data
        t, NamedSharding(mesh, P("data", *([P.UNCONSTRAINED] * (t.ndim - 1))))
    )

    dtype = jnp.dtype(strategy.grad_reduce_dtype)
    reduce = lambda g, p: (g.astype(dtype).sum(0).astype(jnp.float32) / (a * d)).astype(p.dtype)  # noqa: E731
    if a == 1:
        # No loop and no accumulator: each weight's gradient is summed over `data` straight from the
        # backward, so its all-reduce can run beside the backward of the layers before it.
        l, g = per_replica(params, jax.tree.map(lambda t: t[0], x))
        return l.mean(), jax.tree.map(lambda g, p: reduce(g.astype(jnp.float32), p), g, params)

    def micro(acc, tokens):
        l, g = per_replica(params, tokens)
        return jax.tree.map(lambda s, g: split(s + g.astype(jnp.float32)), acc, g), l

    zeros = jax.tree.map(lambda p: split(jnp.zeros((d,) + p.shape, jnp.float32)), params)
    acc, loss = each_micro_batch(micro, zeros, x, loss_shape=(d,))  # one loss per data replica
    return loss, jax.tree.map(reduce, acc, params)
