"""Pipeline parallelism over the `pipeline` mesh axis (`parallel.pipeline_schedule`): the entry points
the model and the train step call (`run`, `fused_loss`, `accumulate`, `per_replica_loss`), which place
the stages' weights and their gradient over the batch axes; the schedules themselves are GPipe or the
circular (interleaved) schedule, written for GSPMD (boost_jax/parallel/pipeline_schedules.py), or 1F1B
(interleaved with V > 1), one jitted program with the pipeline axis manual in a `shard_map`
(boost_jax/parallel/pipeline_1f1b.py); the stage layouts and the per-replica weight copies are in
boost_jax/parallel/pipeline_layout.py.

Gradients over the batch axes: once per pass, in float32. Left to GSPMD, the stage weights'
gradient is all-reduced over data x fsdp inside the backward tick loop, once per tick and layer
(bubble ticks included), at full size even over fsdp alone (no reduce-scatter inside the loop).
Here the schedule runs per batch replica instead: the stage vmap is over (stage, replica) pairs,
`spmd_axis_name=("pipeline", "data", "fsdp")`, under the strategy's rules with data and fsdp
removed, and each replica gets its own float32 copy of its stage's weights (`replica_copies`, split
over the pipeline and replica axes). The backward scan then accumulates each replica's gradient in its
copy's cotangent, on its own devices, without traffic; the copies' custom VJP sums the replicas once
after the loop, in `parallel.grad_reduce_dtype`: one all-reduce over data x fsdp per pass. The
train step lays the copies out itself, once per optimizer step (`accumulate`), so under
`train.grad_accum` the replicas' gradients also accumulate across micro-batches and are summed once
per step. The head and loss after the pipeline run per batch replica likewise (`per_replica_loss`).

fsdp is reduced once per pass too, not per tick, because per tick buys no memory here: the stage's
weights are gathered whole before the loop either way (XLA hoists the gathers), and GSPMD's per-tick
reduction over fsdp is a full-size all-reduce, not a reduce-scatter. Measured on the compiled train
step (4 layers d 128, 2 stages of 2 layers, 4 micro-batches, mesh pipeline 2 x data 2 x fsdp 2, f32;
benchmarks/grad_reduce.py --pipeline): reducing over data only, fsdp per tick, keeps the
accumulator fsdp-split (temp memory 5.07 MB, as per tick) but executes 965,797 reduction elements
per step; over both, 205,473 (per tick over both: 862,884) for 5.39 MB of temp memory: the extra is
one float32 stage gradient per device, the size of the stage's gathered weights. With fsdp 1 the
temp memory does not grow (3.38 -> 3.31 MB on pipeline 2 x data 2 x tensor 2).

Spatial-temporal projections keep GSPMD's placement (their Cannon schedule runs on the (fsdp,
tensor) grid itself; `once_per_pass_axes`).
"""

from __future__ import annotations

import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.parallel import rules
from boost_jax.parallel.grad_reduce import each_micro_batch, without_axis
from boost_jax.parallel.pipeline_1f1b import (  # noqa: F401 - re-exported
    ONE_F_ONE_B,
    delay,
    lifetime,
    ring_slots,
    schedule_gradient,
    stage_pass,
    ticks_1f1b,
)
from boost_jax.parallel.pipeline_layout import (  # noqa: F401 - re-exported
    copy_spec,
    from_microbatches,
    layer_layout,
    once_per_pass_axes,
    replica_copies,
    stage_copies,
    stage_layout,
    sum_stage_copies,
    to_microbatches,
)
from boost_jax.parallel.pipeline_schedules import (  # noqa: F401 - re-exported
    bubble_fraction,
    circular,
    gpipe,
    shift_stages,
    ticks,
)

# The train step's per-replica copies of the layer stack while it traces its loss (`accumulate`).
_GIVEN: contextvars.ContextVar = contextvars.ContextVar("stage_copies", default=None)


