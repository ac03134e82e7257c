"""The plan search: mesh x pipeline micro-batches x micro-batching x remat policy x per-group partition choices.

For every factorisation pipeline x data x fsdp x tensor of the device count (pipeline: every stage
count that divides the layers; see `stage_counts`), every GPipe micro-batch count (S, 2S, 4S; see
`microbatch_counts`), every gradient-accumulation count that splits the batch evenly and every remat
policy, one transformer layer is solved by PrimePar's segmented dynamic programme: the residual
edges cut the block into two segments (norm -> qkv -> attention -> o -> add, norm -> mlp_in -> act
-> mlp_out -> add); inside a segment the DP state is the activation's layout between operators and an
edge between different layouts costs the redistribution. Each residual layout's segments are solved
independently and summed; identical layers are combined by multiplying by L (by L/S per stage and
the M+S-1 GPipe ticks under pipelining). The DP keeps the `keep` best paths per state (k-best), so
the non-additive parts (data/fsdp traffic hidden behind the micro-batch, memory) are applied
afterwards to a short list. Plans over the usable HBM are rejected.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time

from boost_jax.config import CONTEXT_ATTENTION, CONTEXT_KV
from boost_jax.planner import cost, partitions
from boost_jax.planner.cluster import Cluster

# GPipe micro-batches searched per pass, as multiples of the stage count S (the trainer's default is 2S).
MICROBATCHES_PER_STAGE = (1, 2, 4)
# ... and for 1F1B alone, whose kept activations do not grow with M: more micro-batches, less bubble.
MICROBATCHES_PER_STAGE_1F1B = (8, 16)
SEGMENTS = (("qkv", "attention", "o"), ("mlp_in", "act", "mlp_out"))
BUILDERS = {
    "edge": partitions.edge,
    "norm": partitions.norm,
    "group": partitions.group_op,
    "attention": partitions.attention,
    "act": partitions.activation,
    "add": partitions.residual_add,
}


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
    schedules: tuple = cost.PIPELINE_SCHEDULES  # parallel.pipeline_schedule values searched
    repeats: int = 0  # circular: chunks per stage V; 0: search every divisor > 1 of L/S
    stage_remat: tuple = cost.STAGE_REMAT  # remat.pipeline values searched
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
    # the GPU program's layer scan is double-buffered (XLA's while-loop double buffering; see
    # cost.SCAN_DOUBLE_BUFFER); None: as boost_jax/xla_gpu_flags.py double_buffered() says here
    double_buffered: bool | None = None


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
    layer_cost: cost.Cost  # one layer, one micro-batch
    rest_cost: cost.Cost  # embedding, head, loss: one micro-batch
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


@dataclasses.dataclass
class Result:
    plans: list  # the top plans, best first (distinct partitionings, each at its best accum/remat)
    best_runnable: Plan | None
    considered: int
    rejected_memory: int
    seconds: float
    smallest: Plan | None  # the least memory of the plans priced (all of them when none fits: it explains that)
    priced: int = 0  # plans priced in full (the others' lower bounds showed they cannot enter the result)


# ---------------------------------------------------------------- one (tensor size, micro-batch, policy)


class Pricer:
    """Operators and their costs for one context, memoised (the DP asks for the same ones often)."""

    def __init__(self, ctx: partitions.Ctx, cluster: Cluster, policy: str, opts: Options):
        self.ctx, self.cluster, self.policy, self.opts = ctx, cluster, policy, opts
        self._ops: dict = {}
        self._costs: dict = {}
        self._summaries: dict = {}
        self._rest: dict = {}
        self._bounds: dict = {}  # (layer, micro-batches, stage remat) -> what lower_bound reads
        self.layers: list | None = None

    def op(self, key) -> partitions.Op | None:
        """key = (kind, *arguments of the partitions.py builder)."""
        if key not in self._ops:
            self._ops[key] = BUILDERS[key[0]](self.ctx, *key[1:])
        return self._ops[key]

    def cost(self, key) -> cost.Cost:
        if key not in self._costs:
            self._costs[key] = cost.price(
                self.op(key), self.cluster, self.policy, self.ctx.attention, self.opts.act_bytes
            )
        return self._costs[key]

    def seconds(self, keys) -> float:
        return sum(self.cost(k).total for k in keys)


class Stages:
    """The operator keys of one segment's three DP stages, entered and left in `residual`:
    first(g) = edge in, norm, first group; core(src, layout) = edge, attention/act;
    last(core, g) = edge, last group, edge back to the residual, residual add."""

    def __init__(self, pr: Pricer, seg, residual: str):
        b = self.block = pr.ctx.block
        self.seg, self.residual, self.d = seg, residual, b.d
        self.w1, self.w2 = sum(b.projections(seg[0])[1]), b.projections(seg[2])[0]
        self.layer_output = seg == SEGMENTS[-1]  # the layer's last edge is never recomputed

    def first(self, g) -> list:
        """g: a choice of partitions.group_choices (name, input layout, output layout, split)."""
        partial = partitions.partial_input_grad(self.block, g[3])
        if self.residual == "S" and g[1] != "S":  # sequence parallelism: normalise the token shard, then gather
            return [
                ("norm", "S", False),
                ("edge", "S", g[1], self.d, partial, False, True),
                ("group", self.seg[0], g[3], False),
            ]
        fused = g[3].fused  # the strategy's online RMSNorm: the statistics ride in A's all-reduce
        return [
            ("edge", self.residual, g[1], self.d, partial, False),
            ("norm", g[1], fused),
            ("group", self.seg[0], g[3], fused),
        ]

    def core(self, src: str, layout: str) -> list:
        return [("edge", src, layout, self.w1, False, False), (self.seg[1], layout)]

    def last(self, core: str, g) -> list:
        return [
            ("edge", core, g[1], self.w2, partitions.partial_input_grad(self.block, g[3]), False),
            ("group", self.seg[2], g[3], False),
            ("edge", g[2], self.residual, self.d, False, self.layer_output),
            ("add", self.residual),
        ]


def solve_segment(pr: Pricer, seg, residual: str, k: int) -> list[tuple[float, tuple]]:
    """k best (seconds, (first choice, core layout, last choice)) for a segment entered and left in
    `residual`: a DP over the activation's layout between the operators."""
    st = Stages(pr, seg, residual)
    firsts, lasts = group_choices(pr.ctx, seg[0]), group_choices(pr.ctx, seg[2])
    state: dict[str, list] = {}
    for first in firsts:  # stage 1 -> state = the first group's output layout
        state.setdefault(first[2], []).append((pr.seconds(st.first(first)), (first,)))
    cores: dict[str, list] = {}
    for lay, paths in state.items():  # stage 2 -> state = the core's layout
        paths = heapq.nsmallest(k, paths)
        for core in partitions.layouts(pr.ctx):
            if pr.op((seg[1], core)) is None:
                continue
            s = pr.seconds(st.core(lay, core))
            cores.setdefault(core, []).extend((t + s, path + (core,)) for t, path in paths)
    done = []
    for core, paths in cores.items():  # stage 3 -> back in the residual layout
        paths = heapq.nsmallest(k, paths)
        for last in lasts:
            s = pr.seconds(st.last(core, last))
            done.extend((t + s, path + (last,)) for t, path in paths)
    return heapq.nsmallest(k, done)


def best_layers(pr: Pricer, k: int) -> list[Layer]:
    """The k fastest layer partitionings over every residual layout (memoised on the pricer)."""
    if pr.layers is None:
        found = []
        for residual in partitions.layouts(pr.ctx):
            attn, mlp = (solve_segment(pr, seg, residual, k) for seg in SEGMENTS)
            for ta, (qkv, lay_a, o) in attn:
                for tm, (gu, lay_m, down) in mlp:
                    found.append((ta + tm, Layer(residual, (qkv[0], o[0], gu[0], down[0]), lay_a, lay_m)))
        pr.layers = [layer for _, layer in heapq.nsmallest(k, found, key=lambda x: x[0])]
    return pr.layers


