"""Pipeline parallelism over the `pipeline` mesh axis (`parallel.pipeline_schedule`): GPipe or the
circular (interleaved) schedule, written for GSPMD; or 1F1B (interleaved with V > 1), one jitted
program with the pipeline axis manual in a `shard_map` (its section below, `fused_loss`).

The layer stack [L, ...] is cut into S stages of L/S consecutive layers (the `layers` dim is split
over `pipeline`). The batch is cut into M micro-batches. At every tick all S stages run at once
(a vmap over the stage dim, which GSPMD splits over `pipeline`), then the stage outputs shift one
stage down (a roll of the stage dim: one collective-permute) and the next micro-batch enters stage 0.
After M + S - 1 ticks every micro-batch has crossed every stage; the bubble is (S-1)/(M+S-1) of the
ticks. Autodiff of the loop gives the backward (all micro-batches' activations are kept, as in
GPipe; combine with a remat policy). Tensor parallelism acts inside each stage unchanged, because
the strategy's constraints are batched with `spmd_axis_name="pipeline"`.

Circular (`_circular`, `parallel.pipeline_repeats` = V): stage s holds the V chunks s, S+s, 2S+s, ...
of L/(S V) layers; each micro-batch goes round the ring V times (stage S-1 hands to stage 0: the same
roll, which wraps), so a tick runs L/(S V) layers and the pass takes V M + S - 1 ticks: the bubble
is (S-1)/(V M + S-1). It needs M >= S: micro-batch m's round v leaves stage S-1 at tick
v M + m + S - 1 and its round v+1 starts at stage 0 at tick (v+1) M + m, which must be later; the
output waits in between in a stage-local buffer [M, b, ...] (the size of GPipe's output buffer). The stored
[L, ...] stacks are split over `pipeline` in contiguous blocks (so checkpoints are the same for
every schedule), which the chunks are not: the circular layout moves the stage weights once per
pass, before the tick loop (one all-to-all over `pipeline` per weight, in its stored fsdp/tensor
split, of which (S-1)/S leaves the device), and their summed gradient once after it (pinned by
`_on_stages`; left to GSPMD the gradient's reorder fell back to replicating it).

Gradients over the batch axes: once per pass, in float32. Left to GSPMD, the stage weights'
gradient is all-reduced over data x fsdp inside the backward tick loop, once per tick and layer
(bubble ticks included), at full size even over fsdp alone (no reduce-scatter inside the loop).
Here the schedule runs per batch replica instead: the stage vmap is over (stage, replica) pairs,
`spmd_axis_name=("pipeline", "data", "fsdp")`, under the strategy's rules with data and fsdp
removed, and each replica gets its own float32 copy of its stage's weights (`_replicas`, split over
the pipeline and replica axes). The backward scan then accumulates each replica's gradient in its
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


def ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Ticks of one pass: every micro-batch crosses every stage `repeats` times (V M items), the last
    one entering stage 0 at tick V M - 1 and leaving stage S-1 S-1 ticks later."""
    return repeats * microbatches + stages - 1


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle share of the stage-ticks: (S-1)/(V M + S-1) (gpipe: V = 1)."""
    return (stages - 1) / ticks(stages, microbatches, repeats)


def to_microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...] with micro-batch j = rows j, M+j, 2M+j, ...: every device's
    contiguous block of the batch keeps a share of every micro-batch, so none moves."""
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def from_microbatches(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


@jax.custom_vjp
def shift_stages(x: jax.Array) -> jax.Array:
    """Stage s's output becomes stage s+1's input: a roll of the stage dim, one collective-permute.
    The custom VJP rolls the cotangent back the same way (one permute); autodiff of jnp.roll would
    transpose its slice + concatenate into two one-way permutes per tick."""
    return jnp.roll(x, 1, axis=0)


shift_stages.defvjp(lambda x: (shift_stages(x), None), lambda _, g: (jnp.roll(g, -1, axis=0),))


def once_per_pass_axes(mesh, strategy) -> tuple[str, ...]:
    """The batch axes over which the stages' weight gradients are reduced once per pass (see the
    module docstring); () leaves the reduction where GSPMD places it, every tick. Spatial-temporal
    projections keep GSPMD's placement: their Cannon schedule runs on the (fsdp, tensor) grid itself."""
    if strategy.st_groups:
        return ()
    return tuple(a for a in ("data", "fsdp") if mesh.shape.get(a, 1) > 1)


def stage_layout(a: jax.Array, stages: int, repeats: int | None = None) -> jax.Array:
    """A layer-stacked [L, ...] as the stages hold it: gpipe (repeats None) [S, L/S, ...], stage s the
    layers [s L/S, (s+1) L/S); circular [S, V, L/(S V), ...], stage s the chunks s, S+s, 2S+s, ...
    (chunk c = layers [c L/(S V), (c+1) L/(S V))). The stored [L] dim is split over `pipeline` in
    contiguous blocks, so the circular layout moves each stage's weights between stages (once per
    pass, before the tick loop; their gradient once after it)."""
    if repeats is None:
        return a.reshape(stages, a.shape[0] // stages, *a.shape[1:])
    chunks = a.reshape(repeats, stages, a.shape[0] // (stages * repeats), *a.shape[1:])
    return jnp.swapaxes(chunks, 0, 1)


def layer_layout(a: jax.Array, repeats: int | None = None) -> jax.Array:
    """The inverse of `stage_layout`: [S, ...] -> [L, ...]."""
    if repeats is not None:
        a = jnp.swapaxes(a, 0, 1)
        return a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:])
    return a.reshape(a.shape[0] * a.shape[1], *a.shape[2:])


def _on_stages(x: jax.Array, mesh, lead: int = 1, rest=None) -> jax.Array:
    """x split over `pipeline` on its leading dim, `lead - 1` whole dims after it, then `rest` (the
    stored weight's spec past its layer dim; None: as XLA likes). Pins where the circular layout's
    reorder happens: one all-to-all over `pipeline` of the stored weights and one of the summed
    gradient, each keeping its other splits."""
    tail = [P.UNCONSTRAINED] * (x.ndim - lead) if rest is None else list(rest) + [None] * (x.ndim - lead - len(rest))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("pipeline", *([None] * (lead - 1)), *tail)))