def accumulate(
    loss_fn,
    trained,
    batch,
    *,
    stack: str,
    mesh,
    strategy,
    stages: int,
    schedule: str = "gpipe",
    repeats: int = 1,
    specs=None,
):
    """(mean loss, mean gradient) of `loss_fn(trained, micro_batch)` over a batch [grad_accum, rows,
    ...], with the pipelined layer stack's gradient reduced over data x fsdp once per optimizer step,
    whatever grad_accum is.

    The stack (`trained[stack]`, leaves [L, ...]) is laid out as per-replica copies once, before the
    accumulation loop (`stage_copies`), and handed to the schedule in place of the stack (`run`
    reads them from `_GIVEN`). The loss is differentiated with respect to the copies: each replica's
    gradient stays on its own devices, accumulated in float32 across the micro-batches, and is
    summed over the replicas once, after the loop, in `parallel.grad_reduce_dtype`. `specs`: the
    stack's stored PartitionSpecs (the circular layout keeps their splits through its reorder). The other
    parameters (embedding, head, final norm) are reduced where GSPMD places it (per micro-batch).
    Without batch axes to defer (`once_per_pass_axes` empty) this is the plain accumulation loop."""
    axes = once_per_pass_axes(mesh, strategy)
    a = jax.tree.leaves(batch)[0].shape[0]
    repeats = repeats if schedule == "circular" or (schedule == ONE_F_ONE_B and repeats > 1) else None
    if not axes:
        copies_f = None
    else:
        n = math.prod(mesh.shape[x] for x in axes)
        spmd = ("pipeline",) + axes
        dtype = jnp.dtype(strategy.grad_reduce_dtype)
        layer_state = trained[stack]

        def lay_out(w, spec):  # a float32 copy per replica, laid out as the stages use them
            copy = NamedSharding(mesh, copy_spec(spmd, w.ndim, repeats))
            rest = None if repeats is None or spec is None else tuple(spec)[1:]  # circular: reordered in it
            return stage_copies(w.astype(jnp.promote_types(w.dtype, jnp.float32)), stages, n, copy, repeats, rest)

        specs = (
            [None] * len(jax.tree.leaves(layer_state, is_leaf=lambda x: x is None))
            if specs is None
            else jax.tree.leaves(specs, is_leaf=lambda x: x is None or isinstance(x, P))
        )
        leaves, treedef = jax.tree.flatten(layer_state, is_leaf=lambda x: x is None)
        copies_f = treedef.unflatten([None if w is None else lay_out(w, sp) for w, sp in zip(leaves, specs)])

    def grad_fn(t, c, x):
        if c is None:
            return jax.value_and_grad(loss_fn)(t, x) + (None,)

        def loss(t, c):
            token = _GIVEN.set(c)
            try:
                return loss_fn(t, x)
            finally:
                _GIVEN.reset(token)

        value, (g, gc) = jax.value_and_grad(loss, argnums=(0, 1))(t, c)
        return value, g, gc

    if a == 1:
        loss, grads, gc = grad_fn(trained, copies_f, jax.tree.map(lambda x: x[0], batch))
    else:

        def micro(acc, x):
            l, g, gc = grad_fn(trained, copies_f, x)
            acc_g, acc_c = acc
            acc_g = jax.tree.map(jnp.add, acc_g, g)
            acc_c = None if gc is None else jax.tree.map(lambda s, v: s + v.astype(jnp.float32), acc_c, gc)
            return (acc_g, acc_c), l

        zeros_c = None if copies_f is None else jax.tree.map(jnp.zeros_like, copies_f)
        (grads, gc), loss = each_micro_batch(micro, (jax.tree.map(jnp.zeros_like, trained), zeros_c), batch)
        grads = jax.tree.map(lambda g: g / a, grads)
        gc = None if gc is None else jax.tree.map(lambda g: g / a, gc)
    if gc is not None:

        def reduce(g, w, sp):
            rest = None if repeats is None or sp is None else tuple(sp)[1:]
            return sum_stage_copies(g, stages, n, dtype, repeats, mesh, rest).reshape(w.shape).astype(w.dtype)

        gl = jax.tree.leaves(gc, is_leaf=lambda x: x is None)
        stack_grads = treedef.unflatten(
            [None if w is None else reduce(g, w, sp) for g, w, sp in zip(gl, leaves, specs)]
        )
        grads = {**grads, stack: stack_grads}
    return loss, grads


def per_replica_loss(loss_fn, *, mesh, strategy):
    """`loss_fn(h [B, ...], w, labels [B, ...], mask) -> loss` (the head and loss after the pipeline)
    run once per batch replica, like the stages: the rows split over data x fsdp, vmapped with
    `spmd_axis_name` under the rules without those axes, and the head weight `w` copied per replica
    (`replica_copies`' trick), so the loss's chunk loop accumulates each replica's head gradient on its own
    devices and the replicas are summed once after it, instead of an all-reduce per chunk. The
    replicas' losses are averaged (a mean, mask None) or summed (a masked sum)."""
    axes = once_per_pass_axes(mesh, strategy)
    if not axes:
        return loss_fn
    n = math.prod(mesh.shape[a] for a in axes)
    inner = without_axis(strategy, *axes)
    dtype = jnp.dtype(strategy.grad_reduce_dtype)

    def split(x):
        x = x.reshape(n, x.shape[0] // n, *x.shape[1:])
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(axes, *([P.UNCONSTRAINED] * (x.ndim - 1)))))

    def run(h, w, labels, mask=None):
        copies = replica_copies(w[None], 1, n, NamedSharding(mesh, copy_spec(axes, w.ndim + 1, None)), dtype)[
            :, 0
        ]  # [n, ...]: one copy per replica

        def one(h, w, labels, mask):
            with rules.use_rules(mesh, inner):
                return loss_fn(h, w, labels, mask=mask)

        got = jax.vmap(one, spmd_axis_name=axes)(
            split(h), copies.astype(w.dtype), split(labels), None if mask is None else split(mask)
        )
        return got.mean() if mask is None else got.sum()

    return run


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
    repeats = repeats if schedule == "circular" else None  # None: gpipe's layout and schedule
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
    given = _GIVEN.get()
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
        return vmapped(staged, split(inputs), *extra).reshape(inputs.shape)

    return schedule_fn(run_stages, staged, x, stages, microbatches, unroll, rows)