def layer_keys(pr: Pricer, layer: Layer) -> list:
    """The operator keys of a whole layer, in order."""
    choice = dict(zip(partitions.GROUPS, layer.choices))
    keys = []
    for seg, core in zip(SEGMENTS, (layer.attention, layer.act)):
        first, last = ({c[0]: c for c in group_choices(pr.ctx, g)}[choice[g]] for g in (seg[0], seg[2]))
        st = Stages(pr, seg, layer.residual)
        keys += st.first(first) + st.core(first[2], core) + st.last(core, last)
    return keys


# ---------------------------------------------------------------- a whole plan


@dataclasses.dataclass
class LayerSummary:
    """What a plan needs of one layer partitioning on one pricer (mesh-independent, memoised)."""

    ops: list
    cost: cost.Cost  # one layer, one micro-batch
    norm_w: float  # norm weights (not fsdp-sharded)
    fsdp_w: float  # the rest of the layer's weights on one tensor shard but st's
    grid_w: float  # st's weights on one tensor shard (fsdp-split, never gathered)
    tensor_colls: list  # tensor-axis collectives, forward + backward
    recomputed: list  # forward collectives the remat policy re-runs
    saved: float  # activation bytes kept for the backward (the remat policy's, plus its carry)
    working: float  # one layer's recomputed activations during its backward under remat
    tensor_links: dict  # bytes on each link: intra / inter (tensor + recomputed collectives)
    kept_none: float  # activation bytes the layer keeps without remat (its recompute under stage remat)
    bottleneck: float = 0.0  # σ(A·x) A output elements the layer keeps (see cost.PIPELINED_SIGMA)
    # seconds of the layer's forward alone (what remat.pipeline=stage re-runs) and the collectives it
    # runs (tensor axis; st's permutes): priced on first use (stage_forward)
    forward: float | None = None
    forward_colls: list | None = None


def layer_summary(pr: Pricer, layer: Layer) -> LayerSummary:
    if layer not in pr._summaries:
        ctx, cl, opts, policy = pr.ctx, pr.cluster, pr.opts, pr.policy
        keys = layer_keys(pr, layer)
        ops = [pr.op(k) for k in keys]
        _, strategy, _ = runnable(ctx.block, Mesh(1, 1, ctx.t), layer)
        stored = [
            partitions.st_stored(ctx, g, strategy)
            for g, choice in zip(partitions.GROUPS, layer.choices)
            if choice == partitions.ST and strategy
        ]
        extra = [c for colls, _ in stored for c in colls]
        grid_w = sum(w for _, w in stored) if stored else sum(op.grid_weights for op in ops)
        if extra:  # the strategy's stored layouts cost the st groups more than P(n x n) (see there)
            ops.append(partitions.Op(f"st weights@{strategy}", colls=extra, recompute=False))
        norm_w = sum(op.weights for op in ops if op.name.startswith("norm"))
        tensor_colls = [c for op in ops for c in op.all_colls()]
        # forward collectives the remat policy re-runs: the operators' own and the st matmuls'
        # (st_seconds already counts their time; see st_recomputed)
        recomputed = [c for op in ops for c in cost.recomputed(op, policy)[3] + cost.st_recomputed(op, policy)]
        carry = ctx.local(layer.residual, ctx.block.d) * opts.act_bytes if policy != "none" else 0.0
        links = {"intra": 0.0, "inter": 0.0}
        for c in tensor_colls + recomputed:
            links["inter" if cl.spans_nodes(c.stride, c.size) else "intra"] += cost.link_bytes(
                c.kind, cost.coll_bytes(c, opts.act_bytes), c.size
            )
        pr._summaries[layer] = LayerSummary(
            ops=ops,
            cost=sum((pr.cost(k) for k in keys), cost.Cost())
            + sum((cost.price(op, cl, "none", ctx.attention, opts.act_bytes) for op in ops[len(keys) :]), cost.Cost())
            + cost.Cost(kept=cl.kept_passes * carry / cl.hbm_bandwidth),  # the layer input a remat policy keeps
            norm_w=norm_w,
            fsdp_w=sum(op.weights for op in ops) - norm_w,
            grid_w=grid_w,
            tensor_colls=tensor_colls,
            recomputed=recomputed,
            saved=sum(cost.saved_bytes(op, policy, opts.act_bytes) for op in ops) + carry,
            working=cost.backward_working(ops, policy, opts.act_bytes),
            tensor_links=links,
            kept_none=sum(cost.saved_bytes(op, "none", opts.act_bytes) for op in ops),
            bottleneck=sum(op.bottleneck for op in ops),
        )
    return pr._summaries[layer]


def stage_forward(pr: Pricer, s: LayerSummary) -> LayerSummary:
    """`s` with its forward and forward_colls: remat.pipeline=stage re-runs the whole forward of the
    stage (every operator, the layer's output edge included) before its backward, whatever the layer
    policy keeps inside. Priced once, where a plan needs it."""
    if s.forward is None:
        whole = [dataclasses.replace(op, recompute=True) for op in s.ops]
        s.forward = sum(
            cost.price(op, pr.cluster, "full", pr.ctx.attention, pr.opts.act_bytes).recompute for op in whole
        )
        s.forward_colls = [c for op in whole for c in cost.recomputed(op, "full")[3] + cost.st_recomputed(op, "full")]
    return s


def rest_ops(pr: Pricer, residual: str, microbatches: int) -> tuple[list, cost.Cost]:
    """Embedding, head and loss (and their cost) of one accumulation micro-batch: outside the
    pipeline they run on all its rows, on every stage."""
    key = (residual, microbatches)
    if key not in pr._rest:
        ctx = pr.ctx if microbatches == 1 else dataclasses.replace(pr.ctx, tokens=pr.ctx.tokens * microbatches)
        rest = [partitions.embedding(ctx, residual), partitions.head(ctx, residual, microbatches)]
        pr._rest[key] = (
            rest,
            sum((cost.price(op, pr.cluster, "none", pr.ctx.attention, pr.opts.act_bytes) for op in rest), cost.Cost()),
        )
    return pr._rest[key]


def f1b_rest(pr: Pricer, residual: str, mesh: Mesh, microbatches: int, dp_rest: list, rest: list):
    """1F1B's embedding and head traffic (boost_jax/parallel/pipeline.py `fused_loss`): the head and loss
    run per micro-batch at the last stage (the head op of one micro-batch's rows, M times), and the
    head's gradient (each stage and replica's float32 part) is all-reduced over pipeline x data x fsdp
    once per pass, the embedding's over data x fsdp as GPipe's. -> (dp_rest, [(coll, times)])."""
    head_w = rest[1].weights  # d V/t + the final norm's d
    ways = mesh.data * mesh.fsdp
    dp_rest = [dataclasses.replace(c, elements=c.elements - head_w) if c.kind == "all-reduce" else c for c in dp_rest]
    dp_rest.append(
        partitions.Coll(
            "all-reduce",
            head_w,
            mesh.pipeline * ways,
            mesh.tensor,
            "bwd",
            "pipeline_weights" if ways > 1 else "pipeline",
        )
    )
    one = partitions.head(pr.ctx, residual, 1)
    return dp_rest, [(c, 1) for c in rest[0].colls] + [(c, microbatches) for c in one.colls]


