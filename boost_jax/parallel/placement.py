"""What a strategy on a mesh hands the model when the model is built.

The model never asks which strategy is running. `Placement(mesh, strategy)` (or `LOCAL`: one
device, no mesh) chooses once, at construction, the objects the model's modules apply, and the
modules keep them as fields, where a reader sees them:

- `norm(choice)`: how the `norm_choice` (kernels/norm_choice.py) runs: as XLA partitions it (`Norm`),
  or, a Pallas/Triton call GSPMD cannot partition, once per shard in `shard_map` (`PerShardNorm`);
- `group(name, factored)`: how a projection group's GEMMs run: the model's own grouped GEMMs
  (`GROUPED`), with the norm's statistics riding in the A all-reduce (`OnlineNorm`, BTP), or as
  PrimePar's P(n x n) GEMMs on the (fsdp, tensor) grid (`SpatialTemporal`);
- `pipeline(stack)`: None (the model scans its layers), or the pipeline schedule (gpipe | circular |
  1f1b) over the `pipeline` axis for the model's stacked layers (`stack`: their parameters' key),
  which runs the model's loss on them (`Pipeline.train_loss`: 1f1b runs the head and loss inside its
  schedule) and accumulates the train step's gradient (`Pipeline.accumulate`);
- `context()`: None, or the sequence split over the `context` axis (boost_jax/parallel/context.py:
  the load-balanced layout and the attention island).

They are frozen dataclasses: equal when built alike and hashable, as fields of an NNX graph
definition must be. Activation layouts inside them are still looked up in the rules current while
tracing (`rules.constrain`, `rules.logical_spec`): the step builder sets those, and the data and
pipeline islands narrow them for their replicas.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from boost_jax.kernels.norm_choice import NormChoice, choose_norm
from boost_jax.parallel import pipeline, rules
from boost_jax.parallel.context import Context
from boost_jax.parallel.online_norm import online_norm_matmul
from boost_jax.parallel.rules import Strategy
from boost_jax.parallel.spatial_temporal import project_sharded


@dataclasses.dataclass(frozen=True)
class Norm:
    """The norm as XLA partitions it (its XLA kernel), or on one device."""

    def __call__(self, rows, x, scale, names):
        return rows(x, scale)

    def add(self, rows, x, residual, scale, names):
        """`rows(x, residual, scale) -> (y, x + residual)`: the fused residual add + norm."""
        return rows(x, residual, scale)


@dataclasses.dataclass(frozen=True)
class PerShardNorm:
    """A Pallas/Triton norm call (not partitioned by GSPMD) run on each shard's rows. Rows split
    along d (BTP without online norm) need whole rows: those run the XLA kernel instead."""

    mesh: Mesh

    def __call__(self, rows, x, scale, names):
        return self._per_shard(rows, (x,), scale, names, lambda spec: spec)

    def add(self, rows, x, residual, scale, names):
        """`Norm.add` on each shard's rows (y and the sum come out in x's layout)."""
        return self._per_shard(rows, (x, residual), scale, names, lambda spec: (spec, spec))

    def _per_shard(self, rows, arrays, scale, names, out_specs):
        x = arrays[0]
        spec = rules.logical_spec(names, x.shape)
        if spec is None:  # traced outside any rules: the rows as given
            return rows(*arrays, scale)
        if len(spec) == x.ndim and spec[-1] is not None:
            return rows(*arrays, scale, "xla")
        return jax.shard_map(
            lambda *a: rows(*a),
            mesh=rules.traced_mesh(self.mesh),
            in_specs=(*(spec for _ in arrays), P()),
            out_specs=out_specs(spec),
            check_vma=False,
        )(*arrays, scale)  # a pallas_call has no vma types


@dataclasses.dataclass(frozen=True)
class Grouped:
    """The model's own grouped GEMMs (boost_jax/model/linear.py `project`), nothing replaced."""

    fuses_norm = False  # the group's norm is fused with its first stage (`norm_first_stage`)
    replaces_projection = False  # `project` computes each projection's output


GROUPED = Grouped()


@dataclasses.dataclass(frozen=True)
class OnlineNorm(Grouped):
    """BTP's online RMSNorm: the norm's statistics travel in the A partial products' all-reduce."""

    mesh: Mesh
    reduce_dtype: str  # parallel.grad_reduce_dtype: A's gradient is summed over the batch in it
    fuses_norm = True

    def norm_first_stage(self, x, scale, a_stack, *, eps, impl):
        return online_norm_matmul(
            x, scale, a_stack, eps=eps, mesh=rules.traced_mesh(self.mesh), impl=impl, reduce_dtype=self.reduce_dtype
        )


