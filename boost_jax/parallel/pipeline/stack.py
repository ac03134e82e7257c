"""The one entry for a pipelined layer stack, whatever the schedule (`parallel.pipeline_schedule`):
`Pipeline`, which the placement hands the model (parallel/placement.py `Placement.pipeline`). The train
step calls `Pipeline.accumulate`, the model's loss `Pipeline.train_loss`, its hidden states
`Pipeline.__call__`; behind them the schedule-specific parts: gpipe and circular written for GSPMD
(gspmd.py `run`), 1F1B (interleaved with V > 1) one program in a `shard_map` (one_f_one_b.py
`fused_loss`); the stage layouts and per-replica weight copies in layout.py, the tick counts in
arithmetic.py.

The stage weights' gradient over the batch axes (data x fsdp) is reduced once per optimizer step,
in `parallel.grad_reduce_dtype`, not once per tick as GSPMD places it: each batch replica runs the
schedule with its own float32 copy of its stage's weights (`accumulate`, layout.py
`replica_copies`), accumulates its gradient there across ticks and micro-batches, and the copies are
summed once. fsdp is deferred too: per tick buys no memory (the stage's weights are gathered whole
before the loop) and GSPMD's per-tick reduction is a full-size all-reduce. benchmarks/RESULTS.md
("GPipe gradient reduction over data/fsdp") has the measured elements and memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from boost_jax.parallel import rules
from boost_jax.parallel.grad_reduce import each_micro_batch, without_axis
from boost_jax.parallel.pipeline import gspmd, one_f_one_b
from boost_jax.parallel.pipeline.arithmetic import ONE_F_ONE_B, layout_chunks
from boost_jax.parallel.pipeline.layout import (
    STEP_COPIES,
    copy_spec,
    once_per_pass_axes,
    replica_copies,
    stage_copies,
    sum_stage_copies,
)
from boost_jax.parallel.rules import Strategy


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The layer stack as a pipeline over the `pipeline` axis: the one entry a pipelined step goes
    through, for every schedule (gpipe, circular with `repeats` layer chunks per stage, 1f1b,
    interleaved with repeats > 1). The train step calls `accumulate` (every schedule alike: per-replica
    stage-weight copies, their gradient reduced once per step); the model's loss calls `train_loss`,
    which dispatches: gpipe and circular run the stack through gspmd.py `run` and the head per batch
    replica (`per_replica_loss`), 1f1b the stack, head and loss in one_f_one_b.py `fused_loss`; the
    model's hidden states (no loss) call `__call__` (1f1b's layers run as gpipe or circular).
    `stack`: the key of the stacked layers' parameters in the model's parameter tree."""

    mesh: Mesh
    strategy: Strategy
    stages: int
    microbatches: int
    schedule: str = "gpipe"
    repeats: int = 1
    stack: str = "layers"

    def accumulate(self, loss_fn, trained, batch, param_specs=None):
        """The train step's (mean loss, mean gradient) over a batch [grad_accum, rows, ...], the stage
        weights' gradient reduced over data x fsdp once per step (`accumulate` below).
        `param_specs`: the parameters' PartitionSpecs (the circular reorder keeps the stack's)."""
        return accumulate(
            loss_fn,
            trained,
            batch,
            stack=self.stack,
            mesh=self.mesh,
            strategy=self.strategy,
            stages=self.stages,
            schedule=self.schedule,
            repeats=self.repeats,
            specs=None if param_specs is None else param_specs[self.stack],
        )

    @property
    def fused(self) -> bool:
        """1F1B: the head and loss run inside the schedule, at the last stage (`train_loss`)."""
        return self.schedule == ONE_F_ONE_B

    def train_loss(
        self,
        layer,
        layer_state,
        tokens,
        positions=None,
        *,
        embed,
        embed_params,
        docs=None,
        unroll: bool = False,
        remat_stage: bool = False,
        final,
        loss,
        head_params,
        labels,
        mask=None,
    ):
        """The pipelined model's loss: `loss(final(norm_state, h), head_weight, labels, mask=mask)` of the
        stack's output h on `embed(embed_params(), tokens)`, `head_params() -> (norm_state, head_weight)`
        (called where the head's weight is first needed: after the stack under GPipe and circular).
        GPipe and circular embed the batch, run the stack (`__call__`), then the final norm, then the
        head and loss one micro-batch's rows at a time, per batch replica (`per_replica_loss`); 1F1B
        embeds each micro-batch at stage 0 and runs the final norm, head and loss per micro-batch at
        the last stage, inside its schedule (one_f_one_b.py `fused_loss`)."""
        if not self.fused:
            x = embed(embed_params(), tokens)
            h = self(layer, layer_state, x, positions, unroll=unroll, docs=docs, remat_stage=remat_stage)
            norm_state, head_weight = head_params()
            run = per_replica_loss(
                functools.partial(loss, row_groups=self.microbatches), mesh=self.mesh, strategy=self.strategy
            )
            return run(final(norm_state, h), head_weight, labels, mask=mask)
        stage, rows = self._stage(layer, tokens, positions, docs, unroll)

        def head(params, h, labels, mask):
            return loss(final(params[0], h), params[1], labels, mask=mask)

        return one_f_one_b.fused_loss(
            stage,
            head,
            embed,
            layer_state,
            head_params(),
            embed_params(),
            tokens,
            rows,
            (labels, mask),
            stages=self.stages,
            microbatches=self.microbatches,
            mesh=self.mesh,
            strategy=self.strategy,
            repeats=self.repeats,
            remat=remat_stage,
            unroll=unroll,
        )

    def _stage(self, layer, x, positions, docs, unroll):
        """(stage_fn(stage_state, x_micro[, rows_micro]) -> x_micro running the stage's layers in order,
        the per-row inputs it takes: None, or the micro-batch's document rows and positions)."""
        if docs is not None:
            # Rows of documents: their segments (and positions) travel with each micro-batch's rows,
            # and every stage rebuilds the micro-batch's document spans from them.
            rows = {"docs": docs.rows(), **({} if positions is None else {"positions": positions})}

            def stage_docs(stage_state, x_micro, rows_micro):
                micro_pos = rows_micro.get("positions")
                if micro_pos is None:
                    micro_pos = jnp.broadcast_to(jnp.arange(x_micro.shape[1])[None], x_micro.shape[:2])
                micro_docs = type(docs).from_rows(rows_micro["docs"])
                return jax.lax.scan(
                    lambda h, s: (layer(h, s, None, micro_pos, micro_docs)[0], None),
                    x_micro,
                    stage_state,
                    unroll=unroll,
                )[0]

            return stage_docs, rows
        # Training positions are the same for every row. A fresh iota of the micro-batch's shape (the
        # rows gpipe hands the stage) is built on every device; slicing the batch-sharded positions
        # would move rows between devices.
        pos_row = positions[:1] if positions is not None else jnp.arange(x.shape[1])[None]

        def stage(stage_state, x_micro):
            micro_pos = jnp.broadcast_to(pos_row, x_micro.shape[:2])
            return jax.lax.scan(
                lambda h, s: (layer(h, s, None, micro_pos)[0], None), x_micro, stage_state, unroll=unroll
            )[0]

        return stage, None

    def __call__(
        self, layer, layer_state, x, positions=None, *, unroll: bool = False, docs=None, remat_stage: bool = False
    ):
        """`layer(h, state, cache, positions) -> (h, cache)` over the stacked `layer_state` [L, ...].
        remat_stage (`remat.pipeline=stage`): each stage is one jax.checkpoint, so the tick loop keeps
        only the stage's input per micro-batch and recomputes the stage in the backward (the layer remat
        policy, applied inside `layer`, decides what that recompute keeps). 1F1B's hidden states alone
        (no loss: logits, evaluation by logits) run the same layers as gpipe (V = 1) or circular."""
        schedule = self.schedule
        if self.fused:
            schedule = "circular" if self.repeats > 1 else "gpipe"
        run = functools.partial(
            gspmd.run,
            stages=self.stages,
            microbatches=self.microbatches,
            mesh=self.mesh,
            strategy=self.strategy,
            schedule=schedule,
            repeats=self.repeats,
            unroll=unroll,
            remat=remat_stage,
        )
        stage, rows = self._stage(layer, x, positions, docs, unroll)
        if rows is not None:
            return run(stage, layer_state, x, rows=rows)
        return run(stage, layer_state, x)


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
    reads them from `STEP_COPIES`). The loss is differentiated with respect to the copies: each replica's
    gradient stays on its own devices, accumulated in float32 across the micro-batches, and is
    summed over the replicas once, after the loop, in `parallel.grad_reduce_dtype`. `specs`: the
    stack's stored PartitionSpecs (the circular layout keeps their splits through its reorder). The other
    parameters (embedding, head, final norm) are reduced where GSPMD places it (per micro-batch).
    Without batch axes to defer (`once_per_pass_axes` empty) this is the plain accumulation loop."""
    axes = once_per_pass_axes(mesh, strategy)
    a = jax.tree.leaves(batch)[0].shape[0]
    repeats = layout_chunks(schedule, repeats)
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
            token = STEP_COPIES.set(c)
            try:
                return loss_fn(t, x)
            finally:
                STEP_COPIES.reset(token)

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