def data_colls(
    mesh: Mesh,
    fsdp_weights: float,
    other_weights: float,
    remat: str,
    pipelined: bool = False,
    grid_weights: float = 0.0,
) -> tuple[list[partitions.Coll], list[partitions.Coll]]:
    """Data/fsdp traffic of one layer's parameters (elements per tensor shard) as (once, per_pass):
    `once` runs once per layer per accumulation micro-batch, `per_pass` once per layer pass (every
    GPipe tick when pipelined). FSDP gathers the weights before use, in the compute dtype (again in the
    backward when remat recomputes the forward). The gradients are reduce-scattered over fsdp alone,
    else all-reduced over data (x fsdp), as the compiled HLO does; the trainer sums micro-batch
    gradients in the parameters' layout, so this happens once per micro-batch.
    Pipelined (boost_jax/parallel/pipeline.py, read from its compiled HLO): the stage's weights are
    gathered once before the tick loop, every batch replica accumulates its own float32 gradient over
    the ticks, and that is all-reduced over data x fsdp once per pass, at full size (the accumulator is
    the whole stage's gradient), so both land in `once`; nothing over data/fsdp runs per tick, remat
    included (the gathered copies are the loop's inputs). Pipelined st plans keep GSPMD's placement
    (see pipeline.once_per_pass_axes), priced as below.
    st's weights (`grid_weights`) stay split over fsdp: their gradient, summed over the grid's rows
    by the Cannon schedule, is only all-reduced over data.
    Under parallel.context = C the gradient of every weight (per tensor shard, whole: the compiled
    step all-reduces it over `context` before the fsdp/data reduction, or with it) is all-reduced over
    `context` too, once per micro-batch: context acts like data for the gradients. (Where the mesh
    also has data or fsdp, XLA folds part of the two reductions into one over both axes: the
    separate pricing here is an upper bound on those bytes.)"""
    t, f, d = mesh.tensor, mesh.fsdp, mesh.data
    once, per_pass = [], []
    if pipelined and not grid_weights:
        if f > 1:
            once.append(partitions.Coll("all-gather", fsdp_weights, f, t, "fwd", "data_fsdp"))
        if d * f > 1:
            once.append(partitions.Coll("all-reduce", fsdp_weights + other_weights, d * f, t, "bwd", "data_fsdp"))
    else:
        if grid_weights and d > 1:
            per_pass.append(partitions.Coll("all-reduce", grid_weights / f, d, f * t, "bwd", "data_fsdp"))
        if f > 1:
            once.append(partitions.Coll("all-gather", fsdp_weights, f, t, "fwd", "data_fsdp"))
            if remat != "none":
                per_pass.append(partitions.Coll("all-gather", fsdp_weights, f, t, "bwd", "data_fsdp"))
        if d > 1 or (pipelined and f > 1):
            per_pass.append(partitions.Coll("all-reduce", fsdp_weights + other_weights, d * f, t, "bwd", "data_fsdp"))
        elif f > 1:
            per_pass += [
                partitions.Coll("reduce-scatter", fsdp_weights, f, t, "bwd", "data_fsdp"),
                partitions.Coll("all-reduce", other_weights, f, t, "bwd", "data_fsdp"),
            ]
    if mesh.context > 1:  # the weights are replicated over `context`: their gradient is summed over it
        per_pass.append(
            partitions.Coll("all-reduce", fsdp_weights + other_weights, mesh.context, mesh.tensor, "bwd", "data_fsdp")
        )
    return once, per_pass


def linear_partition(layer: Layer) -> str:
    """`parallel.linear_partition` for the layer's st groups ("" when none)."""
    groups = [g for g, c in zip(partitions.GROUPS, layer.choices) if c == partitions.ST]
    return partitions.ST if len(groups) == len(partitions.GROUPS) else ",".join(f"{g}={partitions.ST}" for g in groups)


_RUNNABLE: dict = {}  # runnable's answers within one search (cleared when a search or plan_for starts)
_CHOICES: dict = {}  # group_choices' answers, the same


def group_choices(ctx: partitions.Ctx, group: str) -> list:
    """partitions.group_choices, memoised within one search (it depends on the block, the tensor size
    and the st grid's side)."""
    key = (ctx.block, ctx.t, ctx.n, group)
    if key not in _CHOICES:
        _CHOICES[key] = partitions.group_choices(ctx, group)
    return _CHOICES[key]


def runnable(block: partitions.Block, mesh: Mesh, layer: Layer) -> tuple[str, str, bool]:
    """("yes", strategy, sequence_parallel) if the trainer runs this layer as one of its strategies
    (their rule tables, read by partitions.strategy_layers) with its st groups spatial-temporal
    (parallel.linear_partition), else ("no: why", "", False). On one tensor shard every strategy runs
    alike: the first registered one the model's kind takes."""
    key = (block.factored, block.online_norm, mesh.tensor == 1, layer)
    if key not in _RUNNABLE:
        _RUNNABLE[key] = _runnable(block, mesh, layer)
    return _RUNNABLE[key]


def _runnable(block: partitions.Block, mesh: Mesh, layer: Layer) -> tuple[str, str, bool]:
    tables = [
        t
        for t in partitions.strategy_layers(block.factored, block.online_norm)
        if block.factored or not t.factored_only
    ]
    if mesh.tensor == 1 and tables:
        return "yes", tables[0].name, False
    for table in tables:
        choices = partitions.choice_names(table, block.factored, block.online_norm)
        if (layer.residual, layer.attention, layer.act) == (table.residual, table.attention, table.act) and all(
            c in (base, partitions.ST) for c, base in zip(layer.choices, choices)
        ):
            return "yes", table.name, table.sequence_parallel
    if len(set(layer.choices) - {partitions.ST}) > 1:
        return "no: mixed per-group choices", "", False
    return "no: layouts the strategy tables do not express", "", False


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a plan's stages run one accumulation micro-batch (unpipelined: one stage, one tick)."""

    stages: int
    microbatches: int  # pipeline micro-batches M (1 unpipelined)
    name: str  # gpipe | circular | 1f1b
    repeats: int  # V: chunks per stage (1 for GPipe)
    stage_remat: str  # remat.pipeline
    ticks: int  # V M + S - 1
    layers_per_stage: int
    layers_per_tick: int  # one chunk: L/(S V)
    runs: int  # layer passes per device per accumulation micro-batch (bubble ticks included)
    handovers: int  # ticks that hand over to the next stage (cost.handover_ticks)
    executed: int  # layer passes a device computes

    @property
    def staged(self) -> bool:
        return self.stage_remat == "stage"

    @property
    def f1b(self) -> bool:
        return self.name == "1f1b"


def schedule_of(layers: int, stages: int, microbatches: int, schedule: str, repeats: int, stage_remat: str) -> Schedule:
    """The schedule a plan runs: unpipelined, one GPipe tick; GPipe, V = 1."""
    microbatches = microbatches if stages > 1 else 1
    if stages == 1:
        schedule, repeats, stage_remat = "gpipe", 1, "none"
    elif schedule == "gpipe":
        repeats = 1
    ticks, per_stage = cost.pipeline_ticks(stages, microbatches, repeats), layers // stages
    per_tick = per_stage // repeats
    runs = ticks * per_tick
    # 1F1B's lockstep ticks run a forward and a backward each: V M + V S + S - 2 of them hand over, and
    # their compute adds up to the V M + S - 1 ticks above (cost.handover_ticks)
    handovers = cost.handover_ticks(stages, microbatches, repeats, schedule)
    # layer passes a device runs: every tick's (bubble ticks compute on nothing), but 1F1B skips the
    # ticks a stage has no item for (its time still waits for them: `step_seconds` counts `runs`)
    executed = repeats * microbatches * per_tick if schedule == "1f1b" else runs
    return Schedule(
        stages, microbatches, schedule, repeats, stage_remat, ticks, per_stage, per_tick, runs, handovers, executed
    )


@dataclasses.dataclass
class StepCollectives:
    """Every collective of one accumulation micro-batch but the layers' tensor-axis ones."""

    shift: list  # one stage hand-over, each way
    ends: list  # the pipeline's inputs, outputs (and the circular chunk layout's reorder)
    shift_seconds: float  # every hand-over and end of the micro-batch
    data_once: list  # per layer, once per optimizer step when pipelined (data_colls)
    data: list  # per layer pass
    data_rest: list  # the embedding's and head's, once
    rest: list  # [(collective, 1)] of the embedding, head and loss
    counted: list  # [(collective, how often it runs)]: all of the above, and the stage's re-run forward


