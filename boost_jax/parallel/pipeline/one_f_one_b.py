"""The 1F1B pipeline schedule (`parallel.pipeline_schedule=1f1b`, interleaved with
`parallel.pipeline_repeats` V > 1): `fused_loss` (stack.py `Pipeline.train_loss` calls it) runs one
stage's program of a pass (`stage_pass`) in a `shard_map` and makes its gradients the loss's
(`schedule_gradient`, a custom VJP).

One jitted program, the pipeline axis (and the batch axes the stage weights' gradient is reduced
over once per pass) manual: each device runs its own stage's branch of a tick (`lax.cond` on its
stage index, so a stage with nothing to do skips it), and the stages hand activations forward and
gradients backward by collective-permute, one each way per tick. The backward is driven by the
schedule (`jax.vjp` per stage and tick), not by autodiff of the tick loop, so a stage keeps only
the items it has run forward and not yet backward, in a ring whose size depends on S and V, never
on M. Each micro-batch is embedded at stage 0 in the tick its first chunk runs; the head and loss
run at the last stage, per micro-batch: no buffer of the pass grows with M. The tick order: `_Tick`;
its counts: arithmetic.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.parallel import rules
from boost_jax.parallel.grad_reduce import without_axis
from boost_jax.parallel.pipeline.arithmetic import ONE_F_ONE_B, decode, delay, forward_item, layout_chunks, ring_slots
from boost_jax.parallel.pipeline.layout import (
    STEP_COPIES,
    copy_spec,
    once_per_pass_axes,
    replica_copies,
    stage_layout,
    to_microbatches,
)


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


def _zeros(tree):
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)


def stage_pass(
    staged,
    head_params,
    embed_params,
    x,
    rows,
    targets,
    *,
    stage_fn,
    head_fn,
    embed_fn,
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
    gradients of its stage weights [1, V, ...], of `head_params` and of `embed_params`). staged: this
    stage's weights [1, V, L/(S V), ...]; x [rows, ...] this replica's rows of the pass's input (token
    ids), `embed_fn(embed_params, x_micro)` the stack's input of one micro-batch, embedded at stage 0
    in the tick its first chunk runs (and again in its backward under stage remat), its gradient
    added to the embedding's there: no [M, ...] block of embedded inputs or of their gradients is
    kept. rows and targets: pytrees of per-row arrays [rows, ...] (targets: (labels, mask or None)).
    `remat`: keep each item's stage input and run its forward again in its backward; otherwise keep
    what the backward reads (`_Residuals`)."""
    S, V, M = stages, repeats, microbatches
    s = jax.lax.axis_index("pipeline")
    here = rules.traced_mesh(inner[0])
    weights = jax.tree.map(lambda a: a[0], staged)  # [V, L/(S V), ...]
    micro = to_microbatches(x, M)  # [M, b, ...]
    micro_rows = jax.tree.map(lambda a: to_microbatches(a, M), rows)
    micro_targets = jax.tree.map(lambda a: to_microbatches(a, M), targets)
    items = V * M
    n_ticks = items + delay(S, V) if backward else items + S - 1

    def run(w, h, r):
        return stage_fn(w, h) if r is None else stage_fn(w, h, r)

    def head(hp, h, tgt):
        labels, mask = tgt
        return head_fn(hp, h, labels, mask) * scale

    def embed(m):
        return embed_fn(embed_params, micro[m])

    acc_dtype = jnp.float32

    def embed_grad(m, g, acc):  # the rows' gradient added in float32 (the table widened: no rounding)
        _, pull = jax.vjp(lambda p: embed_fn(p, micro[m]), jax.tree.map(lambda a: a.astype(acc_dtype), embed_params))
        return jax.tree.map(jnp.add, acc, pull(g.astype(acc_dtype))[0])

    with rules.use_rules(here, inner[1]):
        shaped = jax.eval_shape(embed, 0)
        act = jnp.zeros(shaped.shape, shaped.dtype)
        carry = {"fwd": act, "loss": jnp.zeros((), jnp.float32)}
        tick = _Tick(s, S, V, items, run, head, weights, head_params, embed, micro_rows, micro_targets, act)
        tick.embed_grad = embed_grad
        if backward:
            tick.keep = _Inputs(run, act) if remat else _Residuals(run, weights, act, _index(micro_rows, 0))
            tick.slots, tick.remat = ring_slots(S, V, reread_first=remat), remat
            f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)  # noqa: E731
            carry.update(
                bwd=act,
                ring=[jnp.zeros((tick.slots,) + a.shape, a.dtype) for a in tick.keep.avals],
                grad_w=f32(weights),
                grad_h=f32(head_params),
                grad_e=f32(embed_params),
            )
        carry, _ = jax.lax.scan(tick.both if backward else tick.forward_only, carry, jnp.arange(n_ticks), unroll=unroll)
    loss = jax.lax.psum(carry["loss"], manual)
    if not backward:
        return loss
    # Per device: the head's and the embedding's summed over the stages and replicas by the caller,
    # outside the manual region (a bf16 all-reduce inside it does not compile on XLA:CPU).
    grad_h = jax.tree.map(lambda g: g[None], carry["grad_h"])
    grad_e = jax.tree.map(lambda g: g[None], carry["grad_e"])
    grad_w = jax.tree.map(lambda g, a: g.astype(a.dtype)[None], carry["grad_w"], weights)
    return loss, grad_w, grad_h, grad_e