def fused_loss(
    stage_fn,
    head_fn,
    embed_fn,
    layer_state,
    head_params,
    embed_params,
    x,
    rows,
    targets,
    *,
    stages: int,
    microbatches: int,
    mesh,
    strategy,
    repeats: int = 1,
    remat: bool = False,
    unroll: bool = False,
) -> jax.Array:
    """The 1F1B pass: the loss of `head_fn(head_params, h, labels, mask)` on the layer stack's output h,
    summed over the micro-batches and batch replicas (a masked sum) or averaged (mask None: means).

    `stage_fn(chunk_state, x_micro[, rows_micro]) -> x_micro` runs one chunk of L/(S V) layers;
    layer_state: leaves [L, ...]; x [B, ...] what `embed_fn(embed_params, x_micro)` makes the stack's
    input of (token ids): each micro-batch is embedded inside the schedule, where stage 0 needs it,
    so the pass keeps no embedded block of the M micro-batches nor of their gradients; rows: per-row
    inputs [B, ...] handed to stage_fn (or None); targets: (labels [B, ...], mask [B, ...] or None)
    for head_fn. Its
    gradient comes from the 1F1B schedule (boost_jax/parallel/pipeline_1f1b.py), computed when the loss's
    forward runs under autodiff (a custom VJP: the forward pass computes the gradients, the backward
    scales them by the loss's cotangent); evaluated without autodiff it runs the forward ticks only.
    The stack's gradient is reduced over data x fsdp once per pass, or once per step through the
    train step's copies (`accumulate`), as the GPipe path does."""
    axes = once_per_pass_axes(mesh, strategy)
    manual = ("pipeline",) + axes
    n = math.prod(mesh.shape[a] for a in axes)
    V = repeats if repeats > 1 else None
    reduce_dtype = jnp.dtype(strategy.grad_reduce_dtype)
    staged = _staged_1f1b(layer_state, stages, n, V, mesh, manual if axes else None, reduce_dtype)
    mask = targets[1]
    scale = 1.0 if mask is not None else 1.0 / (microbatches * n)
    local = functools.partial(
        stage_pass,
        stage_fn=stage_fn,
        head_fn=head_fn,
        embed_fn=embed_fn,
        stages=stages,
        microbatches=microbatches,
        repeats=repeats,
        manual=manual,
        inner=(mesh, without_axis(strategy, *axes)),
        scale=scale,
        reduce_dtype=reduce_dtype,
        remat=remat,
        unroll=unroll,
    )
    rows_spec = P(axes) if axes else P()
    in_specs = (P(manual), P(), P(), rows_spec, rows_spec, rows_spec)

    def program(backward):
        out = (P(), P(manual), P(manual), P(manual)) if backward else P()
        return jax.shard_map(
            functools.partial(local, backward=backward),
            mesh=mesh,
            in_specs=in_specs,
            out_specs=out,
            axis_names=set(manual),
            check_vma=False,
        )

    return schedule_gradient(program, stages, n, reduce_dtype)(staged, head_params, embed_params, x, rows, targets)


def _staged_1f1b(layer_state, stages: int, n: int, repeats: int | None, mesh, manual, reduce_dtype):
    """Every stage's weights as the 1F1B program takes them, [S n, V, L/(S V), ...]: with batch axes
    to reduce once per pass (`manual`: the map's axes, else None) the per-replica copies (the train
    step's, `accumulate`, where it laid them out), else the stage layout."""
    given = _GIVEN.get()
    if manual is not None:

        def replicas(a):
            return replica_copies(
                a, stages, n, NamedSharding(mesh, copy_spec(manual, a.ndim, repeats)), reduce_dtype, repeats
            )

        if given is not None:
            leaves, treedef = jax.tree.flatten(layer_state)
            copies = jax.tree.leaves(given, is_leaf=lambda c: c is None)
            assert len(copies) == len(leaves), "the train step's stage copies do not match the layer stack"
            staged = treedef.unflatten([replicas(a) if c is None else c for c, a in zip(copies, leaves)])
        else:
            staged = jax.tree.map(replicas, layer_state)
    else:
        staged = jax.tree.map(lambda a: stage_layout(a, stages, repeats), layer_state)
    return jax.tree.map(lambda a: a if repeats is not None else a[:, None], staged)