def step_collectives(
    pr: Pricer,
    mesh: Mesh,
    grad_accum: int,
    layer: Layer,
    summary: LayerSummary,
    sched: Schedule,
    rest: list,
    rest_fsdp_weights: float,
) -> StepCollectives:
    ctx, cluster, act_bytes = pr.ctx, pr.cluster, pr.opts.act_bytes
    stages, pipelined = sched.stages, sched.stages > 1
    shift = partitions.stage_shift(ctx, layer.residual, stages, mesh.data * mesh.fsdp * mesh.tensor, sched.name)
    ends = partitions.pipeline_ends(
        ctx, layer.residual, stages, mesh.data * mesh.fsdp * mesh.tensor, sched.microbatches, sched.name
    )
    if sched.name == "circular" or (sched.f1b and sched.repeats > 1):  # interleaved 1F1B: circular's chunk layout
        stage_weights = sched.layers_per_stage * ((summary.fsdp_w + summary.grid_w) / mesh.fsdp + summary.norm_w)
        ends += partitions.circular_reorder(stage_weights, stages, sched.repeats, mesh.data * mesh.fsdp * mesh.tensor)
    # The tick loop is a scan: every tick hands over each way (the last forward one feeds nothing,
    # but the scanned step runs it).
    shifts = [(c, sched.handovers) for c in shift]
    shift_seconds = sum(times * cost.coll_seconds(c, cluster, act_bytes) for c, times in shifts) + sum(
        cost.coll_seconds(c, cluster, act_bytes) for c in ends
    )

    data_once, data = data_colls(
        mesh, summary.fsdp_w, summary.norm_w, pr.policy, pipelined=pipelined, grid_weights=summary.grid_w
    )
    # embedding and head, once (pipelined: their gradient is all-reduced over fsdp too, as compiled)
    data_rest = sum(data_colls(mesh, rest_fsdp_weights, ctx.block.d, "none", pipelined=pipelined), [])
    rest_colls = [(c, 1) for op in rest for c in op.colls]
    if sched.f1b:  # the head runs per micro-batch at the last stage, its gradient summed over stages and replicas
        data_rest, rest_colls = f1b_rest(pr, layer.residual, mesh, sched.microbatches, data_rest, rest)
    redo = summary.forward_colls if sched.staged else []  # remat.pipeline=stage: the stage's forward, again
    # Pipelined (but st), the stage's gather and gradient reduction run once per optimizer step, not
    # per accumulation micro-batch (boost_jax/parallel/pipeline.py): 1/grad_accum of them per micro-batch.
    once = sched.layers_per_stage / grad_accum if pipelined and not summary.grid_w else sched.layers_per_stage
    counted = (
        [(c, sched.executed) for c in data + redo]
        + [(c, once) for c in data_once]
        + shifts
        + rest_colls
        + [(c, 1) for c in data_rest + ends]
    )
    return StepCollectives(shift, ends, shift_seconds, data_once, data, data_rest, rest_colls, counted)


def parameters_per_device(
    mesh: Mesh, summary: LayerSummary, sched: Schedule, rest_fsdp_weights: float, d_model: int
) -> float:
    """Parameters one device stores: its stage's layers, the embedding and head (fsdp-sharded), the final norm."""
    layer_weights = (summary.fsdp_w + summary.grid_w) / mesh.fsdp + summary.norm_w
    return sched.layers_per_stage * layer_weights + rest_fsdp_weights / mesh.fsdp + d_model


def step_seconds(
    pr: Pricer,
    grad_accum: int,
    summary: LayerSummary,
    sched: Schedule,
    colls: StepCollectives,
    rest_cost: cost.Cost,
    params: float,
) -> tuple[float, float, float]:
    """(step seconds, exposed data/fsdp seconds per micro-batch, optimizer seconds)."""
    cluster = pr.cluster
    data_seconds = sum(
        times * cost.coll_seconds(c, cluster, pr.opts.act_bytes) for c, times in colls.counted if c.axis == "data_fsdp"
    )
    # Data/fsdp collectives run on their own stream, mostly over other links (their groups span nodes,
    # tensor groups usually do not): they hide behind the whole micro-batch, only the excess shows.
    # Every tick runs every stage (bubble ticks compute on nothing), then hands over: ticks x stage.
    path = (
        sched.runs * (summary.cost.total + (summary.forward if sched.staged else 0.0))
        + colls.shift_seconds
        + rest_cost.total
    )
    exposed = max(0.0, data_seconds - path)
    micro_seconds = path + exposed
    optimizer_seconds = params * cost.OPTIMIZER_TRAFFIC / cluster.hbm_bandwidth
    return grad_accum * micro_seconds + optimizer_seconds, exposed, optimizer_seconds


