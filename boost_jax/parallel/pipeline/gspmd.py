"""The GPipe and circular (interleaved) pipeline schedules over the `pipeline` mesh axis, written for
GSPMD (`parallel.pipeline_schedule` = gpipe | circular; stack.py `Pipeline` calls `run`).

The layer stack [L, ...] is cut into S stages (the `layers` dim split over `pipeline`), the batch
into M micro-batches. At every tick all S stages run at once (a vmap over the stage dim, which GSPMD
splits over `pipeline`), then the stage outputs shift one stage down (a roll of the stage dim: one
collective-permute) and the next micro-batch enters stage 0: M + S - 1 ticks, V M + S - 1 for
circular (arithmetic.py). Autodiff of the loop gives the backward (every micro-batch's activations
are kept, as in GPipe; combine with a remat policy). Tensor parallelism acts inside each stage
unchanged: the strategy's constraints are batched with `spmd_axis_name="pipeline"`. Circular's
ring, its M >= S condition and its weight reorder: `circular`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.parallel import rules
from boost_jax.parallel.grad_reduce import without_axis
from boost_jax.parallel.pipeline.arithmetic import layout_chunks, ticks
from boost_jax.parallel.pipeline.layout import (
    STEP_COPIES,
    copy_spec,
    from_microbatches,
    once_per_pass_axes,
    replica_copies,
    stage_layout,
    to_microbatches,
)


@jax.custom_vjp
def shift_stages(x: jax.Array) -> jax.Array:
    """Stage s's output becomes stage s+1's input: a roll of the stage dim, one collective-permute.
    The custom VJP rolls the cotangent back the same way (one permute); autodiff of jnp.roll would
    transpose its slice + concatenate into two one-way permutes per tick."""
    return jnp.roll(x, 1, axis=0)


shift_stages.defvjp(lambda x: (shift_stages(x), None), lambda _, g: (jnp.roll(g, -1, axis=0),))


def _enter(micro, inputs, t, microbatches):
    """Micro-batch t enters stage 0 (after the bubble ticks the slot is never read again)."""
    stage_ids = jnp.arange(inputs.shape[0]).reshape((inputs.shape[0],) + (1,) * (micro.ndim - 1))
    entering = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, microbatches - 1), keepdims=False)
    return jnp.where(stage_ids == 0, entering[None], inputs)


def gpipe(run_stages, staged, x, stages, microbatches, unroll, rows=None):
    """The schedule: `run_stages(staged, inputs [S, b, ...][, rows]) -> [S, b, ...]` runs every stage
    once; `rows` (per-row inputs, see pipeline.py `run`) move down the stages with their micro-batch."""
    micro = to_microbatches(x, microbatches)  # [M, b, ...]
    micro_rows = None if rows is None else jax.tree.map(lambda a: to_microbatches(a, microbatches), rows)

    def tick(carry, t):
        inputs, outputs, row_inputs = carry
        inputs = _enter(micro, inputs, t, microbatches)
        if rows is None:
            out = run_stages(staged, inputs)
        else:
            row_inputs = jax.tree.map(lambda m, i: _enter(m, i, t, microbatches), micro_rows, row_inputs)
            out = run_stages(staged, inputs, row_inputs)
            row_inputs = jax.tree.map(lambda a: jnp.roll(a, 1, axis=0), row_inputs)  # integers: no gradient
        # Every stage files its output in its own row of `outputs` (stage-local, no traffic); the last
        # stage's row ends up holding micro-batch t-(S-1) at slot t-(S-1). Earlier ticks write slot 0,
        # overwritten later.
        done = jnp.maximum(t - (stages - 1), 0)
        outputs = jax.lax.dynamic_update_index_in_dim(outputs, out[:, None], done, 1)
        return (shift_stages(out), outputs, row_inputs), None

    inputs = jnp.zeros((stages,) + micro.shape[1:], x.dtype)
    outputs = jnp.zeros((stages,) + micro.shape, x.dtype)  # [S, M, b, ...]
    row_inputs = (
        None if rows is None else jax.tree.map(lambda m: jnp.zeros((stages,) + m.shape[1:], m.dtype), micro_rows)
    )
    (_, outputs, _), _ = jax.lax.scan(
        tick, (inputs, outputs, row_inputs), jnp.arange(microbatches + stages - 1), unroll=unroll
    )
    # One hand-over of the finished micro-batches from the last stage, instead of one per tick.
    outputs = outputs[stages - 1]
    return from_microbatches(outputs)


def circular(run_stages, staged, x, stages, microbatches, unroll, rows=None, *, repeats):
    """The circular (interleaved) schedule: `run_stages(staged, inputs [S, b, ...], chunk [S][, rows])`
    runs every stage once, stage s on its chunk `chunk[s]`. Item k = v M + m is micro-batch m's round
    v; stage s works on item t - s at tick t, so stage s-1's output of the last tick is its input and
    the ring wraps: stage 0 takes micro-batch t fresh for t < M, else micro-batch t mod M's output of
    round v-1 from stage S-1, which the shift hands to stage 0 at tick t - M + S - 1 <= t - 1 (M >= S)
    and stage 0 files in `loop` until it is read. After V M + S - 1 ticks `loop`'s stage-0 row holds
    every micro-batch's last round. Ticks outside 0 <= t - s < V M compute on stale inputs whose
    outputs are overwritten before they are read (zero cotangent).

    Stage s holds the V chunks s, S+s, 2S+s, ... of L/(S V) layers; each micro-batch goes round the
    ring V times (stage S-1 hands to stage 0: the same roll, which wraps), so a tick runs L/(S V)
    layers: bubble (S-1)/(V M + S-1). It needs M >= S: micro-batch m's round v leaves stage S-1 at
    tick v M + m + S - 1 and its round v+1 starts at stage 0 at tick (v+1) M + m, which must be later;
    the output waits in between in a stage-local buffer [M, b, ...] (the size of GPipe's). The stored
    [L, ...] stacks are split over `pipeline` in contiguous blocks (checkpoints are the same for
    every schedule), which the chunks are not: the circular layout moves the stage weights once per
    pass, before the tick loop (one all-to-all over `pipeline` per weight, in its stored fsdp/tensor
    split), and their summed gradient once after it (pinned by layout.py `on_stages`; left to GSPMD
    the gradient's reorder fell back to replicating it)."""
    micro = to_microbatches(x, microbatches)  # [M, b, ...]
    micro_rows = None if rows is None else jax.tree.map(lambda a: to_microbatches(a, microbatches), rows)
    stage_ids = jnp.arange(stages)
    first = (stage_ids == 0).reshape((stages,) + (1,) * (micro.ndim - 1))

    def tick(carry, t):
        inputs, loop = carry
        item = t - stage_ids
        chunk = jnp.clip(item // microbatches, 0, repeats - 1)
        fresh = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, microbatches - 1), keepdims=False)
        own = jax.lax.dynamic_index_in_dim(loop, t % microbatches, axis=1, keepdims=False)  # stage-local
        inputs = jnp.where(first, jnp.where(t < microbatches, fresh[None], own), inputs)
        if rows is None:
            out = run_stages(staged, inputs, chunk)
        else:  # every stage reads its micro-batch's rows where they are (the rows are not pipeline-split)
            out = run_stages(staged, inputs, chunk, jax.tree.map(lambda a: a[item % microbatches], micro_rows))
        out = shift_stages(out)
        # Stage 0 files what stage S-1 finished, item t - (S-1), under its micro-batch (every stage
        # writes its own row, no traffic; only row 0 is read).
        loop = jax.lax.dynamic_update_index_in_dim(loop, out[:, None], (t - (stages - 1)) % microbatches, 1)
        return (out, loop), None

    inputs = jnp.zeros((stages,) + micro.shape[1:], x.dtype)
    loop = jnp.zeros((stages,) + micro.shape, x.dtype)  # [S, M, b, ...]
    (_, loop), _ = jax.lax.scan(tick, (inputs, loop), jnp.arange(ticks(stages, microbatches, repeats)), unroll=unroll)
    return from_microbatches(loop[0])


def run(
    stage_fn,
    layer_state,
    x: jax.Array,
    *,
    stages: int,
    microbatches: int,
    mesh,
    strategy,
    schedule: str = "gpipe",
    repeats: int = 1,
    unroll: bool = False,
    rows=None,
    remat: bool = False,
) -> jax.Array:
    """Run `stage_fn(stage_state, x_micro[, rows_micro]) -> x_micro` over the stages for every
    micro-batch, on `mesh` under `strategy` (bound when the model was built: parallel/placement.py),
    as the `schedule` (gpipe | circular with `repeats` chunks per stage) orders it.

    layer_state: a pytree whose leaves have a leading [L] layer dim; x: [B, ...]. stage_fn gets one
    stage's (circular: one chunk's) layers and must take micro-batches of any row count (each batch
    replica runs the schedule on its own rows). `rows`: an optional pytree of per-row inputs [B, ...]
    (document segments, positions) handed to stage_fn beside its micro-batch. `remat`
    (remat.pipeline=stage): each stage (with its chunk selection) is one jax.checkpoint, so the tick
    loop keeps only the stage's input per tick."""
    if schedule not in ("gpipe", "circular"):
        raise ValueError(f"parallel.pipeline_schedule: {schedule!r} is not gpipe or circular")
    repeats = layout_chunks(schedule, repeats)  # None: gpipe's layout and schedule
    if repeats is not None:
        inner_fn = stage_fn

        def stage_fn(stage_state, x_micro, v, *extra):  # noqa: F811 - the chunk v of the stage's V
            chunk = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, v, keepdims=False), stage_state)
            return inner_fn(chunk, x_micro, *extra)

    if remat:  # remat.pipeline=stage: the tick loop keeps the stage's input; the stage (with its chunk
        # selection, so no chunk of weights is kept per tick) is recomputed in the backward
        stage_fn = jax.checkpoint(stage_fn, prevent_cse=False)
    schedule_fn = gpipe if repeats is None else functools.partial(circular, repeats=repeats)
    axes = once_per_pass_axes(mesh, strategy)
    given = STEP_COPIES.get()
    if not axes:
        staged = jax.tree.map(lambda a: stage_layout(a, stages, repeats), layer_state)
        return schedule_fn(jax.vmap(stage_fn, spmd_axis_name="pipeline"), staged, x, stages, microbatches, unroll, rows)
    n = math.prod(mesh.shape[a] for a in axes)
    inner = without_axis(strategy, *axes)
    spmd = ("pipeline",) + axes
    dtype = jnp.dtype(strategy.grad_reduce_dtype)

    def replicas(a):
        return replica_copies(a, stages, n, NamedSharding(mesh, copy_spec(spmd, a.ndim, repeats)), dtype, repeats)

    if given is not None:  # the train step's copies (`accumulate`): it reduces their gradient itself
        leaves, treedef = jax.tree.flatten(layer_state)
        copies = jax.tree.leaves(given, is_leaf=lambda x: x is None)
        assert len(copies) == len(leaves) and all(
            c is None or c.shape[0] == stages * n and c.size == n * a.size for c, a in zip(copies, leaves)
        ), "the train step's stage copies do not match the layer stack"
        # integer leaves (no gradient) are laid out here
        staged = treedef.unflatten([replicas(a) if c is None else c for c, a in zip(copies, leaves)])
    else:
        staged = jax.tree.map(replicas, layer_state)

    def replica(stage_state, *inputs):
        with rules.use_rules(mesh, inner):
            return stage_fn(stage_state, *inputs)

    # One vmap over (stage, replica) pairs: stage s's replica i runs on the i-th contiguous block of
    # the micro-batch's rows, which is where the batch split already puts them. (Nesting a replica
    # vmap in the stage vmap trips JAX's varying-axes checks in the shard_maps inside the layers.)
    vmapped = jax.vmap(replica, spmd_axis_name=spmd)

    def run_stages(staged, inputs, *extra):
        split = lambda a: a.reshape(stages * n, a.shape[1] // n, *a.shape[2:])  # noqa: E731
        if repeats is not None:  # extra[0]: the chunk index per stage, the same for the stage's replicas
            extra = (jnp.repeat(extra[0], n),) + tuple(jax.tree.map(split, e) for e in extra[1:])
        else:
            extra = jax.tree.map(split, extra)
        out = vmapped(staged, split(inputs), *extra).reshape(inputs.shape)
        # the stage state as the tick loop carries it: stages over `pipeline`, rows over the replica axes
        # (left to GSPMD, the forward shift's roll gathered the whole state over every device per tick)
        tail = [P.UNCONSTRAINED] * (out.ndim - 2)
        return jax.lax.with_sharding_constraint(out, NamedSharding(mesh, P("pipeline", axes, *tail)))

    return schedule_fn(run_stages, staged, x, stages, microbatches, unroll, rows)