def _copy_spec(spmd, ndim: int, repeats: int | None) -> P:
    """The spec of the copies of an [L, ...] weight of `ndim` dims: split over the pipeline and replica
    axes, every other dim as the stages use it. It must name every dim: a dim a PartitionSpec leaves
    out is replicated (the circular layout's extra chunk dim once left the last dim out, and XLA
    gathered each weight split along it over tensor)."""
    return P(spmd, *([P.UNCONSTRAINED] * (ndim + (repeats is not None))))  # [S n, (V,) L/(S V), ...]


def _copies(w: jax.Array, stages: int, n: int, sharding: NamedSharding, repeats: int | None, rest=None) -> jax.Array:
    """[L, ...] -> [S * n, ...stage layout]: every replica's copy of its stage's layers. `rest`: see
    `_on_stages`."""
    if repeats is None:  # gpipe
        staged = w.reshape(stages, 1, w.shape[0] // stages, *w.shape[1:])
    else:
        staged = stage_layout(w if rest is None else _on_stages(w, sharding.mesh, 1, rest), stages, repeats)
        staged = (staged if rest is None else _on_stages(staged, sharding.mesh, 3, rest))[:, None]
    out = jnp.broadcast_to(staged, (stages, n) + staged.shape[2:]).reshape(stages * n, *staged.shape[2:])
    return jax.lax.with_sharding_constraint(out, sharding)


def _sum_copies(g: jax.Array, stages: int, n: int, reduce_dtype, repeats: int | None, mesh, rest=None) -> jax.Array:
    """The copies' gradient [S * n, ...] summed over the replicas (once, in `reduce_dtype`) -> [L, ...]."""
    g = g.reshape(stages, n, *g.shape[1:]).astype(reduce_dtype).sum(1)
    if repeats is None:
        return layer_layout(g)
    return _on_stages(layer_layout(_on_stages(g, mesh, 3, rest), repeats), mesh, 1, rest)


def _replicas(
    a: jax.Array, stages: int, n: int, sharding: NamedSharding, reduce_dtype, repeats: int | None = None
) -> jax.Array:
    """A layer-stacked weight [L, ...] as [S * n, ...stage layout]: stage s's layers copied once per
    batch replica (row s * n + i: stage s, replica i; split over the pipeline and replica axes), in
    float32 when it is a float. Each replica accumulates its own gradient in its copy's cotangent over
    the ticks; the backward sums the n of them once, in `reduce_dtype`."""

    def forward(w):
        return _copies(w, stages, n, sharding, repeats)

    if not jnp.issubdtype(a.dtype, jnp.floating):
        return forward(a)  # no gradient
    acc = jnp.promote_types(a.dtype, jnp.float32)

    @jax.custom_vjp
    def copies(w):
        return forward(w.astype(acc))

    def bwd(_, g):
        return (_sum_copies(g, stages, n, reduce_dtype, repeats, sharding.mesh).reshape(a.shape).astype(a.dtype),)

    copies.defvjp(lambda w: (copies(w), None), bwd)
    return copies(a)


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
    accumulation loop (`_copies`), and handed to the schedule in place of the stack (`run`
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
            copy = NamedSharding(mesh, _copy_spec(spmd, w.ndim, repeats))
            rest = None if repeats is None or spec is None else tuple(spec)[1:]  # circular: reordered in it
            return _copies(w.astype(jnp.promote_types(w.dtype, jnp.float32)), stages, n, copy, repeats, rest)

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
            return _sum_copies(g, stages, n, dtype, repeats, mesh, rest).reshape(w.shape).astype(w.dtype)

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
    (`_replicas`' trick), so the loss's chunk loop accumulates each replica's head gradient on its own
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
        copies = _replicas(w[None], 1, n, NamedSharding(mesh, _copy_spec(axes, w.ndim + 1, None)), dtype)[
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
    schedule_fn = _gpipe if repeats is None else functools.partial(_circular, repeats=repeats)
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
        return _replicas(a, stages, n, NamedSharding(mesh, _copy_spec(spmd, a.ndim, repeats)), dtype, repeats)

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


def _enter(micro, inputs, t, microbatches):
    """Micro-batch t enters stage 0 (after the bubble ticks the slot is never read again)."""
    stage_ids = jnp.arange(inputs.shape[0]).reshape((inputs.shape[0],) + (1,) * (micro.ndim - 1))
    entering = jax.lax.dynamic_index_in_dim(micro, jnp.minimum(t, microbatches - 1), keepdims=False)
    return jnp.where(stage_ids == 0, entering[None], inputs)


def _gpipe(run_stages, staged, x, stages, microbatches, unroll, rows=None):
    """The schedule: `run_stages(staged, inputs [S, b, ...][, rows]) -> [S, b, ...]` runs every stage
    once; `rows` (per-row inputs, see `gpipe`) move down the stages with their micro-batch."""
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


def _circular(run_stages, staged, x, stages, microbatches, unroll, rows=None, *, repeats):
    """The circular (interleaved) schedule: `run_stages(staged, inputs [S, b, ...], chunk [S][, rows])`
    runs every stage once, stage s on its chunk `chunk[s]`. Item k = v M + m is micro-batch m's round
    v; stage s works on item t - s at tick t, so stage s-1's output of the last tick is its input and
    the ring wraps: stage 0 takes micro-batch t fresh for t < M, else micro-batch t mod M's output of
    round v-1 from stage S-1, which the shift hands to stage 0 at tick t - M + S - 1 <= t - 1 (M >= S)
    and stage 0 files in `loop` until it is read. After V M + S - 1 ticks `loop`'s stage-0 row holds
    every micro-batch's last round. Ticks outside 0 <= t - s < V M compute on stale inputs whose
    outputs are overwritten before they are read (zero cotangent)."""
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


# ------------------------------------------------------------------------------------------- 1F1B
#
# One jitted program, the pipeline axis (and the batch axes the stage weights' gradient is reduced
# over once per pass) manual in a `shard_map`: each device runs its own stage's branch of a tick
# (`lax.cond` on its stage index, so a stage with nothing to do at a tick skips it) and the stages
# hand their activations forward and their gradients backward by collective-permute, one each way
# per tick. The backward is driven by the schedule (`jax.vjp` per stage and tick), not by autodiff
# of the tick loop, so a stage keeps only the micro-batches it has run forward and not yet backward,
# in a ring buffer whose size depends on S and V, never on M. The head and loss run at the last
# stage, per micro-batch, in the tick that finishes its forward, which also starts its backward.
#
# Ticks (lockstep: every stage does at most one forward and one backward per tick). Items are
# (micro-batch, chunk) pairs, V per micro-batch (V = 1 without interleaving). Forward item k runs at
# stage s at tick k + s; in the interleaved order micro-batches go in groups of S: item k is group
# g = k // (S V), chunk v = (k mod S V) // S, micro-batch g S + k mod S, so the item stage S-1
# finishes at tick t is the one stage 0 starts at tick t + 1 (the ring wraps, no buffer in between;
# hence M divisible by S when V > 1). Backward item j (the same order, chunks reversed) runs at
# stage s at tick j + D - s, D = V S + S - 2: a micro-batch's last chunk is run forward and backward
# at stage S-1 in the same tick, and each backward hand-over arrives the tick its stage needs it.
# V M + D ticks in all: the first V S - 1 run forwards only, the last V S - 1 backwards only, so a
# pass takes (S - 1 + V M) (f + b) for chunk times f, b: bubble (S-1)/(V M + S-1), as the stages
# only wait for work the dependencies forbid. Lockstep ticks make a hand-over take a whole tick each
# way, so stage s holds a forward item for 2(S-1-s) + 2(V-1-v)S ticks (interleaved) before its
# backward: the ring keeps `ring_slots` items, at most 2 V S - 1, where 1F1B run asynchronously keeps
# about S (V = 1); under stage remat stage 0's first chunk is re-read from the pass's input instead.
# What an item is: its stage input under stage remat (the backward runs its forward again), else
# the residuals of its forward's `jax.vjp` that depend on it (`_Inputs`, `_Residuals`).
#
# The map runs unchecked (check_vma=False): nested in it, jax 0.10's checked partial evaluation of a
# layer's own shard_map island gives its residuals the outer map's axes, which Shardy rejects. Its
# autodiff is ours, so no implicit psum is needed; the islands and shardings inside name the traced
# (partly manual) mesh (`rules.traced_mesh`), and kernels XLA cannot partition there run per shard
# (`rules.per_shard`: cuDNN attention).

ONE_F_ONE_B = "1f1b"


def delay(stages: int, repeats: int = 1) -> int:
    """D: backward item j runs at stage s at tick j + D - s."""
    return repeats * stages + stages - 2


def ticks_1f1b(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Ticks of a 1F1B pass (forward and backward): V M + V S + S - 2."""
    return repeats * microbatches + delay(stages, repeats)


def lifetime(stages: int, repeats: int, stage: int, chunk: int) -> int:
    """Ticks from an item's forward to its backward at `stage`, for its `chunk` (0..V-1)."""
    return (repeats - 1 - 2 * chunk) * stages + delay(stages, repeats) - 2 * stage


def ring_slots(stages: int, repeats: int = 1, reread_first: bool = True) -> int:
    """Slots of a stage's ring of forward items (indexed by item mod slots): one more than the longest
    lifetime of a kept item, so an item's slot is rewritten only after its backward. `reread_first`:
    stage 0's first chunk is read from the pass's input again, not kept."""
    return 1 + max(
        [
            lifetime(stages, repeats, s, v)
            for s in range(stages)
            for v in range(repeats)
            if not (reread_first and s == 0 and v == 0)
        ]
        + [0]
    )


def _decode(item, stages: int, repeats: int, backward: bool = False):
    """(micro-batch, chunk) of forward item `item` (backward: chunks in reverse order)."""
    per_group = stages * repeats
    within = item % per_group
    v = within // stages
    return (item // per_group) * stages + within % stages, (repeats - 1 - v) if backward else v


def _forward_item(item, stages: int, repeats: int):
    """The forward index of backward item `item` (same micro-batch and chunk)."""
    per_group = stages * repeats
    within = item % per_group
    return (item // per_group) * per_group + (repeats - 1 - within // stages) * stages + within % stages


def _index(tree, i):
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)


def _add_at(tree, value, i):
    return jax.tree.map(
        lambda a, v: jax.lax.dynamic_update_index_in_dim(
            a, jax.lax.dynamic_index_in_dim(a, i, keepdims=False) + v.astype(a.dtype), i, 0
        ),
        tree,
        value,
    )


def _f1b_local(
    staged,
    head_params,
    x,
    rows,
    targets,
    *,
    stage_fn,
    head_fn,
    stages,
    microbatches,
    repeats,
    manual,
    inner,
    scale,
    reduce_dtype,
    backward,
    remat,
    unroll,
):
    """One stage's program (inside the `shard_map`): the loss of its pass (and with `backward`, the
    gradients of its stage weights [1, V, ...], of `head_params` and of x). staged: this stage's
    weights [1, V, L/(S V), ...]; x [rows, ...] this replica's rows of the pass's input; rows and
    targets: pytrees of per-row arrays [rows, ...] (targets: (labels, mask or None)). `remat`: keep
    each item's stage input and run its forward again in its backward; otherwise keep what the
    backward reads (`_Residuals`)."""
    S, V, M = stages, repeats, microbatches
    s = jax.lax.axis_index("pipeline")
    here = rules.traced_mesh(inner[0])
    weights = jax.tree.map(lambda a: a[0], staged)  # [V, L/(S V), ...]
    micro = to_microbatches(x, M)  # [M, b, ...]
    micro_rows = jax.tree.map(lambda a: to_microbatches(a, M), rows)
    micro_targets = jax.tree.map(lambda a: to_microbatches(a, M), targets)
    items = V * M
    D = delay(S, V)
    n_ticks = items + D if backward else items + S - 1
    forward_perm = [(i, (i + 1) % S) for i in range(S)]
    backward_perm = [(i, (i - 1) % S) for i in range(S)]

    def run(w, h, r):
        return stage_fn(w, h) if r is None else stage_fn(w, h, r)

    with rules.use_rules(here, inner[1]):
        act = jnp.zeros(micro.shape[1:], micro.dtype)
        carry = {"fwd": act, "loss": jnp.zeros((), jnp.float32)}
        if backward:
            keep = _Inputs(run, act) if remat else _Residuals(run, weights, act, _index(micro_rows, 0))
            slots = ring_slots(S, V, reread_first=remat)
            f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
            carry.update(
                bwd=act,
                ring=[jnp.zeros((slots,) + a.shape, a.dtype) for a in keep.avals],
                grad_w=f32(weights),
                grad_h=f32(head_params),
                dx=jnp.zeros(micro.shape, micro.dtype),
            )

        def head(hp, h, tgt):
            labels, mask = tgt
            return head_fn(hp, h, labels, mask) * scale

        def zeros(tree):
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)

        # The forward's branch computes one item's values and the ring is updated outside it, in place
        # (a ring passed through the branch is copied: +5.6 GB on cola_13b's 32-H100 pick); a skipped
        # tick writes zeros to slot k mod slots, rewritten only after its item's backward. The
        # gradient accumulators go through the branches and are updated there, in place (returned as
        # a tick's gradient, a stage-sized float32 array would be one more buffer: +1.0 GB there).
        def tick(c, t):
            c = dict(c)
            k = t - s
            f_ok = (k >= 0) & (k < items)
            m_f, v_f = _decode(jnp.clip(k, 0, items - 1), S, V)
            inp = jnp.where((s == 0) & (v_f == 0), micro[m_f], c["fwd"])
            rows_f = _index(micro_rows, m_f)
            tgt_f = _index(micro_targets, m_f)
            last = (s == S - 1) & (v_f == V - 1)

            if not backward:

                def forward(_):
                    y = run(_index(weights, v_f), inp, rows_f)
                    return y, jax.lax.cond(
                        last, lambda: head(head_params, y, tgt_f), lambda: jnp.zeros((), jnp.float32)
                    )

                y, loss = jax.lax.cond(f_ok, forward, lambda _: (act, jnp.zeros((), jnp.float32)), None)
                c["loss"] = c["loss"] + loss
                c["fwd"] = jax.lax.ppermute(y, "pipeline", forward_perm)
                return c, None

            def at_head(y, acc):
                loss, pull = jax.vjp(lambda hp, h: head(hp, h, tgt_f), head_params, y)
                g_h, g_y = pull(jnp.ones((), jnp.float32))
                return loss, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, g_h), g_y.astype(act.dtype)

            no_loss = jnp.zeros((), jnp.float32)

            def forward(acc):
                y, kept = keep.forward(_index(weights, v_f), inp, rows_f)
                return (y, kept) + jax.lax.cond(last, at_head, lambda y, acc: (no_loss, acc, act), y, acc)

            y, kept, loss, c["grad_h"], g_y = jax.lax.cond(
                f_ok, forward, lambda acc: (act, zeros(keep.avals), no_loss, acc, act), c["grad_h"]
            )
            c["ring"] = [
                jax.lax.dynamic_update_index_in_dim(r, a, jnp.mod(k, slots), 0) for r, a in zip(c["ring"], kept)
            ]
            c["loss"] = c["loss"] + loss

            j = t - D + s
            b_ok = (j >= 0) & (j < items)
            jc = jnp.clip(j, 0, items - 1)
            m_b, v_b = _decode(jc, S, V, backward=True)
            first = (s == 0) & (v_b == 0)
            slot = jnp.mod(_forward_item(jc, S, V), slots)
            kept = [jax.lax.dynamic_index_in_dim(r, slot, keepdims=False) for r in c["ring"]]
            if remat:  # stage 0's first chunk: the pass's input again
                kept = [jnp.where(first, micro[m_b], kept[0])]
            cot = jnp.where((s == S - 1) & (v_b == V - 1), g_y, c["bwd"])
            rows_b = _index(micro_rows, m_b)
            w_b = _index(weights, v_b)

            def backward_step(acc):
                g_w, g_x = keep.backward(w_b, v_b, kept, rows_b, cot)
                return _add_at(acc, g_w, v_b), g_x.astype(act.dtype)

            c["grad_w"], g_x = jax.lax.cond(b_ok, backward_step, lambda acc: (acc, act), c["grad_w"])
            done = jax.lax.dynamic_index_in_dim(c["dx"], m_b, keepdims=False)
            c["dx"] = jax.lax.dynamic_update_index_in_dim(c["dx"], jnp.where(first & b_ok, g_x, done), m_b, 0)
            c["bwd"] = jax.lax.ppermute(g_x, "pipeline", backward_perm)
            c["fwd"] = jax.lax.ppermute(y, "pipeline", forward_perm)
            return c, None

        carry, _ = jax.lax.scan(tick, carry, jnp.arange(n_ticks), unroll=unroll)
    loss = jax.lax.psum(carry["loss"], manual)
    if not backward:
        return loss
    # Per device: summed over the stages and replicas (the head's) and taken from stage 0 (x's) by
    # the caller, outside the manual region (a bf16 all-reduce inside it does not compile on XLA:CPU).
    grad_h = jax.tree.map(lambda g: g[None], carry["grad_h"])
    grad_w = jax.tree.map(lambda g, a: g.astype(a.dtype)[None], carry["grad_w"], weights)
    return loss, grad_w, grad_h, from_microbatches(carry["dx"])[None]


class _Inputs:
    """What a stage keeps per item under stage remat: its input; the backward runs the forward again
    (`jax.vjp` of the stage at the kept input)."""

    def __init__(self, run, h):
        self.run = run
        self.avals = [h]

    def forward(self, w, h, r):
        return self.run(w, h, r), [h]

    def backward(self, w, v, kept, r, cot):
        _, pull = jax.vjp(lambda w, h: self.run(w, h, r), w, kept[0])
        return pull(cot)


class _Residuals:
    """What a stage keeps per item without stage remat: the residuals its `jax.vjp` reads in the
    backward that depend on the item (its input and rows): the forward is not run again. Those that
    depend on the stage's weights alone (their compute-dtype casts, the weights themselves) are the
    same for every item: the backward takes them from a trace of the stage's forward on its weights
    (whose item-dependent part is dead code), not from the ring. Which are which is read from the
    stage's residual program by JAX's partial evaluation (weights known, the item unknown); where that
    is unavailable every residual is kept per item."""

    def __init__(self, run, weights, h, r):
        self.run = run
        w0 = _index(weights, 0)
        leaves = jax.tree.leaves(jax.vjp(lambda w, x: run(w, x, r), w0, h)[1])
        self.per_item = _item_dependent(
            lambda w, x, r: jax.tree.leaves(jax.vjp(lambda w, x: run(w, x, r), w, x)[1]),
            (w0, h, r),
            len(jax.tree.leaves(w0)),
            len(leaves),
        )
        self.avals = [a for a, k in zip(leaves, self.per_item) if k]

    def forward(self, w, h, r):
        y, pull = jax.vjp(lambda w, x: self.run(w, x, r), w, h)
        return y, [a for a, k in zip(jax.tree.leaves(pull), self.per_item) if k]

    def backward(self, w, v, kept, r, cot):
        _, like = jax.vjp(lambda w, x: self.run(w, x, r), w, jnp.zeros(cot.shape, cot.dtype))
        kept = iter(kept)
        leaves = [next(kept) if k else a for a, k in zip(jax.tree.leaves(like), self.per_item)]
        return jax.tree.unflatten(jax.tree.structure(like), leaves)(cot)


def _item_dependent(residuals, args, n_known: int, n_out: int) -> list[bool]:
    """Which outputs of `residuals(*args)` depend on the arguments after the first `n_known` leaves."""
    try:
        from jax._src.interpreters import partial_eval as pe

        closed = jax.make_jaxpr(residuals)(*args)
        n_in = len(closed.in_avals)
        _, _, unknown, _ = pe.partial_eval_jaxpr_nounits(closed, [i >= n_known for i in range(n_in)], False)
        assert len(unknown) == n_out
        return list(unknown)
    except Exception:  # noqa: BLE001 - an internal API: keep every residual per item instead
        return [True] * n_out


def fused_loss(
    stage_fn,
    head_fn,
    layer_state,
    head_params,
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
    layer_state: leaves [L, ...]; x [B, ...] the stack's input; rows: per-row inputs [B, ...] handed
    to stage_fn (or None); targets: (labels [B, ...], mask [B, ...] or None) for head_fn. Its
    gradient comes from the 1F1B schedule (the module's section above), computed when the loss's
    forward runs under autodiff (a custom VJP: the forward pass computes the gradients, the backward
    scales them by the loss's cotangent); evaluated without autodiff it runs the forward ticks only.
    The stack's gradient is reduced over data x fsdp once per pass, or once per step through the
    train step's copies (`accumulate`), as the GPipe path does."""
    axes = once_per_pass_axes(mesh, strategy)
    manual = ("pipeline",) + axes
    n = math.prod(mesh.shape[a] for a in axes)
    V = repeats if repeats > 1 else None
    reduce_dtype = jnp.dtype(strategy.grad_reduce_dtype)
    given = _GIVEN.get()
    if axes:

        def replicas(a):
            return _replicas(a, stages, n, NamedSharding(mesh, _copy_spec(manual, a.ndim, V)), reduce_dtype, V)

        if given is not None:
            leaves, treedef = jax.tree.flatten(layer_state)
            copies = jax.tree.leaves(given, is_leaf=lambda c: c is None)
            assert len(copies) == len(leaves), "the train step's stage copies do not match the layer stack"
            staged = treedef.unflatten([replicas(a) if c is None else c for c, a in zip(copies, leaves)])
        else:
            staged = jax.tree.map(replicas, layer_state)
    else:
        staged = jax.tree.map(lambda a: stage_layout(a, stages, V), layer_state)
    # every stage's weights as [S n, V, L/(S V), ...]
    staged = jax.tree.map(lambda a: a if V is not None else a[:, None], staged)
    mask = targets[1]
    scale = 1.0 if mask is not None else 1.0 / (microbatches * n)
    local = functools.partial(
        _f1b_local,
        stage_fn=stage_fn,
        head_fn=head_fn,
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
    in_specs = (P(manual), P(), rows_spec, rows_spec, rows_spec)

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

    @jax.custom_vjp
    def loss(staged, head_params, x, rows, targets):
        return program(False)(staged, head_params, x, rows, targets)

    def loss_fwd(staged, head_params, x, rows, targets):
        value, grad_w, grad_h, dx = program(True)(staged, head_params, x, rows, targets)
        # the head's gradient: every stage's and replica's part (zero but at the last stage), summed
        # once in the reduction dtype; x's: stage 0's rows [S, n, B/n, ...] of every replica
        grad_h = jax.tree.map(lambda g, a: g.astype(reduce_dtype).sum(0).astype(a.dtype), grad_h, head_params)
        dx = dx.reshape(stages, n, *dx.shape[1:])[0].reshape(x.shape)
        return value, (grad_w, grad_h, dx, rows, targets)

    def loss_bwd(res, ct):
        grad_w, grad_h, dx, rows, targets = res
        times = lambda g: (g * ct).astype(g.dtype)  # noqa: E731
        return (
            jax.tree.map(times, grad_w),
            jax.tree.map(times, grad_h),
            times(dx),
            jax.tree.map(lambda _: None, rows),
            jax.tree.map(lambda _: None, targets),
        )

    loss.defvjp(loss_fwd, loss_bwd)
    return loss(staged, head_params, x, rows, targets)