def memory_bytes(
    pr: Pricer,
    mesh: Mesh,
    grad_accum: int,
    layer: Layer,
    summary: LayerSummary,
    sched: Schedule,
    params: float,
    rest_fsdp_weights: float,
) -> dict:
    """Peak bytes per device by term (see the comments), their allocator overhead and total."""
    ctx, opts, policy, block = pr.ctx, pr.opts, pr.policy, pr.ctx.block
    stages, staged, per_stage, per_tick = sched.stages, sched.staged, sched.layers_per_stage, sched.layers_per_tick
    replica = (
        per_stage * (summary.fsdp_w + summary.norm_w) * cost.STATE_BYTES
        if mesh.data * mesh.fsdp > 1 and stages > 1 and not summary.grid_w
        else 0.0
    )
    # under stage remat with FSDP, one tick's gradient of the weights it ran (a chunk: 1/V of the stage)
    # waits before it is added
    accumulator = replica * (1 + (staged and mesh.fsdp > 1) / sched.repeats)
    gpu = partitions.gpu(ctx)
    if sched.name == "circular" and not staged and not gpu:  # the reordered stage copies (cost.CIRCULAR_COPIES)
        accumulator += cost.CIRCULAR_COPIES * per_stage * (summary.fsdp_w + summary.norm_w) * cost.STATE_BYTES
    weights = summary.fsdp_w + summary.grid_w / mesh.fsdp  # one layer's weights as its GEMMs read them
    # Pipelined without stage remat, the GPU program (bf16 compute) keeps the compute-dtype copies of
    # the stage's weights its GEMMs read for the backward (the float32 program reads the gathered
    # float32 replica itself): GPipe casts the stage's weights once before the tick loop (loop
    # invariant, hoisted out of the scan) and keeps that copy to the end of the backward; circular
    # selects and casts each tick's chunk inside the loop, so the scan stacks every tick's chunk as a
    # residual, ticks x L/(S V) layers (the deviceless H100 compiles of benchmarks/aot_fit.py:
    # llama_7b p4 x f8 x t2 GPipe M 16 keeps bf16[8 layers, ...] stage copies, 1.62 GB; llama_1b
    # p4 x f8 x t2 circular V 2 M 8 keeps bf16[19 ticks, 3 layers, ...], 2.87 GB per GPU).
    # 1F1B's kept items per stage (a stage input each under stage remat, else a chunk's kept set)
    f1b_items = cost.ring_slots(stages, sched.repeats, staged) + (cost.F1B_IN_FLIGHT_GPU if gpu else cost.F1B_IN_FLIGHT)
    tick_weights = 0.0
    if stages > 1 and gpu and not staged and policy == "none":
        tick_weights = (sched.runs if sched.name == "circular" else per_stage) * weights * opts.act_bytes
    # Unpipelined FSDP without remat, XLA's collective pipeliner (when the GPU program gets it) makes
    # the scanned layers keep more stacked arrays of the σ(A·x) bottleneck (cost.PIPELINED_SIGMA). Pipelined
    # plans gather their stage once before the tick loop, so it has no per-layer gather to move there.
    # Not with context parallelism: the README's cola_13b seq-32k plan (fsdp 4 x context 8 x tensor 2,
    # ring, bottleneck) compiles for 64 H100s at 58.9 GB with the pipeliner, against 63.6 priced without
    # the term (61.8 before the GPU loss and the scan's double buffer, 2026-11-27) and 71.5 with it then.
    pipeliner = (
        cost.PIPELINED_SIGMA * per_stage * summary.bottleneck * opts.act_bytes
        if stages == 1
        and mesh.fsdp > 1
        and mesh.context == 1
        and gpu
        and policy == "none"
        and summary.bottleneck
        and cost.pipeliner(opts.pipelined)
        else 0.0
    )
    # Unpipelined without remat, the GPU program's double-buffered layer scan keeps one more stacked
    # [layers, T, ff/t] array (cost.SCAN_DOUBLE_BUFFER), when the program gets the flag.
    double_buffer = (
        cost.SCAN_DOUBLE_BUFFER * per_stage * ctx.tokens * block.ff / mesh.tensor * opts.act_bytes
        if stages == 1 and gpu and policy == "none" and opts.double_buffered
        else 0.0
    )
    # pipelined, the loss runs one pipeline micro-batch's rows at a time (model/loss.py row_groups); its
    # GPU count is the unpipelined program's only (cost.GPU_LOGIT_BUFFERS)
    microbatches = sched.microbatches
    rest_tokens = ctx.tokens * microbatches
    loss = cost.loss_bytes(
        rest_tokens / ctx.local_seq / microbatches,
        ctx.local_seq,
        block.loss_chunk,
        block.vocab / mesh.tensor,
        gpu and stages == 1,
    ) + rest_fsdp_weights * cost.table_bytes(mesh.fsdp, opts.act_bytes)
    residual = ctx.local(layer.residual, block.d)  # one stage input
    memory = {
        "states": cost.state_bytes(params, grad_accum),
        # without remat every layer's compute-layout weights (FSDP: gathered) are kept for its
        # backward; with it, one layer's gathered weights and gradient, double-buffered
        "weights": (
            tick_weights
            if stages > 1
            else per_stage * weights * opts.act_bytes
            if policy == "none"
            else 2 * summary.fsdp_w * cost.STATE_BYTES
            if mesh.fsdp > 1
            else 0.0
        ),
        # pipelined over data x fsdp: each batch replica's float32 copy of its stage's weights
        # (FSDP: gathered once before the tick loop); its gradient accumulator: see `working`
        "gathered": replica,
        # under autodiff the tick loop keeps every tick's stage activations (the scan's residuals);
        # remat.pipeline=stage keeps only each tick's stage input
        # 1F1B keeps cost.ring_slots items per stage whatever M is
        "activations": (
            f1b_items * (residual * opts.act_bytes if staged else per_tick * summary.saved)
            if sched.f1b
            else sched.ticks * residual * opts.act_bytes
            if staged
            else sched.runs * summary.saved
        ),
        # the peak's transient part: the loss's float32 logits chunk with the embedding table and
        # LM head as used (FSDP: gathered) and their whole gradients before the fsdp reduction,
        # or one layer's backward (its recomputed activations under remat, st's and the context
        # ring's buffers), or the optimizer update's new state beyond what the backward kept (then freed)
        "transient": 0.0,
        # the pipelined micro-batches' inputs and outputs ([M, rows/M, T, d] each)
        "pipeline": 2 * residual * microbatches * opts.act_bytes if stages > 1 else 0.0,
        # XLA's collective pipeliner's stacked bottleneck arrays (cost.PIPELINED_SIGMA)
        "pipeliner": pipeliner,
        # the double-buffered layer scan's extra stacked array (cost.SCAN_DOUBLE_BUFFER)
        "double_buffer": double_buffer,
    }
    kept = memory["weights"] + memory["gathered"] + memory["activations"] + memory["pipeline"]
    # Under stage remat a tick's backward first re-runs one chunk of L/(S V) layers, which keep what
    # the layer policy keeps, then runs their backward one layer at a time.
    # The tick loop's backward also holds each replica's float32 stage-gradient accumulator (under stage
    # remat with FSDP, and one tick's stage weight gradient before it is added).
    stage_copy = cost.STAGE_COPY * summary.kept_none if policy == "none" and per_tick > 1 else 0.0
    working = accumulator + (per_tick * summary.saved + summary.working + stage_copy if staged else summary.working)
    memory["transient"] = max(loss, working, params * cost.OPTIMIZER_TEMP - kept)
    arguments = params * (cost.ADAM_STATE_BYTES - cost.STATE_BYTES)  # parameters, Adam m and v
    # XLA's packing: tight on a step with one kind of parallelism, looser where several meet
    mixed = sum(n > 1 for n in (stages, mesh.data * mesh.fsdp, mesh.context, mesh.tensor)) > 1
    overhead = cost.buffer_overhead(gpu, mixed)
    memory["allocator"] = (overhead - 1) * (sum(memory.values()) - arguments)
    memory["total"] = sum(memory.values())
    return memory


def link_bytes_per_step(
    pr: Pricer, grad_accum: int, summary: LayerSummary, sched: Schedule, colls: StepCollectives
) -> dict:
    """Bytes on each GPU's links per step ({"intra", "inter"} node), recomputed collectives included."""
    links = {k: v * sched.executed for k, v in summary.tensor_links.items()}
    for c, times in colls.counted:
        where = "inter" if pr.cluster.spans_nodes(c.stride, c.size) else "intra"
        links[where] += times * cost.link_bytes(c.kind, cost.coll_bytes(c, pr.opts.act_bytes), c.size)
    return {k: grad_accum * v for k, v in links.items()}


def trainer_overrides(
    pr: Pricer, mesh: Mesh, grad_accum: int, layer: Layer, sched: Schedule
) -> tuple[str, str, bool, str]:
    """(runnable status, strategy, sequence_parallel, the trainer's --config overrides that run the plan)."""
    ctx, opts, block, stages = pr.ctx, pr.opts, pr.ctx.block, sched.stages
    status, strategy, sp = runnable(block, mesh, layer)
    from boost_jax.parallel.strategies import registered  # lazy: imports jax; not at the planner's import

    if status == "yes" and ctx.context_kv == "bottleneck" and not registered(strategy).keeps_whole_rank:
        status, strategy, sp = (
            (
                f"no: context_kv=bottleneck rebuilds K/V from the whole r-wide activations, which "
                f"{strategy} splits over tensor"
            ),
            "",
            False,
        )
    context = ""
    if mesh.context > 1:
        context = (
            f"--config.parallel.context={mesh.context} --config.parallel.context_attention="
            f"{ctx.context_attention} --config.parallel.context_kv={ctx.context_kv} "
        )
    flags = ""
    if status == "yes":
        flags = (
            (
                f"--config.parallel.pipeline={stages} --config.parallel.microbatches={sched.microbatches} "
                if stages > 1
                else ""
            )
            + (
                f"--config.parallel.pipeline_schedule=circular --config.parallel.pipeline_repeats={sched.repeats} "
                if sched.name == "circular"
                else ""
            )
            + ("--config.parallel.pipeline_schedule=1f1b " if sched.f1b else "")
            + (f"--config.parallel.pipeline_repeats={sched.repeats} " if sched.f1b and sched.repeats > 1 else "")
            + f"--config.parallel.data={mesh.data} --config.parallel.fsdp={mesh.fsdp} "
            + context
            + f"--config.parallel.tensor={mesh.tensor} --config.parallel.strategy={strategy} "
            + ("--config.parallel.sequence_parallel=true " if sp else "")
            + (
                f"--config.parallel.linear_partition={linear_partition(layer)} "
                if partitions.ST in layer.choices
                else ""
            )
            + (f"--config.model.attention={opts.attention} " if opts.attention != "auto" else "")
            + f"--config.train.global_batch={opts.batch} --config.train.grad_accum={grad_accum} "
            f"--config.train.seq_len={opts.seq} "
            + (f"--config.model.max_seq_len={opts.seq} " if opts.seq > block.max_seq_len else "")
            + f"--config.remat.policy={pr.policy} --config.model.scan_unroll=false"
            + (" --config.remat.pipeline=stage" if sched.staged else "")
        )
    return status, strategy, sp, flags