@dataclasses.dataclass
class _Tick:
    """A tick of one stage's pass, the body of its `lax.scan` over the ticks: `forward_only` (the
    loss without autodiff) or `both` (a forward and a backward item), and the values they read.

    Ticks (lockstep: every stage does at most one forward and one backward per tick). Items are
    (micro-batch, chunk) pairs, V per micro-batch (V = 1 without interleaving). Forward item k runs
    at stage s at tick k + s; in the interleaved order micro-batches go in groups of S: item k is
    group g = k // (S V), chunk v = (k mod S V) // S, micro-batch g S + k mod S, so the item stage
    S-1 finishes at tick t is the one stage 0 starts at tick t + 1 (the ring wraps, no buffer in
    between; hence M divisible by S when V > 1). Backward item j (the same order, chunks reversed)
    runs at stage s at tick j + D - s, D = V S + S - 2: a micro-batch's last chunk is run forward and
    backward at stage S-1 in the same tick, and each backward hand-over arrives the tick its stage
    needs it. V M + D ticks in all: the first V S - 1 run forwards only, the last V S - 1 backwards
    only, so a pass takes (S - 1 + V M) (f + b) for chunk times f, b: bubble (S-1)/(V M + S-1).
    Lockstep ticks make a hand-over take a whole tick each way, so stage s holds a forward item for
    2(S-1-s) + 2(V-1-v)S ticks before its backward: the ring keeps `ring_slots` items, at most
    2 V S - 1, where 1F1B run asynchronously keeps about S (V = 1); under stage remat stage 0's
    first chunk is embedded again instead. What an item is: its stage input under stage remat (the
    backward runs its forward again), else the residuals of its forward's `jax.vjp` that depend on it
    (`_Inputs`, `_Residuals`).

    The forward's branch computes one item's values and the ring is updated outside it, in place
    (a ring passed through the branch is copied: benchmarks/RESULTS.md, "numbers moved out of the
    code"); a skipped tick writes zeros to slot k mod slots, rewritten only after its item's
    backward. The gradient accumulators go through the branches and are updated there, in place
    (returned as a tick's gradient, a stage-sized float32 array would be one more buffer)."""

    s: Any  # this stage's index along `pipeline` (traced)
    stages: int
    repeats: int
    items: int  # V M
    run: Callable  # (chunk weights, h, rows or None) -> h: one chunk's layers
    head: Callable  # (head params, h, (labels, mask)) -> the scaled loss
    weights: Any  # [V, L/(S V), ...]
    head_params: Any
    embed: Callable  # micro-batch m -> the stack's input of its rows (embedded here, when needed)
    micro_rows: Any
    micro_targets: Any
    act: Any  # zeros shaped as one micro-batch's activation
    keep: Any = None  # what the ring keeps per item (`both`): _Inputs or _Residuals
    slots: int = 0
    remat: bool = False
    embed_grad: Callable | None = None  # (m, gradient of its stack input, accumulator) -> accumulator

    def forward_only(self, c, t):
        c = dict(c)
        _, f_ok, v_f, inp, rows_f, tgt_f, last = self._forward_inputs(c, t)

        def forward(_):
            y = self.run(_index(self.weights, v_f), inp, rows_f)
            return y, jax.lax.cond(
                last, lambda: self.head(self.head_params, y, tgt_f), lambda: jnp.zeros((), jnp.float32)
            )

        y, loss = jax.lax.cond(f_ok, forward, lambda _: (self.act, jnp.zeros((), jnp.float32)), None)
        c["loss"] = c["loss"] + loss
        c["fwd"] = jax.lax.ppermute(y, "pipeline", self._perm(1))
        return c, None

    def both(self, c, t):
        c = dict(c)
        y, g_y = self._forward(c, t)
        g_x = self._backward(c, t, g_y)
        c["bwd"] = jax.lax.ppermute(g_x, "pipeline", self._perm(-1))
        c["fwd"] = jax.lax.ppermute(y, "pipeline", self._perm(1))
        return c, None

    def _perm(self, step: int) -> list:
        """Every stage hands to stage s + step (the ring wraps)."""
        return [(i, (i + step) % self.stages) for i in range(self.stages)]

    def _forward_inputs(self, c, t):
        """Forward item k = t - s at this tick: (k, whether it exists, its chunk, its input, rows and
        targets, whether it is the last stage's last chunk)."""
        S, V, s = self.stages, self.repeats, self.s
        k = t - s
        f_ok = (k >= 0) & (k < self.items)
        m_f, v_f = decode(jnp.clip(k, 0, self.items - 1), S, V)
        inp = jnp.where((s == 0) & (v_f == 0), self.embed(m_f), c["fwd"])
        rows_f = _index(self.micro_rows, m_f)
        tgt_f = _index(self.micro_targets, m_f)
        last = (s == S - 1) & (v_f == V - 1)
        return k, f_ok, v_f, inp, rows_f, tgt_f, last

    def _forward(self, c, t):
        """The tick's forward item (and at the last chunk of the last stage, the head, the loss and
        its gradient): files what the item's backward reads in the ring; (output, the head's input
        gradient or zeros)."""
        k, f_ok, v_f, inp, rows_f, tgt_f, last = self._forward_inputs(c, t)
        act, keep = self.act, self.keep

        def at_head(y, acc):
            loss, pull = jax.vjp(lambda hp, h: self.head(hp, h, tgt_f), self.head_params, y)
            g_h, g_y = pull(jnp.ones((), jnp.float32))
            return loss, jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, g_h), g_y.astype(act.dtype)

        no_loss = jnp.zeros((), jnp.float32)

        def forward(acc):
            y, kept = keep.forward(_index(self.weights, v_f), inp, rows_f)
            return (y, kept) + jax.lax.cond(last, at_head, lambda y, acc: (no_loss, acc, act), y, acc)

        y, kept, loss, c["grad_h"], g_y = jax.lax.cond(
            f_ok, forward, lambda acc: (act, _zeros(keep.avals), no_loss, acc, act), c["grad_h"]
        )
        c["ring"] = [
            jax.lax.dynamic_update_index_in_dim(r, a, jnp.mod(k, self.slots), 0) for r, a in zip(c["ring"], kept)
        ]
        c["loss"] = c["loss"] + loss
        return y, g_y

    def _backward(self, c, t, g_y):
        """The tick's backward item j = t - D + s: its chunk's gradient added to the stage's, stage 0's
        first chunk's input gradient taken through the embedding into the embedding's; the input
        gradient handed back."""
        S, V, s, act = self.stages, self.repeats, self.s, self.act
        j = t - delay(S, V) + s
        b_ok = (j >= 0) & (j < self.items)
        jc = jnp.clip(j, 0, self.items - 1)
        m_b, v_b = decode(jc, S, V, backward=True)
        first = (s == 0) & (v_b == 0)
        slot = jnp.mod(forward_item(jc, S, V), self.slots)
        kept = [jax.lax.dynamic_index_in_dim(r, slot, keepdims=False) for r in c["ring"]]
        if self.remat:  # stage 0's first chunk: its micro-batch embedded again
            kept = [jnp.where(first, self.embed(m_b), kept[0])]
        cot = jnp.where((s == S - 1) & (v_b == V - 1), g_y, c["bwd"])
        rows_b = _index(self.micro_rows, m_b)
        w_b = _index(self.weights, v_b)

        def backward_step(acc):
            acc_w, acc_e = acc
            g_w, g_x = self.keep.backward(w_b, v_b, kept, rows_b, cot)
            acc_e = jax.lax.cond(first, lambda e: self.embed_grad(m_b, g_x, e), lambda e: e, acc_e)
            return (_add_at(acc_w, g_w, v_b), acc_e), g_x.astype(act.dtype)

        (c["grad_w"], c["grad_e"]), g_x = jax.lax.cond(
            b_ok, backward_step, lambda acc: (acc, act), (c["grad_w"], c["grad_e"])
        )
        return g_x


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


