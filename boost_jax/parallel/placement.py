"""What a strategy on a mesh hands the model when the model is built.

The model never asks which strategy is running. `Placement(mesh, strategy)` (or `LOCAL`: one
device, no mesh) chooses once, at construction, the objects the model's modules apply and keep as
fields: `norm(choice)` how kernels/norm_choice.py's choice runs (`Norm`, or `PerShardNorm` for a
Pallas/Triton call GSPMD cannot partition); `group(name, factored)` how a projection group's GEMMs
run (`GROUPED`, `OnlineNorm` for BTP, `SpatialTemporal` for PrimePar's grid); `pipeline(stack)` None or the
pipelined layer stack (parallel/pipeline/stack.py `Pipeline`, every schedule); `context()` None or
the sequence split over `context` (parallel/context.py).

They are frozen dataclasses: equal when built alike and hashable, as fields of an NNX graph
definition must be. Activation layouts inside them are still looked up in the rules current while
tracing (`rules.constrain`, `rules.logical_spec`): the step builder sets those.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from boost_jax.kernels.norm_choice import NormChoice, choose_norm
from boost_jax.parallel import rules
from boost_jax.parallel.context import Context
from boost_jax.parallel.online_norm import online_norm_matmul, stored_stream
from boost_jax.parallel.pipeline.stack import Pipeline
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
        if not any(rules.as_tuple(s) for s in spec) and all(
            n == 1 for a, n in self.mesh.shape.items() if a != "tensor"
        ):
            # Tensor parallelism alone, rows replicated (Megatron's and vanilla's stream): the call on the
            # whole rows. The map would all-reduce x's cotangent over `tensor` (check_vma=False: its
            # transpose divides the incoming cotangent and sums it back), which every device already
            # holds whole. Elsewhere the rows may be split where the spec does not say (the data
            # island's vmap over `data`), and a kernel call outside a map is then gathered whole on
            # GPU; so is one in a map manual over the splitting axes alone.
            return rows(*arrays, scale)
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

    def stream(self, x):
        """The residual stream this group's norm reads, as the block hands it on: unchanged."""
        return x


GROUPED = Grouped()


@dataclasses.dataclass(frozen=True)
class OnlineNorm(Grouped):
    """BTP's online RMSNorm: the norm's statistics travel in the A partial products' all-reduce."""

    mesh: Mesh
    reduce_dtype: str  # parallel.grad_reduce_dtype: A's gradient is summed over the batch in it
    fuses_norm = True

    def stream(self, x):
        """The residual stream stored in its own dtype between kernels (parallel/online_norm.py
        `stored_stream`): the statistics and scaled rows read it, its gradient is written likewise."""
        return stored_stream(x)

    def norm_first_stage(self, x, scale, a_stack, *, eps, impl):
        """norm(x)·A_g for the group's stacked A's. `impl` (the norm's kernel) is not used: the local
        statistics are a plain reduction XLA fuses (parallel/online_norm.py)."""
        del impl
        return online_norm_matmul(
            x, scale, a_stack, eps=eps, mesh=rules.traced_mesh(self.mesh), reduce_dtype=self.reduce_dtype
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