def price_plan(
    pr: Pricer,
    mesh: Mesh,
    grad_accum: int,
    layer: Layer,
    flops_per_token: float,
    microbatches: int = 1,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_remat: str = "none",
) -> Plan:
    """Price a whole plan: L identical layers (pipelined: V M + S - 1 ticks of L/(S V) layers per
    stage, V = 1 for GPipe; `stage_remat` "stage" re-runs each stage's forward in the backward),
    embedding and head, data/fsdp traffic, stage hand-overs, optimizer: its time (`step_seconds`),
    memory (`memory_bytes`), link bytes and the trainer's overrides."""
    ctx, block = pr.ctx, pr.ctx.block
    summary = layer_summary(pr, layer)
    sched = schedule_of(block.layers, mesh.pipeline, microbatches, schedule, repeats, stage_remat)
    if sched.staged:
        stage_forward(pr, summary)
    rest, rest_cost = rest_ops(pr, layer.residual, sched.microbatches)
    rest_fsdp_weights = sum(op.weights for op in rest) - block.d  # the final norm is not fsdp-sharded
    colls = step_collectives(pr, mesh, grad_accum, layer, summary, sched, rest, rest_fsdp_weights)
    params = parameters_per_device(mesh, summary, sched, rest_fsdp_weights, block.d)
    step_s, exposed, optimizer_s = step_seconds(pr, grad_accum, summary, sched, colls, rest_cost, params)
    memory = memory_bytes(pr, mesh, grad_accum, layer, summary, sched, params, rest_fsdp_weights)
    links = link_bytes_per_step(pr, grad_accum, summary, sched, colls)
    status, strategy, sp, flags = trainer_overrides(pr, mesh, grad_accum, layer, sched)
    tokens = pr.opts.batch * pr.opts.seq
    return Plan(
        mesh=mesh,
        grad_accum=grad_accum,
        remat=pr.policy,
        layer=layer,
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        mfu=flops_per_token * tokens / (step_s * mesh.devices * pr.cluster.peak_flops),
        memory=memory,
        link_bytes=links,
        layer_cost=summary.cost,
        rest_cost=rest_cost,
        exposed_dp_s=exposed,
        optimizer_s=optimizer_s,
        layer_colls=summary.tensor_colls + colls.data_once + colls.data,
        redo_colls=summary.recomputed,
        rest_colls=[c for c, _ in colls.rest] + colls.data_rest,
        tokens=ctx.tokens,
        runnable=status,
        strategy=strategy,
        sequence_parallel=sp,
        overrides=flags,
        microbatches=sched.microbatches,
        bubble=cost.bubble_fraction(sched.stages, sched.microbatches, sched.repeats),
        shift_s=colls.shift_seconds,
        pipeline_colls=colls.shift,
        step_colls=[(c, sched.executed) for c in summary.tensor_colls + summary.recomputed] + colls.counted,
        schedule=sched.name,
        repeats=sched.repeats,
        stage_remat=sched.stage_remat,
        context_attention=ctx.context_attention if mesh.context > 1 else "",
        context_kv=ctx.context_kv if mesh.context > 1 else "",
    )


# ---------------------------------------------------------------- enumeration


