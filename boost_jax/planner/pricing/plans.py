"""The planner's words: a mesh, one layer's partitioning, the search's options, an operator's seconds by
part (`Cost`), a priced plan and a search's result."""

from __future__ import annotations

import dataclasses

from boost_jax.config import CONTEXT_ATTENTION, CONTEXT_KV, PIPELINE_SCHEDULES

STAGE_REMAT = ("none", "stage")  # remat.pipeline


@dataclasses.dataclass(frozen=True)
class Mesh:
    data: int
    fsdp: int
    tensor: int
    pipeline: int = 1
    context: int = 1  # parallel.context: the sequence split (mesh axis between fsdp and tensor)

    @property
    def devices(self) -> int:
        return self.data * self.fsdp * self.tensor * self.pipeline * self.context

    def __str__(self) -> str:
        context = f" c{self.context}" if self.context > 1 else ""
        return f"{self.pipeline}x{self.data}x{self.fsdp}x{self.tensor}" + context


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer's partitioning: the residual stream's layout, the choice per projection group
    (qkv, o, mlp_in, mlp_out) and the layouts the attention and MLP activation run in."""

    residual: str
    choices: tuple[str, str, str, str]
    attention: str
    act: str

    def __str__(self) -> str:
        return f"res {self.residual} | {'/'.join(self.choices)} | attn {self.attention} | act {self.act}"


@dataclasses.dataclass(frozen=True)
class Options:
    batch: int  # global batch, sequences per optimizer step
    seq: int
    attention: str = "auto"  # model.attention the plan runs with: auto | xla | chunked | cudnn | pallas
    remat: tuple = ()  # remat.policy values searched; (): every one the planner prices (cost.remat_policies)
    grad_accum: int = 0  # 0: search
    pipeline: tuple = ()  # pipeline stage counts to search; (): every one that divides devices and layers
    microbatches: int = 0  # pipeline micro-batches per pass when pipelined; 0: search S, 2S, 4S
    schedules: tuple = PIPELINE_SCHEDULES  # parallel.pipeline_schedule values searched
    repeats: int = 0  # circular: chunks per stage V; 0: search every divisor > 1 of L/S
    stage_remat: tuple = STAGE_REMAT  # remat.pipeline values searched
    top: int = 5
    keep: int = 8  # DP paths kept per state
    act_bytes: int = 2  # bf16 activations
    check_memory: bool = True
    # price in full only the plans whose lower bound could enter the result (search's docstring); False:
    # every plan (the same result, slower)
    prune: bool = True
    # parallel.context sizes to search (each splitting seq into 2C equal chunks); (): every divisor of
    # the devices that does (unpipelined plans; see context_sizes)
    context: tuple = ()
    context_attention: tuple = CONTEXT_ATTENTION  # parallel.context_attention values searched
    context_kv: tuple = CONTEXT_KV  # parallel.context_kv values searched (bottleneck: factored kinds)
    # the GPU program compiles with XLA's collective pipeliner (the pipelined all-gather and all-reduce;
    # see cost.PIPELINED_SIGMA); None: as boost_jax/xla_gpu_flags.py pipelined() says here
    pipelined: bool | None = None
    # also price the unrolled layer stack (remat none) where the trainer's `auto` unrolls it: meshes that
    # only `data` splits, or `data` and `tensor` (search_space.auto_unrolls); False: scanned stacks only
    unroll: bool = True
    # the GPU program's layer scan is double-buffered (XLA's while-loop double buffering; see
    # cost.SCAN_DOUBLE_BUFFER); None: as boost_jax/xla_gpu_flags.py double_buffered() says here
    double_buffered: bool | None = None
    # the trainer's --config overrides of plans not to return (parallel.plan=auto compiled them and
    # they did not fit the device: planner/auto.py)
    exclude: frozenset = frozenset()


@dataclasses.dataclass
class Cost:
    """Seconds of one operator (or a sum of them) on one device and micro-batch, by part."""

    compute: float = 0.0  # GEMMs, attention, elementwise; forward + backward
    comm: float = 0.0  # exposed tensor-axis collectives, forward + backward
    recompute: float = 0.0  # what the remat policy re-runs in the backward (compute and collectives)
    kept: float = 0.0  # the HBM traffic of the activations kept for the backward (cluster.kept_passes)

    @property
    def total(self) -> float:
        return self.compute + self.comm + self.recompute + self.kept

    def __add__(self, o: Cost) -> Cost:
        return Cost(self.compute + o.compute, self.comm + o.comm, self.recompute + o.recompute, self.kept + o.kept)

    def scale(self, x: float) -> Cost:
        return Cost(self.compute * x, self.comm * x, self.recompute * x, self.kept * x)


@dataclasses.dataclass
class Plan:
    mesh: Mesh
    grad_accum: int
    remat: str
    layer: Layer
    step_s: float
    tokens_per_s: float
    mfu: float
    memory: dict  # bytes per GPU by part, and "total"
    link_bytes: dict  # bytes per GPU per step: intra / inter
    layer_cost: Cost  # one layer, one micro-batch
    rest_cost: Cost  # embedding, head, loss: one micro-batch
    exposed_dp_s: float  # data/fsdp traffic not hidden behind the micro-batch
    optimizer_s: float
    layer_colls: list  # one layer, one micro-batch: tensor and data/fsdp collectives (no recompute)
    redo_colls: list  # one layer, one micro-batch: forward collectives the remat policy re-runs
    rest_colls: list  # embedding, head, loss (tensor and data/fsdp), one micro-batch
    tokens: float  # tokens per micro-batch on one tensor group
    runnable: str  # "yes" or why the trainer cannot run it
    strategy: str  # the trainer's parallel.strategy (runnable plans)
    sequence_parallel: bool
    overrides: str  # --config.* flags (runnable plans)
    microbatches: int = 1  # pipeline micro-batches per pass (1 without pipelining)
    bubble: float = 0.0  # (S-1)/(V M+S-1): the share of ticks that run on no micro-batch
    shift_s: float = 0.0  # stage hand-overs per accumulation micro-batch (all ticks, fwd + bwd) + the ends'
    schedule: str = "gpipe"  # parallel.pipeline_schedule (pipelined plans)
    repeats: int = 1  # parallel.pipeline_repeats: V layer chunks per stage (circular)
    stage_remat: str = "none"  # remat.pipeline: "stage" recomputes each stage in the backward
    pipeline_colls: list = dataclasses.field(default_factory=list)  # one tick's stage hand-overs
    context_attention: str = ""  # parallel.context_attention / context_kv (plans with context > 1)
    context_kv: str = ""
    # every collective of one accumulation micro-batch as (Coll, times it runs)
    step_colls: list = dataclasses.field(default_factory=list)
    unrolled: bool = False  # model.scan_unroll: the layer stack unrolled (remat none)

    @property
    def remat_label(self) -> str:
        """The remat policy as printed: "none, unrolled" for an unrolled stack."""
        return f"{self.remat}, unrolled" if self.unrolled else self.remat


@dataclasses.dataclass
class Result:
    plans: list  # the top plans, best first (distinct partitionings, each at its best accum/remat)
    best_runnable: Plan | None
    considered: int
    rejected_memory: int
    seconds: float
    smallest: Plan | None  # the least memory of the plans priced (all of them when none fits: it explains that)
    priced: int = 0  # plans priced in full (the others' lower bounds showed they cannot enter the result)