@dataclasses.dataclass(frozen=True)
class SpatialTemporal(Grouped):
    """PrimePar's P(n x n) GEMMs on the (fsdp, tensor) grid for every projection of the group."""

    mesh: Mesh
    strategy: Strategy
    replaces_projection = True

    def project(self, proj, x):
        return project_sharded(proj, x, self.mesh, self.strategy)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """The layer stack as a pipeline schedule over the `pipeline` axis (boost_jax/parallel/pipeline.py):
    gpipe, circular with `repeats` layer chunks per stage, or 1f1b (interleaved with repeats > 1).
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
        weights' gradient reduced over data x fsdp once per step (parallel/pipeline.py `accumulate`).
        `param_specs`: the parameters' PartitionSpecs (the circular reorder keeps the stack's)."""
        return pipeline.accumulate(
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
        return self.schedule == pipeline.ONE_F_ONE_B

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
        head and loss one micro-batch's rows at a time, per batch replica (parallel/pipeline.py
        `per_replica_loss`); 1F1B embeds each micro-batch at stage 0 and runs the final norm, head and
        loss per micro-batch at the last stage, inside its schedule (`pipeline.fused_loss`)."""
        if not self.fused:
            x = embed(embed_params(), tokens)
            h = self(layer, layer_state, x, positions, unroll=unroll, docs=docs, remat_stage=remat_stage)
            norm_state, head_weight = head_params()
            run = pipeline.per_replica_loss(
                functools.partial(loss, row_groups=self.microbatches), mesh=self.mesh, strategy=self.strategy
            )
            return run(final(norm_state, h), head_weight, labels, mask=mask)
        stage, rows = self._stage(layer, tokens, positions, docs, unroll)

        def head(params, h, labels, mask):
            return loss(final(params[0], h), params[1], labels, mask=mask)

        return pipeline.fused_loss(
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
            pipeline.run,
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


@dataclasses.dataclass(frozen=True)
class Placement:
    """A strategy bound to a mesh; `LOCAL` (no mesh) is one device with nothing partitioned."""

    mesh: Mesh | None = None
    strategy: Strategy | None = None

    def norm_choice(self, kernel: str = "xla", residual: str = "separate", factored: bool = False) -> NormChoice:
        """The norm that runs here (kernels/norm_choice.py `choose_norm`) for `kernel` (kernels.rmsnorm,
        resolved) and `residual` (kernels.residual_norm) under a linear kind that is `factored` or not."""
        if self.mesh is None:
            return choose_norm(kernel, residual, factored=factored)
        s = self.strategy
        return choose_norm(
            kernel,
            residual,
            mesh=True,
            tensor=int(self.mesh.shape["tensor"]),
            pipeline=self.mesh.shape.get("pipeline", 1) > 1,
            online_norm=bool(s.online_norm),
            factored=factored,
            st_groups=tuple(s.st_groups),
        )

    def norm(self, choice: NormChoice):
        """How a norm of `choice` (`norm_choice`) runs: per shard, or as XLA partitions it."""
        return PerShardNorm(self.mesh) if choice.per_shard else Norm()

    def group(self, name: str, factored: bool):
        if self.mesh is None:
            return GROUPED
        if name in self.strategy.st_groups:
            return SpatialTemporal(self.mesh, self.strategy)
        if self.norm_choice(factored=factored).online:
            return OnlineNorm(self.mesh, self.strategy.grad_reduce_dtype)
        return GROUPED

    def pipeline(self, stack: str = "layers"):
        if self.mesh is None or self.mesh.shape.get("pipeline", 1) == 1:
            return None
        s = self.strategy
        return Pipeline(
            self.mesh, s, self.mesh.shape["pipeline"], s.microbatches, s.pipeline_schedule, s.pipeline_repeats, stack
        )

    def context(self):
        if self.mesh is None or self.mesh.shape.get("context", 1) == 1:
            return None
        return Context(self.mesh, self.strategy)

    def require_rules(self) -> None:
        """A model built for a mesh traced without that mesh's rules would compile another program
        (its activation layouts unpinned): refuse, naming what to do."""
        if self.mesh is None:
            return
        ctx = rules.current()
        if ctx is None or ctx[0] != self.mesh:
            raise RuntimeError(
                f"this model was built for a {dict(self.mesh.shape)} mesh under strategy {self.strategy.name!r} but "
                "is traced outside its rules: call it through the steps boost_jax.runtime.build makes, or inside "
                "`with boost_jax.parallel.rules.use_rules(mesh, strategy)`"
            )


LOCAL = Placement()