def meshes(devices: int, stages=(1,), contexts=(1,)):
    """Every pipeline x data x fsdp x context x tensor factorisation with pipeline in `stages` and
    context in `contexts` (context > 1 unpipelined: see context_sizes). The pipeline axis is
    outermost (boost_jax.parallel.mesh.AXES): its groups are the ones that cross nodes first."""
    for pp in stages:
        for cp in contexts:
            if devices % (pp * cp) or (cp > 1 and pp > 1):
                continue
            rest = devices // (pp * cp)
            for t in _divisors(rest):
                for f in _divisors(rest // t):
                    yield Mesh(rest // (t * f), f, t, pp, cp)


def context_sizes(devices: int, seq: int, opts: Options, attention: str) -> list[int]:
    """parallel.context sizes to search: 1 and every divisor C of the device count that splits seq
    into 2C equal chunks (boost_jax/parallel/mesh.py check_context), or opts.context (each checked:
    a size that does not split seq is a one-line error naming --context). With C = 1 in the search,
    `search` prices a context plan only where its micro-batch's rows per batch shard do not split C
    ways: otherwise the same mesh with `context` folded into `data` runs the same tokens per device
    (the same GEMMs, activations and causal attention work, states replicated alike) without the
    exchange, and under a fused attention the trainer cannot use under context. Context earns its
    place where the rows run out: long sequences, few of them per step. Context needs an attention
    implementation with a block form (`auto` runs chunked there); pipelined plans run without it here
    (the comm report, which --verify compiles with, runs context without a pipeline)."""
    from boost_jax.model.attention import names, takes_context  # lazy: imports jax; not at the planner's import

    for c in opts.context:
        if c < 1 or devices % c:
            raise ValueError(f"--context: {c} does not divide --devices {devices}")
        if c > 1 and seq % (2 * c):
            raise ValueError(
                f"--context: {c} devices hold 2 of {2 * c} equal chunks of each row, which --seq {seq} "
                f"does not split into; use a C with seq a multiple of 2C"
            )
        if c > 1 and not takes_context(attention):
            raise ValueError(
                f"--context: --attention {attention} cannot run with the sequence split over context; use "
                f"one of {tuple(n for n in names() if takes_context(n))}"
            )
    if opts.context:
        return sorted(set(opts.context))
    if not takes_context(attention):
        return [1]
    return [c for c in _divisors(devices) if c == 1 or seq % (2 * c) == 0]


def context_modes(block: partitions.Block, context: int, opts: Options) -> list[tuple[str, str]]:
    """(parallel.context_attention, parallel.context_kv) to search at this context size: each
    attention mode, with bottleneck K/V where the kind has a bottleneck. ("ring", "full") alone at
    C = 1, where neither applies."""
    if context == 1:
        return [("ring", "full")]
    bad = [x for x in opts.context_attention if x not in CONTEXT_ATTENTION] + [
        x for x in opts.context_kv if x not in CONTEXT_KV
    ]
    if bad:
        raise ValueError(f"--context-attention / --context-kv: {bad} not in {CONTEXT_ATTENTION} / {CONTEXT_KV}")
    return [(a, kv) for a in opts.context_attention for kv in opts.context_kv if kv == "full" or block.factored]


def stage_counts(devices: int, layers: int, opts: Options) -> list[int]:
    """Pipeline sizes: divisors of the device count that split the layers evenly (the trainer's GPipe
    cuts the stack into equal stages), restricted to opts.pipeline when given."""
    out = [s for s in _divisors(devices) if layers % s == 0 and (not opts.pipeline or s in opts.pipeline)]
    if not out:
        raise ValueError(
            f"--pipeline: none of {list(opts.pipeline) or 'the sizes'} divides both --devices "
            f"{devices} and the model's {layers} layers"
        )
    return out


def microbatch_counts(stages: int, rows: int, opts: Options) -> list[int]:
    """GPipe micro-batches per pass that split `rows` (sequences per data x fsdp shard of one
    accumulation micro-batch) evenly: S, 2S, 4S (and for 1f1b 8S, 16S) or opts.microbatches. 1 without
    pipelining."""
    if stages == 1:
        return [1]
    deep = MICROBATCHES_PER_STAGE_1F1B if "1f1b" in opts.schedules else ()
    wanted = [opts.microbatches] if opts.microbatches else [k * stages for k in MICROBATCHES_PER_STAGE + deep]
    return [m for m in wanted if rows % m == 0]


def pipeline_variants(layers: int, stages: int, microbatches: int, opts: Options) -> list[tuple[str, int, str]]:
    """(schedule, repeats V, remat.pipeline) to search on `stages` stages: gpipe, and circular with
    every V > 1 dividing the L/S layers per stage (or opts.repeats) where M >= S, 1f1b with V 1 and
    those V where S divides M, each with and without stage remat (as opts allow); at the M searched for
    1f1b alone (more than 4S), 1f1b with V 1 only. Unpipelined: [("gpipe", 1, "none")]."""
    if stages == 1:
        return [("gpipe", 1, "none")]
    bad = [x for x in opts.schedules if x not in cost.PIPELINE_SCHEDULES] + [
        x for x in opts.stage_remat if x not in cost.STAGE_REMAT
    ]
    if bad:
        raise ValueError(f"--schedule / --stage-remat: {bad} not in {cost.PIPELINE_SCHEDULES} / {cost.STAGE_REMAT}")
    out = []
    per_stage = layers // stages
    deep = not opts.microbatches and microbatches > MICROBATCHES_PER_STAGE[-1] * stages  # searched for 1f1b only
    for schedule in opts.schedules:
        if deep and schedule != "1f1b":
            continue
        if schedule == "gpipe":
            reps = [1]
        elif microbatches < stages:
            reps = []
        else:
            reps = [opts.repeats] if opts.repeats else [v for v in _divisors(per_stage) if v > 1]
            reps = [v for v in reps if v > 1 and per_stage % v == 0]
        if schedule == "1f1b":  # V = 1, and interleaved (V > 1) where the micro-batches go in groups of S
            # (not at the deep M: its bubble is at most 1/9 there, and interleaving costs V x the hand-overs)
            reps = ([1] if opts.repeats in (0, 1) else []) + [
                v for v in reps if microbatches % stages == 0 and not deep
            ]
        out += [(schedule, v, staged) for v in reps for staged in opts.stage_remat]
    return out


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def policies(block: partitions.Block, opts: Options) -> list[str]:
    priced = cost.remat_policies()
    bad = [p for p in opts.remat if p not in priced]
    if bad:
        raise ValueError(f"--remat: {bad} not in {priced}")
    # `lowrank` keeps the bottleneck activations: only factorised models have them.
    return [p for p in opts.remat or priced if block.factored or p != "lowrank"]


def model_flops_per_token(cfg, seq: int) -> float:
    from boost_jax.model.transformer import flops_per_token  # lazy: imports jax; keep it off the search path

    return flops_per_token(cfg.model, seq, training=True)


def plan_attention(opts: Options, block: partitions.Block, context: int) -> str:
    """The attention cost class a plan at this context size runs: opts.attention's
    (cost.attention_kind), under context as it runs there (model/attention/registry.py under_context)."""
    from boost_jax.model.attention import under_context  # lazy: imports jax; once per search

    return cost.attention_kind(
        under_context(opts.attention) if context > 1 else opts.attention, block, opts.seq, opts.act_bytes
    )


def plan_for(
    cfg,
    cluster: Cluster,
    mesh: Mesh,
    grad_accum: int,
    remat: str,
    layer: Layer,
    opts: Options,
    flops_per_token: float | None = None,
    microbatches: int = 0,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_remat: str = "none",
    context_attention: str = "ring",
    context_kv: str = "full",
) -> Plan:
    """Price one given plan (no search), e.g. a trainer strategy: see partitions.uniform_plan.
    `microbatches`: micro-batches per pass when mesh.pipeline > 1 (0: the trainer's 2S); `schedule`,
    `repeats`, `stage_remat`: parallel.pipeline_schedule, parallel.pipeline_repeats, remat.pipeline;
    `context_attention`, `context_kv`: parallel.context_attention / context_kv when mesh.context > 1."""
    block = partitions.Block.from_config(cfg, vmapped=mesh.pipeline > 1 or mesh.data > 1)
    opts = dataclasses.replace(
        opts,
        pipelined=cost.pipeliner(opts.pipelined),  # read once, not per plan
        double_buffered=cost.double_buffering(opts.double_buffered),
    )
    _RUNNABLE.clear()
    _CHOICES.clear()
    stages = mesh.pipeline
    m = (microbatches or 2 * stages) if stages > 1 else 1
    if block.layers % stages:
        raise ValueError(f"{stages} pipeline stages do not divide the model's {block.layers} layers")
    check_pipeline(block.layers, stages, m, schedule, repeats, stage_remat)
    context_sizes(mesh.devices, opts.seq, dataclasses.replace(opts, context=(mesh.context,)), opts.attention)
    if (context_attention, context_kv) not in context_modes(
        block, mesh.context, dataclasses.replace(opts, context_attention=(context_attention,), context_kv=(context_kv,))
    ) and mesh.context > 1:
        raise ValueError(
            f"--context-kv: bottleneck passes the r-wide activations of a factored kind; "
            f"model.linear={cfg.model.linear} has none"
        )
    micro = opts.batch // grad_accum // (mesh.data * mesh.fsdp * m)
    if micro * grad_accum * mesh.data * mesh.fsdp * m != opts.batch:
        raise ValueError(
            f"--batch {opts.batch} does not split into {grad_accum} micro-batches of {m} pipeline "
            f"micro-batches over data x fsdp = {mesh.data * mesh.fsdp}"
        )
    kind = plan_attention(opts, block, mesh.context)
    pr = Pricer(
        partitions.Ctx(
            block,
            mesh.tensor,
            micro * opts.seq // mesh.context,
            opts.seq,
            mesh.fsdp == mesh.tensor and mesh.context == 1,
            kind,
            opts.act_bytes,
            mesh.context,
            context_attention,
            context_kv,
        ),
        cluster,
        remat,
        opts,
    )
    fpt = flops_per_token if flops_per_token is not None else model_flops_per_token(cfg, opts.seq)
    return price_plan(pr, mesh, grad_accum, layer, fpt, m, schedule, repeats, stage_remat)


def check_pipeline(layers: int, stages: int, microbatches: int, schedule: str, repeats: int, stage_remat: str):
    """The trainer's rules for a pipeline schedule (boost_jax/config/checks.py, parallel/mesh.py), as ValueError."""
    if schedule not in cost.PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {cost.PIPELINE_SCHEDULES}")
    if stage_remat not in cost.STAGE_REMAT:
        raise ValueError(f"remat.pipeline {stage_remat!r} is not one of {cost.STAGE_REMAT}")
    if stages == 1:
        if stage_remat != "none" or repeats != 1 or schedule != "gpipe":
            raise ValueError("pipeline_schedule, pipeline_repeats and remat.pipeline=stage need pipeline > 1")
        return
    if repeats < 1 or (schedule == "gpipe" and repeats != 1):
        raise ValueError(f"{repeats} chunks per stage need the circular or 1f1b schedule (gpipe holds one)")
    if schedule == "1f1b" and repeats > 1:
        if layers % (stages * repeats):
            raise ValueError(f"pipeline_repeats {repeats} does not divide the {layers // stages} layers per stage")
        if microbatches % stages:
            raise ValueError(
                f"interleaved 1f1b runs the micro-batches in groups of {stages} stages ({microbatches} micro-batches)"
            )
    if schedule == "circular":
        if layers % (stages * repeats):
            raise ValueError(f"pipeline_repeats {repeats} does not divide the {layers // stages} layers per stage")
        if microbatches < stages:
            raise ValueError(
                f"the circular schedule needs at least one micro-batch per stage ({microbatches} < {stages})"
            )


def search(cfg, cluster: Cluster, devices: int, opts: Options, flops_per_token: float | None = None) -> Result:
    """The top plans for `devices` GPUs of `cluster` training `cfg` at opts.batch x opts.seq.

    Every plan of the space gets a lower bound on its step time first (`lower_bound`: its layers,
    embedding, head and optimizer, without the stage hand-overs and exposed data/fsdp traffic that
    only add); plans are then priced in full in the order of their bounds, and a plan whose bound
    exceeds both the opts.top-th best distinct plan found so far and (for a plan the trainer runs)
    the best runnable one cannot enter the result, so it is not priced (opts.prune; False prices
    every plan). The result is the same either way; `smallest` is the least memory among the plans
    priced, which is every plan when none fits (the case it explains)."""
    block = partitions.Block.from_config(cfg)
    vmapped_block = partitions.Block.from_config(cfg, vmapped=True)  # as a pipeline or data > 1 runs it
    opts = dataclasses.replace(
        opts,
        pipelined=cost.pipeliner(opts.pipelined),  # read once, not per plan
        double_buffered=cost.double_buffering(opts.double_buffered),
    )
    fpt = flops_per_token if flops_per_token is not None else model_flops_per_token(cfg, opts.seq)
    contexts = context_sizes(devices, opts.seq, opts, opts.attention)
    kinds = {c: plan_attention(opts, block, c) for c in contexts}
    start = time.perf_counter()
    _RUNNABLE.clear()
    _CHOICES.clear()
    pricers: dict = {}
    candidates = []  # (lower bound, index, pricer, mesh, accum, layer, micro, schedule, repeats, stage remat)
    for mesh in meshes(devices, stage_counts(devices, block.layers, opts), contexts):
        ways = mesh.data * mesh.fsdp
        grid = mesh.fsdp == mesh.tensor and mesh.context == 1
        kind = kinds[mesh.context]
        if any(
            not group_choices(partitions.Ctx(block, mesh.tensor, opts.seq, opts.seq, grid), g)
            for g in partitions.GROUPS
        ):
            continue  # no choice splits some group over this tensor size
        accums = [opts.grad_accum] if opts.grad_accum else _divisors(opts.batch)
        for accum in accums:
            if opts.batch % accum or (opts.batch // accum) % ways:
                continue
            rows = opts.batch // accum // ways
            if mesh.context > 1 and 1 in contexts and rows % mesh.context == 0:
                continue  # dominated: the mesh with C folded into data runs as many tokens per device unexchanged
            for micro in microbatch_counts(mesh.pipeline, rows, opts):
                tokens = rows // micro * opts.seq // mesh.context
                for policy, (attention, kv) in [
                    (p, a) for p in policies(block, opts) for a in context_modes(block, mesh.context, opts)
                ]:
                    vmapped = mesh.pipeline > 1 or mesh.data > 1
                    key = (mesh.tensor, tokens, policy, grid, mesh.context, attention, kv, vmapped)
                    if key not in pricers:
                        ctx = partitions.Ctx(
                            vmapped_block if vmapped else block,
                            mesh.tensor,
                            tokens,
                            opts.seq,
                            grid,
                            kind,
                            opts.act_bytes,
                            mesh.context,
                            attention,
                            kv,
                        )
                        pricers[key] = Pricer(ctx, cluster, policy, opts)
                    pr = pricers[key]
                    for layer in best_layers(pr, opts.keep):
                        for schedule, repeats, staged in pipeline_variants(block.layers, mesh.pipeline, micro, opts):
                            bound = (
                                lower_bound(pr, mesh, accum, layer, micro, schedule, repeats, staged)
                                if opts.prune
                                else 0.0
                            )
                            candidates.append(
                                (bound, len(candidates), pr, mesh, accum, layer, micro, schedule, repeats, staged)
                            )
    if opts.prune:
        candidates.sort(key=lambda c: (c[0], c[1]))
    plans, priced, rejected, smallest = [], 0, 0, None
    best: dict = {}  # distinct partitioning -> its fastest fitting plan's step
    kth = best_runnable_s = math.inf  # the opts.top-th distinct step; the fastest runnable step
    for bound, index, pr, mesh, accum, layer, micro, schedule, repeats, staged in candidates:
        if opts.prune and bound * (1 - 1e-9) > kth:
            if bound * (1 - 1e-9) > best_runnable_s:
                break  # sorted by bound: no later plan can enter the result either
            if runnable(block, mesh, layer)[0] != "yes":
                continue  # it can only be the best runnable plan, and it is not runnable
        plan = price_plan(pr, mesh, accum, layer, fpt, micro, schedule, repeats, staged)
        priced += 1
        if smallest is None or plan.memory["total"] < smallest.memory["total"]:
            smallest = plan
        if opts.check_memory and plan.memory["total"] > cluster.usable_hbm:
            rejected += 1
            continue
        plans.append((plan, index))
        if plan.runnable == "yes":
            best_runnable_s = min(best_runnable_s, plan.step_s)
        distinct = (plan.mesh, plan.layer, plan.context_attention, plan.context_kv)
        if plan.step_s < best.get(distinct, math.inf):
            best[distinct] = plan.step_s
            if plan.step_s < kth and len(best) >= opts.top:
                kth = heapq.nsmallest(opts.top, best.values())[-1]
    # Ties (data/fsdp-bound plans) go to what the trainer runs, then to the faster compute path, then to
    # the search order.
    plans = [
        p for p, _ in sorted(plans, key=lambda x: (x[0].step_s, x[0].runnable != "yes", x[0].layer_cost.total, x[1]))
    ]
    top, seen = [], set()
    for p in plans:  # distinct partitionings (and context modes), each at its best micro-batching and remat
        if (p.mesh, p.layer, p.context_attention, p.context_kv) not in seen:
            seen.add((p.mesh, p.layer, p.context_attention, p.context_kv))
            top.append(p)
        if len(top) == opts.top:
            break
    best_runnable = next((p for p in plans if p.runnable == "yes"), None)
    return Result(top, best_runnable, len(candidates), rejected, time.perf_counter() - start, smallest, priced)


def lower_bound(
    pr: Pricer,
    mesh: Mesh,
    grad_accum: int,
    layer: Layer,
    microbatches: int = 1,
    schedule: str = "gpipe",
    repeats: int = 1,
    stage_remat: str = "none",
) -> float:
    """A lower bound on price_plan(...).step_s, cheap to compute: the same layer passes, embedding,
    head and optimizer, without the stage hand-overs and the exposed data/fsdp traffic (both >= 0)."""
    b = pr.ctx.block
    stages = mesh.pipeline
    m = microbatches if stages > 1 else 1
    if stages == 1 or schedule == "gpipe":
        repeats = 1
    staged = stages > 1 and stage_remat == "stage"
    key = (layer, m, staged)
    if key not in pr._bounds:
        s = layer_summary(pr, layer)
        rest, rest_cost = rest_ops(pr, layer.residual, m)
        pr._bounds[key] = (
            s.cost.total + (stage_forward(pr, s).forward if staged else 0.0),
            s.fsdp_w + s.grid_w,
            s.norm_w,
            rest_cost.total,
            sum(op.weights for op in rest) - b.d,
        )
    layer_s, sharded_w, norm_w, rest_s, rest_fsdp_w = pr._bounds[key]
    per_stage = b.layers // stages
    runs = cost.pipeline_ticks(stages, m, repeats) * (per_stage // repeats)
    params = per_stage * (sharded_w / mesh.fsdp + norm_w) + rest_fsdp_w / mesh.fsdp + b.d
    return grad_accum * (runs * layer_s + rest_s) + params * cost.OPTIMIZER_TRAFFIC / pr.cluster.hbm_bandwidth