def schedule_gradient(program, stages: int, n: int, reduce_dtype):
    """The 1F1B loss as a function of (staged, head_params, embed_params, x, rows, targets) whose
    gradient is the schedule's: `program(backward)` is the `shard_map` of `stage_pass`; evaluated
    without autodiff it runs the forward ticks only, under autodiff (a custom VJP) the forward pass
    computes the gradients and the backward scales them by the loss's cotangent. n: the batch
    replicas of the manual map. x (token ids), rows and targets get no gradient."""

    @jax.custom_vjp
    def loss(staged, head_params, embed_params, x, rows, targets):
        return program(False)(staged, head_params, embed_params, x, rows, targets)

    def summed(grads, params):  # every stage's and replica's part, summed once in the reduction dtype
        return jax.tree.map(lambda g, a: g.astype(reduce_dtype).sum(0).astype(a.dtype), grads, params)

    def loss_fwd(staged, head_params, embed_params, x, rows, targets):
        value, grad_w, grad_h, grad_e = program(True)(staged, head_params, embed_params, x, rows, targets)
        # the head's is zero but at the last stage, the embedding's but at stage 0
        grads = (grad_w, summed(grad_h, head_params), summed(grad_e, embed_params))
        return value, (grads, x, rows, targets)

    def loss_bwd(res, ct):
        (grad_w, grad_h, grad_e), x, rows, targets = res
        times = lambda g: (g * ct).astype(g.dtype)  # noqa: E731
        none = lambda tree: jax.tree.map(lambda _: None, tree)  # noqa: E731
        return (
            jax.tree.map(times, grad_w),
            jax.tree.map(times, grad_h),
            jax.tree.map(times, grad_e),
            none(x),
            none(rows),
            none(targets),
        )

    loss.defvjp(loss_fwd, loss_bwd)
    return loss


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
    gradient comes from the 1F1B schedule (`stage_pass`, `schedule_gradient` above), computed when the loss's
    forward runs under autodiff (a custom VJP: the forward pass computes the gradients, the backward
    scales them by the loss's cotangent); evaluated without autodiff it runs the forward ticks only.
    The stack's gradient is reduced over data x fsdp once per pass, or once per step through the
    train step's copies (`accumulate`), as the GPipe path does."""
    axes = once_per_pass_axes(mesh, strategy)
    manual = ("pipeline",) + axes
    n = math.prod(mesh.shape[a] for a in axes)
    V = layout_chunks(ONE_F_ONE_B, repeats)
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
            # Unchecked: nested in it, jax 0.10's checked partial evaluation of a layer's own shard_map
            # island gives its residuals the outer map's axes, which Shardy rejects. Its autodiff is
            # ours, so no implicit psum is needed; the islands and shardings inside name the traced
            # (partly manual) mesh (`rules.traced_mesh`), and kernels XLA cannot partition there run
            # per shard (`rules.per_shard`: cuDNN attention).
            check_vma=False,
        )

    return schedule_gradient(program, stages, n, reduce_dtype)(staged, head_params, embed_params, x, rows, targets)


def _staged_1f1b(layer_state, stages: int, n: int, repeats: int | None, mesh, manual, reduce_dtype):
    """Every stage's weights as the 1F1B program takes them, [S n, V, L/(S V), ...]: with batch axes
    to reduce once per pass (`manual`: the map's axes, else None) the per-replica copies (the train
    step's, `accumulate`, where it laid them out), else the stage layout."""
    given = STEP_COPIES.get()
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
