"""What a partition choice *does* (hardware-free): the GEMMs, collectives and activations it implies.

A transformer block is priced as a small graph. Between operators an activation [M tokens, width]
lives on the `tensor` group (t devices) in one of these layouts:

    R  replicated            H  features split t ways      S  tokens split t ways
    P  partial sums still to be reduced (only ever an operator's output)

Operators are the four projection groups (qkv, o, mlp_in, mlp_out), the attention and
MLP-activation cores (run in whatever layout they are fed) and the RMSNorms. Edges between operators
redistribute the activation when layouts differ. A group's partition choice is what a registered
strategy's rule table does to it (`Split`: which stage splits which dim over `tensor`, read from the
table through `spec_for`, as the trainer lays the weights out; see `strategy_layers`), named after the
first registered strategy that does it, or the spatial-temporal choice `st`.
Everything is per device and per micro-batch; M is the micro-batch's tokens on one tensor group.

The spatial-temporal choice (`st`, PrimePar's P(n x n)) runs on the grid the trainer uses
(boost_jax/model/linear.py): the `fsdp` x `tensor` axes with fsdp == tensor = n. The grid's rows
are the fsdp shards of the batch, so its tokens are the M of one tensor group and its activations
enter and leave in H; its weights stay split over both axes (never gathered by FSDP).
Element counts follow boost_jax.tools.comm_report: all-reduce / reduce-scatter / all-to-all /
collective-permute count their operand, all-gather its result.
"""

from __future__ import annotations

import dataclasses
import types

from boost_jax.config import PROJECTION_GROUPS as GROUPS  # noqa: F401 - the trainer's group names
from boost_jax.config import ST
from boost_jax.errors import ConfigError
from boost_jax.model.kinds import kind_class

# Arrays each operator keeps for the backward without remat, as counted in the compiled train step's
# buffer assignment (XLA's memory-usage report of the scanned layer's stacked residuals; float32 on
# emulated CPU devices, btp / megatron / vanilla / st, dense / lowrank / cola; tests/test_planner.py
# checks the totals against memory_analysis()):
SAVED_NORM = (1, 2)  # RMSNorm: (compute dtype, float32) arrays of its width: output; input and x/rms in fp32
SAVED_SIGMA = 4  # a nonlinear bottleneck σ(A·x): A's output, σ's internals and its output, per A output
SAVED_LINEAR = 1  # an identity bottleneck (lowrank): A's output
SAVED_ONLINE_NORM = 2  # more arrays of the A output when the norm statistics ride in its all-reduce
# (what attention keeps: its cost class's counts, boost_jax/model/attention/registry.py CostClass)
SAVED_SWIGLU = (6, 3)  # the MLP core: arrays of width ff, silu(gate)·up / gate·up (gate, up, products)
# The same counted in the GPU program (a bf16/fp16 step compiled for H100s without them,
# boost_jax/tools/aot.py with XLA_FLAGS=--xla_dump_to: the distinct stacked residuals of its scanned layer
# in XLA's buffer assignment, benchmarks/RESULTS.md 2026-11-27 (fifth)). The fused norm kernels
# (kernels.rmsnorm=pallas or triton) keep their input and output in the compute dtype, no float32 copy:
# llama_7b megatron on tensor 8 stacks bf16[L, T, d] x 4 for the two norms (the attention output's
# [T, q/t] view beside them is attention's, its cost class's `kept`). BTP's online norm keeps its A
# outputs twice more in float32 (they ride the all-reduce with the float32 statistics). SAVED_SIGMA is
# what the GPU program keeps too.
GPU_SAVED_NORM = (2, 0)
# XLA's norm (kernels.rmsnorm=xla, the default) keeps two float32 arrays of its local width (its input
# and x/rms) besides its output, per layout (the recipe plans of benchmarks/aot_fit.py compiled for H100s
# and A100s, for the two norms of a layer): replicated, llama_1b fsdp 8 bf16[T, d] x 3 (one of them
# attention's output view) and f32[T, d] x 4; tokens split (sequence parallel, then gathered for the
# GEMMs), llama_7b megatron-SP p4 x f8 x t2 bf16[T/t, d] x 2 and f32[T/t, d] x 4 and no gathered
# bf16[T, d] (its backward gathers again); features split (BTP's H), cola_1b btp p2 x d4 x f4 x t2
# bf16[T, d/t] x 4 (one of them attention's output view) and f32[T, d/t] x 4 (cola_7b f16 x t4 the
# same f32 arrays).
GPU_SAVED_NORM_XLA = {"R": (1, 2), "S": (1, 2), "H": (1.5, 2)}
GPU_SAVED_ONLINE_NORM32 = 2  # float32 arrays of the A output
# The MLP core in the GPU program: llama_1b on 1 H100 (pallas norm) stacks bf16[L, T, ff] x 5 beside the
# double-buffer copy of a sixth (cost.SCAN_DOUBLE_BUFFER), llama_7b megatron on tensor 8 bf16[L, T, ff/8]
# x 5 and the copy. cola's gate·up keeps 2: cola_1b on 1 H100 stacks 3 distinct bf16[L, T, ff] buffers with
# the copy (a fourth shares its slot with the loss's arrays).
GPU_SAVED_SWIGLU = (5, 2)
# The context ring's backward (remat none) holds score blocks of its remote blocks beyond what the
# one-device backward does: FITTED 2.75 float32 [rows, heads, L, block] arrays (the bytes the compiled
# btp step held beyond the planner's count: d 256, seq 1024, 2 rows, tensor 2 x context 2, ring, full
# K/V; float32, chunked) take the predicted peak from 0.88 to 0.95 of memory_analysis; held out: ring
# with bottleneck K/V, 0.85 to 0.94 (tests/test_planner_context.py).
RING_SCORE_BLOCKS = 2.75
# The groups a norm feeds (the first of each residual segment): their norm's statistics may ride in
# a row-parallel first stage's all-reduce (online RMSNorm).
NORMED = ("qkv", "mlp_in")


@dataclasses.dataclass(frozen=True)
class Block:
    """The shapes of one transformer block (and what surrounds the stack)."""

    d: int
    ff: int
    heads: int
    kv_heads: int
    head_dim: int
    rank: int
    vocab: int
    layers: int
    factored: bool  # a bottleneck kind (B·σ(A·x); tt's reconstructed halves) rather than dense
    only_lr_act: bool
    online_norm: bool
    nonlinear: bool = False  # σ at the bottleneck is a nonlinearity (cola; tt with silu)
    loss_chunk: int = 0  # model.loss_chunk: positions per chunk of the head + loss (0: one piece)
    fused_norm: bool = False  # kernels.rmsnorm is a fused kernel (not XLA's norm)
    max_seq_len: int = 0  # model.max_seq_len: a plan at a longer train.seq_len raises it in its flags

    @classmethod
    def from_config(cls, cfg, vmapped: bool = False) -> Block:
        """The model of `cfg`; `vmapped`: on a mesh where the trainer vmaps it (pipeline or data > 1),
        which decides the norm kernel `auto` picks."""
        m = cfg.model
        kind = kind_class(m.linear)
        if kind.has_extra:  # e.g. sltrain's sparse S·x: a term with its own traffic, not priced yet
            raise ConfigError(
                f"config field `model.linear`: the planner does not price {m.linear}'s extra "
                f"term; plan the low-rank twin (--config.model.linear=lowrank) and add S's traffic "
                f"from `python -m boost_jax.tools.comm_report`"
            )
        return cls(
            d=int(m.d_model),
            ff=int(m.d_ff),
            heads=int(m.n_heads),
            kv_heads=int(m.n_kv_heads),
            head_dim=int(m.d_model) // int(m.n_heads),
            rank=int(m.rank),
            vocab=int(m.vocab_size),
            layers=int(m.n_layers),
            factored=kind.factored,
            only_lr_act=bool(m.only_lr_act) and kind.nonlinear(m),
            online_norm=bool(cfg.parallel.online_norm),
            nonlinear=kind.factored and kind.nonlinear(m),
            loss_chunk=int(m.loss_chunk),
            # `auto` is a fused kernel on the GPUs a plan is priced for, XLA's where the model is vmapped
            # (model/autos.py)
            fused_norm=cfg.kernels.rmsnorm != "xla" and not (cfg.kernels.rmsnorm == "auto" and vmapped),
            max_seq_len=int(m.max_seq_len),
        )

    def projections(self, group: str) -> tuple[int, tuple[int, ...]]:
        """(shared input width, output widths) of a projection group."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "qkv": (self.d, (q, kv, kv)),
            "o": (q, (self.d,)),
            "mlp_in": (self.d, (self.ff, self.ff)),
            "mlp_out": (self.ff, (self.d,)),
        }[group]


@dataclasses.dataclass(frozen=True)
class Coll:
    kind: str  # all-reduce | all-gather | reduce-scatter | all-to-all | collective-permute
    elements: float  # payload per device (see the module docstring)
    size: int  # devices in the group
    stride: int  # device-id distance between group members: decides intra- or inter-node link
    phase: str  # fwd | bwd
    # tensor, pipeline, grid (activations, compute dtype; grid: st's permutes over fsdp, weights cast
    # before they move), context (the attention's K/V exchange over the sequence split) | data_fsdp
    # (parameters/gradients, fp32)
    axis: str = "tensor"
    saved: bool = False  # its result is what low-rank checkpointing keeps: never recomputed
    float32: bool = False  # sent in float32 whatever the compute dtype (the context ring's dK/dV)


@dataclasses.dataclass(frozen=True)
class Gemm:
    m: float
    k: float
    n: float
    tag: str  # A (first stage), B (second stage), W (dense), head


@dataclasses.dataclass(frozen=True)
class StMatmul:
    """P(n x n) on [m, k] @ [k, out] on the (fsdp, tensor) grid, m = this device's tokens (its fsdp
    shard of the batch): n steps of local (m, k/n, out/n) GEMMs and one-hop permutes, as
    boost_jax.parallel.spatial_temporal.st_matmul runs them, plus the trainer's skews: the input's
    (along the row) and the weight's one hop from its stored layout (dW hops back). `shared`: another
    projection reads the same input, and XLA merges the input's identical moves (its skew, its
    forward row hops and its dW-phase diagonal hops, none of which depend on the weight), so they
    appear with zero elements here."""

    m: float
    k: float
    out: float
    n: int
    tag: str
    shared: bool = False

    def colls(self) -> list[Coll]:
        n = self.n
        i, w, o = self.m * self.k / n, self.k * self.out / (n * n), self.m * self.out / n
        dx, i = i, 0.0 if self.shared else i  # dI is still every projection's own

        def cp(elements, phase, ring):  # ring: (size, stride) of the devices it cycles through
            # Row moves stay on the tensor axis; the rest crosses fsdp too ("grid").
            return Coll("collective-permute", elements, *ring, phase, "tensor" if ring == row else "grid")

        row, col, grid = (n, 1), (n, n), (n * n, 1)  # row: tensor; column: fsdp (stride = tensor size)
        out = [cp(i, "fwd", row), cp(w, "fwd", grid)]  # skew I (within its row) and W
        for _ in range(n - 1):
            out += [
                cp(i, "fwd", row),
                cp(w, "fwd", col),  # forward: I along rows, W along columns
                cp(o, "bwd", row),
                cp(w, "bwd", grid),  # dI phase: dO along rows, W diagonally
                cp(o, "bwd", col),
                cp(i, "bwd", grid),
            ]  # dW phase: dO along columns, I diagonally
        return out + [cp(dx, "bwd", row), cp(w, "bwd", grid)]  # unskew dI, dW back to its stored layout

    def ring(self) -> float:
        """Elements of the received blocks its backward holds besides the saved ones: each of the n-1
        steps receives two of the three operands (dI phase: dO and W; dW phase: dO and I), and the
        unrolled schedule keeps the copies apart. FITTED: half of the n-1 copies of all three puts
        the compiled all-st step under remat=full on its memory_analysis (benchmarks/planner_memory.py)."""
        n = self.n
        return (n - 1) * (self.m * self.k / n + self.m * self.out / n + self.k * self.out / (n * n)) / 2


@dataclasses.dataclass(frozen=True)
class Attn:
    queries: float  # query tokens on this device
    keys: int  # keys each query attends (the sequence; causal masking halves the useful work)
    heads: float  # heads on this device
    head_dim: int
    imbalance: float  # busiest / mean device work under a causal mask (token splits)


@dataclasses.dataclass
class Op:
    name: str
    gemms: list = dataclasses.field(default_factory=list)
    st: list = dataclasses.field(default_factory=list)
    colls: list = dataclasses.field(default_factory=list)
    attn: Attn | None = None
    acts: float = 0.0  # activation elements produced in the forward (this device, micro-batch)
    # Kept for the backward without remat (this device, micro-batch), in the compute dtype and in
    # float32 (norm statistics and inputs, attention scores): the arrays the compiled step keeps,
    # counted per operator from its memory report (see SAVED_* below and tests/test_planner.py).
    saved: float = 0.0
    saved32: float = 0.0
    saved_lowrank: float = 0.0  # what the `lowrank` remat policy keeps (compute dtype)
    weights: float = 0.0  # parameter elements on this device after the tensor split (before fsdp)
    grid_weights: float = 0.0  # the same for st's weights, which stay fsdp-split (never gathered)
    recompute: bool = True  # False: its output is the layer's output, which no remat policy redoes
    ring: float = 0.0  # compute-dtype elements its backward holds beyond the saved ones (st's ring copies; the
    # context ring's blocks in flight, its float32 dK/dV and score blocks)
    gemm_passes: float = 3.0  # forward GEMM times the op costs: forward + backward (2x), + a recompute
    # the GEMMs a remat policy's forward re-run redoes, where `gemms` lists forward and backward ones
    # one by one (gemm_passes 1: the bottleneck's K/V rebuilds); None: `gemms`
    redo_gemms: list | None = None
    # A output elements a nonlinear bottleneck σ(A·x) keeps for the backward (this device, micro-batch;
    # what cost.PIPELINED_SIGMA counts more arrays of)
    bottleneck: float = 0.0

    def all_colls(self) -> list[Coll]:
        return self.colls + [c for s in self.st for c in s.colls()]


@dataclasses.dataclass(frozen=True)
class Ctx:
    block: Block
    t: int  # tensor-parallel size
    tokens: float  # M: tokens of a micro-batch on one tensor group
    seq: int
    grid: bool = False  # fsdp == tensor: the (fsdp, tensor) axes form st's n x n grid (n = t)
    attention: str = "materialized"  # how attention runs: its cost class (see cost.attention_kind)
    act_bytes: int = 2  # bytes per compute-dtype element
    # parallel.context = C: the sequence split over C devices (boost_jax/parallel/context.py). `tokens`
    # are then one context shard's (rows x seq / C); attention meets the whole row through
    # parallel.context_attention (ring | all_gather) exchanging K/V or (context_kv=bottleneck) the
    # r-wide bottleneck activations.
    context: int = 1
    context_attention: str = "ring"
    context_kv: str = "full"

    @property
    def local_seq(self) -> int:
        """Positions of a row on one device of `context`."""
        return self.seq // self.context

    @property
    def n(self) -> int:
        """Side of the st grid (0 when the mesh has none)."""
        return self.t if self.grid and self.t > 1 else 0

    def splits(self, layout: str) -> tuple[int, int]:
        """(feature split, token split) of a layout."""
        return {"R": (1, 1), "P": (1, 1), "H": (self.t, 1), "S": (1, self.t)}[layout]

    def local(self, layout: str, width: float) -> float:
        fs, ts = self.splits(layout)
        return self.tokens * width / (fs * ts)


def layouts(ctx: Ctx) -> tuple[str, ...]:
    """The layouts an activation can take on this tensor size (token splits cut each sequence)."""
    if ctx.t == 1:
        return ("R",)
    return ("R", "H") + (("S",) if ctx.local_seq % ctx.t == 0 else ())


def _divides(t: int, *xs: int) -> bool:
    return all(x % t == 0 for x in xs)


# ---------------------------------------------------------------- edges and norms


def edge(
    ctx: Ctx,
    src: str,
    dst: str,
    width: int,
    partial_grad: bool = False,
    layer_output: bool = False,
    saves: bool = False,
) -> Op:
    """Redistribute a [M, width] activation from layout src to dst. The backward moves its gradient
    the other way; a replicated producer needs the whole gradient, so R -> split costs a gather there.
    `partial_grad`: the consumer (a column-parallel input, dst R) hands back partial input gradients,
    all-reduced into a replicated source or reduce-scattered into a split one (Megatron-SP)."""
    op = Op(f"{src}->{dst}", recompute=not layer_output)
    if ctx.t == 1:
        return op
    full, t = ctx.tokens * width, ctx.t
    if partial_grad:
        op.colls = [Coll("all-reduce" if src in ("R", "P") else "reduce-scatter", full, t, 1, "bwd")]
    if src == dst:
        return op
    if src == "P":
        if dst == "R":
            op.colls += [Coll("all-reduce", full, t, 1, "fwd")]
        else:
            op.colls += [Coll("reduce-scatter", full, t, 1, "fwd"), Coll("all-gather", full, t, 1, "bwd")]
    elif src == "R":
        op.colls += [Coll("all-gather", full, t, 1, "bwd")]
    elif dst == "R":
        op.colls += [Coll("all-gather", full, t, 1, "fwd")]
    else:  # between two split layouts: each device keeps its overlap, swaps the rest
        op.colls += [Coll("all-to-all", full / t, t, 1, "fwd"), Coll("all-to-all", full / t, t, 1, "bwd")]
    op.acts = ctx.local(dst, width)
    if saves and not (gpu(ctx) and not ctx.block.fused_norm):  # its output is a GEMM's input, kept for
        # the weight gradient (a normalised row gathered); with XLA's norm the GPU program keeps the
        # token shard instead (GPU_SAVED_NORM_XLA["S"])
        op.saved = op.acts
    return op


def gpu(ctx: Ctx) -> bool:
    """Whether the priced program is the GPU's: computed in bf16/fp16 (the CPU checks compile float32,
    as XLA:CPU runs bf16 partly in float32), so its kept arrays are the GPU_SAVED_* counts."""
    return ctx.act_bytes != 4


def norm(ctx: Ctx, layout: str, fused: bool) -> Op:
    """RMSNorm in `layout`. Split features need the sum of squares reduced over the feature group: a
    scalar per token, riding in the following A all-reduce when `fused` (BTP's online RMSNorm)."""
    fs, ts = ctx.splits(layout)
    width = ctx.local(layout, ctx.block.d)
    kept, kept32 = (
        (GPU_SAVED_NORM if ctx.block.fused_norm else GPU_SAVED_NORM_XLA.get(layout, GPU_SAVED_NORM))
        if gpu(ctx)
        else SAVED_NORM
    )
    op = Op(
        f"norm@{layout}",
        acts=width,
        weights=ctx.block.d / fs,
        saved=kept * width,
        saved32=kept32 * width + ctx.tokens / ts,
    )
    if fs > 1 and not fused:  # the statistics are kept by the lowrank policy: never recomputed
        op.colls = [Coll("all-reduce", ctx.tokens / ts, fs, 1, p, saved=p == "fwd") for p in ("fwd", "bwd")]
    return op


# ---------------------------------------------------------------- projection groups


@dataclasses.dataclass(frozen=True, order=True)
class Split:
    """What a layout splits of a projection group over `tensor`. A factored kind: `first` (A: "in" its
    input features, row-parallel, the r-wide partial products then reduced; "rank" its bottleneck
    columns) and `second` (B: "rank", row-parallel, output left partial; "out" its output features,
    column-parallel); "" splits nothing. A dense kind: `first` alone ("in" or "out"). `fused`: the
    norm in front sends its statistics with A's all-reduce (the strategy's online RMSNorm). GRID:
    the spatial-temporal P(n x n) on the (fsdp, tensor) grid."""

    first: str = ""
    second: str = ""
    fused: bool = False

    def layouts(self, factored: bool) -> tuple[str, str]:
        """(input layout, output layout) of the group."""
        if self == GRID:
            return "H", "H"
        inp = "H" if self.first == "in" else "R"
        if not factored:
            return inp, {"in": "P", "out": "H"}.get(self.first, "R")
        return inp, {"rank": "P", "out": "H"}.get(self.second, "R")

    def split_axes(self, group: str, factored: bool) -> list[str]:
        """The logical axes this split divides over `tensor` (see PROJECTION_AXES): "rank" for the
        bottleneck."""
        from boost_jax.model.transformer import PROJECTION_AXES  # imports jax: not at the planner's import

        in_axis, out_axes = PROJECTION_AXES[group]
        stage = {"in": [in_axis], "out": list(out_axes), "rank": ["rank"], "": []}
        return stage[self.first] + (stage[self.second] if factored else [])


NONE = Split()  # tensor 1: nothing is split
GRID = Split("grid", "grid")


@dataclasses.dataclass(frozen=True)
class TableLayer:
    """A registered strategy's layer in the planner's terms, read from its rule table: the residual
    stream's layout, each group's Split (None: the table gives the group no single layout, which is
    not priced), the layouts the attention and MLP activation run in."""

    name: str
    sequence_parallel: bool
    factored_only: bool
    residual: str
    splits: tuple
    attention: str
    act: str


_TABLES: dict = {}


def strategy_layers(factored: bool, online_norm: bool = True) -> tuple[TableLayer, ...]:
    """Every registered strategy (and its sequence-parallel table) as the planner prices it, in
    registry order, read from the rule tables with boost_jax.parallel.rules.spec_for on a mesh whose
    only split axis is `tensor`, the way the trainer lays out weights and pins activations. Sizes are
    left out (whether a mesh divides a split is the planner's check: `group_choices`, `layouts`).
    `online_norm`: parallel.online_norm, which the strategy's own flag must also allow."""
    from boost_jax.parallel import strategies  # imports jax: not at the planner's import

    registry = tuple(strategies.REGISTRY.values())
    if _TABLES.get("registry") != registry:  # a strategy was registered since: derive again
        _TABLES.clear()
        _TABLES["registry"] = registry
    key = (factored, online_norm)
    if key not in _TABLES:
        _TABLES[key] = tuple(_table_layer(e, sp, factored, online_norm) for e, sp in strategies.variants())
    return _TABLES[key]


def _table_layer(entry, sp: bool, factored: bool, online_norm: bool) -> TableLayer:
    from boost_jax.model.linear import RESIDUAL  # imports jax: memoised, off the DP's path
    from boost_jax.model.transformer import CORE_AXES, PROJECTION_AXES  # imports jax, as above
    from boost_jax.parallel.rules import spec_for  # imports jax: memoised, off the DP's path

    rules = entry.sequence_parallel if sp else entry.rules
    mesh = types.SimpleNamespace(shape={"pipeline": 1, "data": 1, "fsdp": 1, "tensor": 2})

    def split_dims(names) -> tuple[bool, ...]:
        spec = tuple(spec_for(names, (2,) * len(names), mesh, rules))
        return tuple(i < len(spec) and spec[i] is not None for i in range(len(names)))

    def layout(names) -> str:  # [batch, sequence, features]
        _, seq, features = split_dims(names)
        return "S" if seq else "H" if features else "R"

    def group_split(group: str) -> Split | None:
        in_axis, out_axes = PROJECTION_AXES[group]
        found = set()
        for out in out_axes:
            if not factored:
                d_in, d_out = split_dims((in_axis, out))
                found.add(Split("in" if d_in else "out" if d_out else ""))
                continue
            a_in, a_rank = split_dims((in_axis, "rank"))
            b_rank, b_out = split_dims(("rank", out))
            first = "in" if a_in else "rank" if a_rank else ""
            found.add(
                Split(
                    first,
                    "rank" if b_rank else "out" if b_out else "",
                    fused=first == "in" and group in NORMED and entry.online_norm and online_norm,
                )
            )
        return found.pop() if len(found) == 1 else None

    return TableLayer(
        entry.name,
        sp,
        entry.factored_only,
        layout(RESIDUAL),
        tuple(group_split(g) for g in GROUPS),
        layout(CORE_AXES["attention"]),
        layout(CORE_AXES["act"]),
    )


def group_choices(ctx: Ctx, group: str) -> list[tuple[str, str, str, Split]]:
    """(choice, input layout, output layout, split) that can run this group on this tensor size: what
    each registered strategy's table does to it (named after the first that does it), and st."""
    b, t = ctx.block, ctx.t
    if t == 1:
        return [("none", "R", "R", NONE)]
    din, douts = b.projections(group)
    heads = _divides(t, b.heads, b.kv_heads)
    sizes = {"in": (din,), "out": douts, "rank": (b.rank,), "": ()}
    out, seen = [], set()
    for table in strategy_layers(b.factored, b.online_norm):
        split = table.splits[GROUPS.index(group)]
        if split is None or split in seen or (table.factored_only and not b.factored):
            continue
        seen.add(split)
        if not _divides(t, *sizes[split.first], *(sizes[split.second] if b.factored else ())):
            continue
        if not heads and {"heads", "kv_heads"} & set(split.split_axes(group, b.factored)):
            continue
        out.append((table.name, *split.layouts(b.factored), split))
    n = ctx.n
    if n and (group not in ("qkv", "o") or heads) and _divides(n, din, *douts, *((b.rank,) if b.factored else ())):
        out.append((ST, "H", "H", GRID))
    return out


def partial_input_grad(block: Block, split: Split) -> bool:
    """Whether the group's input gradient comes out partial (its input is replicated and the GEMM
    reading it split along its output): reduced by the edge in front of it (see `edge`). A factored
    group whose A is whole has a complete input gradient (its B's input gradient is reduced)."""
    return split.first == "rank" or (split.first == "out" and not block.factored)


def group_op(ctx: Ctx, group: str, split: Split, fused_norm: bool = False) -> Op:
    """The work of one projection group under one split (see the BOOST notes for the row- and
    column-parallel stages and the PrimePar notes for st). `fused_norm`: a norm's statistics ride in
    the A all-reduce. Partial input gradients (partial_input_grad) are charged to the edge in front."""
    b, t, m = ctx.block, ctx.t, ctx.tokens
    din, douts = b.projections(group)
    g, r, dsum = len(douts), b.rank, sum(douts)
    op = Op(f"{group}:{split.first}/{split.second}")
    if split == GRID:  # every projection's GEMMs are P(n x n)s on the (fsdp, tensor) grid, one each
        n = ctx.n  # == t
        # Kept for the backward: each GEMM's skewed input and its output (and σ's input).
        if b.factored:
            op.st = [StMatmul(m, din, r, n, "A", shared=j > 0) for j in range(g)] + [
                StMatmul(m, r, o, n, "B") for o in douts
            ]
            op.acts, op.saved_lowrank = m * (g * din + 3 * g * r + dsum) / n, m * g * r / n
            op.grid_weights = (din * g * r + r * dsum) / n
        else:
            op.st = [StMatmul(m, din, o, n, "W", shared=j > 0) for j, o in enumerate(douts)]
            op.acts, op.grid_weights = m * (g * din + dsum) / n, din * dsum / n
        op.ring = sum(s.ring() for s in op.st)
        return _with_saved(op, b, False, gpu(ctx))
    first, second = split.first, split.second
    if not b.factored:  # one GEMM for the group: input features split (output partial), or output columns
        op.gemms = [Gemm(m, din / t if first == "in" else din, dsum / t if first == "out" else dsum, "W")]
        op.acts = m * dsum / t if first == "out" else m * dsum
        op.weights = din * dsum / t if first else din * dsum
        return _with_saved(op, b, False, gpu(ctx))
    fused = fused_norm and first == "in"
    stats = m if fused else 0
    op.gemms = [Gemm(m, din / t if first == "in" else din, g * r / t if first == "rank" else g * r, "A")] + [
        Gemm(m, r / t if second == "rank" else r, o / t if second == "out" else o, "B") for o in douts
    ]
    if first == "in" and second == "rank":  # the partial r-wide products land split over the rank
        op.colls = [
            Coll("reduce-scatter", m * g * r, t, 1, "fwd", saved=True),
            Coll("all-gather", m * g * r, t, 1, "bwd"),
        ]
    elif first == "in":  # the partial r-wide products (and the norm's statistics) all-reduced
        op.colls = [Coll("all-reduce", m * g * r + stats, t, 1, "fwd", saved=True)]
    if second == "out" and first != "rank":  # B's input gradient is partial over its output columns
        op.colls.append(Coll("all-reduce", m * g * r, t, 1, "bwd"))
    r_kept = g * r / t if first == "rank" or second == "rank" else g * r  # A's output on this device
    op.acts = m * (2 * r_kept + dsum / (t if second == "out" else 1))
    op.saved_lowrank = m * r_kept + stats
    op.weights = din * g * r / (t if first else 1) + r * dsum / (t if second else 1)
    op.ring = 0
    return _with_saved(op, b, fused, gpu(ctx))


def _with_saved(op: Op, b: Block, fused: bool, on_gpu: bool = False) -> Op:
    """Set what a projection group keeps for the backward: arrays of its first stages' outputs (the
    B outputs are kept by their consumers: attention, the MLP core, the residual add keeps none)."""
    if b.factored:
        a_out = sum(g.m * g.n for g in op.gemms if g.tag == "A") + sum(s.m * s.out / s.n for s in op.st if s.tag == "A")
        kept = SAVED_SIGMA if b.nonlinear else SAVED_LINEAR
        op.bottleneck = a_out if b.nonlinear else 0.0
        if on_gpu:
            op.saved = a_out * kept
            op.saved32 = a_out * GPU_SAVED_ONLINE_NORM32 if fused else 0.0
        else:
            op.saved = a_out * (kept + (SAVED_ONLINE_NORM if fused else 0))
    return op


_STORED: dict = {}


def stored_grid_axes(strategy: str, names: tuple[str, str], shape: tuple[int, int], n: int) -> tuple:
    """The mesh axes (fsdp / tensor / None) a strategy's rule table stores a weight's two dims over
    on an n x n (fsdp, tensor) grid (boost_jax.parallel.rules.spec_for on that table)."""
    key = (strategy, names, shape, n)
    if key not in _STORED:
        from boost_jax.parallel import strategies  # imports jax: memoised, off the DP's path
        from boost_jax.parallel.rules import spec_for  # imports jax: memoised, off the DP's path

        table = strategies.registered(strategy).rules
        mesh = types.SimpleNamespace(shape={"pipeline": 1, "data": 1, "fsdp": n, "tensor": n})
        spec = tuple(spec_for(names, shape, mesh, table))
        _STORED[key] = (spec + (None, None))[:2]
    return _STORED[key]


def st_stored(ctx: Ctx, group: str, strategy: str) -> tuple[list[Coll], float]:
    """What an st group costs beyond P(n x n) under `strategy`'s stored layouts: a weight stored
    whole along a grid axis (e.g. megatron's factored A of qkv/mlp_in, B of o/mlp_out: (fsdp, None)) is
    sliced locally for the skew, so its gradient comes back as a block of the replicated shard and
    is all-reduced over that axis, in the compute dtype (the weight is cast before it is skewed).
    Returns those all-reduces and the group's stored weight elements per device x n (the
    `grid_weights` convention: per tensor shard, before the fsdp split)."""
    b, n = ctx.block, ctx.n
    din, douts = b.projections(group)
    from boost_jax.model.transformer import PROJECTION_AXES  # imports jax: the model's axes of each group

    in_axis, out_axes = PROJECTION_AXES[group]
    weights = (
        [((in_axis, "rank"), (din, b.rank))] * len(douts)
        + [(("rank", o), (b.rank, w)) for o, w in zip(out_axes, douts)]
        if b.factored
        else [((in_axis, o), (din, w)) for o, w in zip(out_axes, douts)]
    )
    out, stored = [], 0.0
    for names, shape in weights:
        axes = stored_grid_axes(strategy, names, shape, n)
        local = shape[0] * shape[1] / n ** sum(a in ("fsdp", "tensor") for a in axes)
        stored += local * n
        for axis, stride in (("tensor", 1), ("fsdp", n)):
            if axis not in axes:
                out.append(Coll("all-reduce", local, n, stride, "bwd", "tensor" if axis == "tensor" else "data_fsdp"))
    return out, stored


# ---------------------------------------------------------------- cores


def attention(ctx: Ctx, layout: str) -> Op | None:
    """Causal attention fed q, k, v in `layout` (None where it cannot run). Token splits gather the
    keys and values of the whole sequence and carry the causal imbalance. Under parallel.context the
    sequence is already split (load-balanced: no imbalance) and the context exchange joins it
    (`context_exchange`); the trainer's attention then runs on whole heads or features only."""
    b = ctx.block
    fs, ts = ctx.splits(layout)
    if layout == "P" or not _divides(fs, b.heads, b.kv_heads) or not _divides(ts, ctx.seq):
        return None
    if ctx.context > 1 and ts > 1:
        return None
    q, kv = b.heads * b.head_dim, b.kv_heads * b.head_dim
    op = Op(f"attention@{layout}")
    op.acts = ctx.local(layout, 2 * q + kv)  # rotated q, k and the output
    if ts > 1:
        gathered = ctx.tokens * 2 * kv / fs
        op.colls = [Coll("all-gather", gathered, ts, 1, "fwd"), Coll("reduce-scatter", gathered, ts, 1, "bwd")]
        op.acts += gathered
    op.attn = Attn(
        queries=ctx.tokens / ts, keys=ctx.seq, heads=b.heads / fs, head_dim=b.head_dim, imbalance=(2 * ts - 1) / ts
    )
    # Kept: q, k, v and the output (and K/V gathered over a token split); materialised scores in
    # float32 (+ the probabilities in the compute dtype), else the log-sum-exp per row and head.
    c = attention_class(ctx.attention)
    op.saved = ctx.local(layout, 2 * q + 2 * kv + (c.kept - 4) * q) + (op.acts - ctx.local(layout, 2 * q + kv))
    rows = op.attn.queries * op.attn.heads
    if c.kept_scores:
        op.saved32 = c.kept_scores * rows * ctx.seq
        op.saved += rows * ctx.seq if ctx.act_bytes != 4 else 0.0
    else:
        op.saved32 = rows
    if ctx.context > 1:
        context_exchange(ctx, op, fs)
    return op


def context_exchange(ctx: Ctx, op: Op, fs: int) -> None:
    """Add parallel.context's exchange to the attention op (boost_jax/parallel/context.py, its
    `layer_exchange` formula: the one the comm report checks against the compiled step), on the
    `context` axis (stride: the tensor size, `context` sits inside `tensor`), and what it keeps and
    computes:
    - ring: the (K, V) block passes C-1 hops forward, 2(C-1) backward (K/V again, and dK/dV home in
      float32); cost.price overlaps the permutes with the attention's C-1 remote blocks. Its backward
      holds the block in flight and the next one, and the float32 dK/dV accumulator of its own.
    - all_gather: K/V of the whole row gathered once per layer and kept for the backward.
    - context_kv=bottleneck (factored kinds): σ(A_k x), σ(A_v x) move instead (r wide, whole on
      every device under the strategies that take it), and each device rebuilds K/V with its
      B_k, B_v: the ring re-runs them on every received block (forward C, backward C again plus the
      2 input/weight-gradient GEMMs of each remote block: 4C - 3 GEMMs of the forward's size, forward
      and backward together, beyond the group's own
      3), all_gather once on the whole row (3(C - 1) more). The island keeps σ(A x) (already kept by
      the qkv group), not K/V."""
    from boost_jax.parallel.context import layer_exchange  # imports jax: once per pricer (memoised ops)

    b, c = ctx.block, ctx.context
    kv_local = b.kv_heads * b.head_dim / fs
    bottleneck = ctx.context_kv == "bottleneck"
    width = b.rank if bottleneck else kv_local
    rows = ctx.tokens / ctx.local_seq
    for phase, kinds in layer_exchange(c, ctx.context_attention, rows, ctx.seq, width).items():
        for kind, v in kinds.items():
            each, n = v["elements"] / v["count"], v["count"]
            op.colls += [
                Coll(
                    kind,
                    each,
                    c,
                    ctx.t,
                    "fwd" if phase == "forward" else "bwd",
                    "context",
                    float32=i >= n - v["float32"],
                )
                for i in range(n)
            ]
    if bottleneck:
        op.saved -= 2 * ctx.tokens * kv_local  # K/V are rebuilt per block, not kept; σ(A x) is the qkv group's
        extra = 4 * c - 3 if ctx.context_attention == "ring" else 3 * (c - 1)
        rebuild = Gemm(ctx.tokens, b.rank, kv_local, "B")
        op.gemms = [rebuild] * (2 * extra)
        op.gemm_passes = 1.0
        op.redo_gemms = [rebuild] * (2 * (c - 1))  # the forward's remote rebuilds, either mode
    if ctx.context_attention == "ring":
        pair = 2 * ctx.tokens * width
        op.ring += 2 * pair + pair * 4 / ctx.act_bytes  # two blocks in flight; its float32 gradient
        # the backward's float32 scores of its remote blocks (a chunk of L = T/2C queries against
        # key blocks of the implementation's size), and under bottleneck each block's rebuilt K/V
        chunk = ctx.local_seq / 2
        block = min(2 * chunk, attention_class(ctx.attention).block or 2 * chunk)
        op.ring += RING_SCORE_BLOCKS * rows * b.heads / fs * chunk * block * 4 / ctx.act_bytes
        if bottleneck:
            op.ring += 2 * 2 * ctx.tokens * kv_local
    else:  # the whole row's K/V (rebuilt from the gathered σ(A x) under bottleneck, kept too)
        gathered = 2 * ctx.tokens * c * kv_local + (2 * ctx.tokens * c * b.rank if bottleneck else 0.0)
        op.acts += gathered
        op.saved += gathered


def attention_class(name: str):
    """The attention cost class registered as `name` (boost_jax/model/attention/registry.py COST_CLASSES)."""
    from boost_jax.model.attention import COST_CLASSES  # imports jax: once, then a dict lookup

    if name not in COST_CLASSES:
        raise ValueError(f"attention cost class {name!r} is not one of {tuple(COST_CLASSES)}")
    return COST_CLASSES[name]


def activation(ctx: Ctx, layout: str) -> Op | None:
    """The MLP's σ(gate)·up (or gate·up) in `layout`: elementwise, no communication."""
    fs, _ = ctx.splits(layout)
    if layout == "P" or ctx.block.ff % fs:
        return None
    width = ctx.local(layout, ctx.block.ff)
    return Op(
        f"act@{layout}",
        acts=width * (1 if ctx.block.only_lr_act else 2),
        saved=width * (GPU_SAVED_SWIGLU if gpu(ctx) else SAVED_SWIGLU)[ctx.block.only_lr_act],
    )


def residual_add(ctx: Ctx, layout: str) -> Op:
    return Op(f"add@{layout}", acts=ctx.local(layout, ctx.block.d))


# ---------------------------------------------------------------- outside the layer stack


def embedding(ctx: Ctx, residual: str) -> Op:
    """Token embedding into the residual layout: a d-split table feeds H without traffic; a
    vocab-split one leaves partial rows that are reduced (R) or reduce-scattered (S)."""
    b = ctx.block
    src = "H" if residual == "H" else "P"
    op = edge(ctx, src, residual, b.d) if ctx.t > 1 else Op("embed")
    op.name, op.weights = f"embed->{residual}", b.vocab * b.d / ctx.t
    return op


def head(ctx: Ctx, residual: str, row_groups: int = 1) -> Op:
    """Gather the hidden rows, final norm, vocab-parallel LM head and loss: 3 scalars per token for the
    loss's reductions, and the head's input gradient all-reduced in the backward. The loss runs in
    pieces (model/loss.py): chunks of model.loss_chunk positions, times `row_groups` (pipelined: one
    per pipeline micro-batch); each piece reduces its own scalars, and a loss in several pieces
    recomputes each one's logits, reductions included, in the backward."""
    b, t, m = ctx.block, ctx.t, ctx.tokens
    seq = ctx.local_seq  # under context each device scans its own positions (model/loss.py seq_groups)
    pieces = (-(-seq // b.loss_chunk) if 0 < b.loss_chunk < seq else 1) * row_groups
    op = edge(ctx, residual, "R", b.d)
    op.name = f"{residual}->head"
    op.gemms = [Gemm(m, b.d, b.vocab / t, "head")]
    op.weights = b.d * b.vocab / t + b.d
    if 0 < b.loss_chunk < seq:  # the chunked loss recomputes each chunk's logits in the backward
        op.gemm_passes = 4.0
    if t > 1:
        scalars = [
            Coll("all-reduce", 3 * m / pieces, t, 1, phase)
            for phase in ("fwd",) + ("bwd",) * (pieces > 1)
            for _ in range(pieces)
        ]
        op.colls = op.colls + scalars + [Coll("all-reduce", m * b.d, t, 1, "bwd")]
    return op


def stage_shift(ctx: Ctx, residual: str, stages: int, stride: int, schedule: str = "gpipe") -> list[Coll]:
    """One tick's pipeline traffic (boost_jax/parallel/pipeline.py): every stage's output, the residual
    stream of one pipeline micro-batch in its layout, moves one stage on (a roll over the `pipeline`
    axis: one collective-permute); the backward sends its gradient back, and (GPipe, circular) sums the
    gradient of the micro-batch entering stage 0 over the pipeline axis (the micro-batch buffer it is
    read from is replicated over it: one all-reduce per tick, as the compiled scan runs it; 1F1B files
    it at stage 0 and hands it over once per pass). `stride`: devices per stage (the pipeline axis is
    outermost)."""
    if stages <= 1:
        return []
    elements = ctx.local(residual, ctx.block.d)
    permutes = [Coll("collective-permute", elements, stages, stride, phase, "pipeline") for phase in ("fwd", "bwd")]
    if schedule == "1f1b":
        return permutes
    return permutes + [Coll("all-reduce", elements, stages, stride, "bwd", "pipeline")]


def pipeline_ends(
    ctx: Ctx, residual: str, stages: int, stride: int, microbatches: int, schedule: str = "gpipe"
) -> list[Coll]:
    """The pipeline's once-per-pass traffic, as GSPMD compiles boost_jax/parallel/pipeline.py: the
    last stage hands the M finished micro-batches to every stage for the head (GPipe: a permute and
    an all-reduce, a permute back in the backward; circular: the all-reduce alone, its outputs are
    filed where they are reduced; 1F1B runs the head at the last stage inside its ticks, and the
    gradient of the M micro-batches' inputs, filed at stage 0, reaches every stage for the embedding's
    in one all-reduce)."""
    if stages <= 1:
        return []
    done = microbatches * ctx.local(residual, ctx.block.d)
    if schedule == "1f1b":
        return [Coll("all-reduce", done, stages, stride, "bwd", "pipeline")]
    reduce = [Coll("all-reduce", done, stages, stride, "fwd", "pipeline")]
    if schedule == "circular":
        return reduce
    return (
        [Coll("collective-permute", done, stages, stride, "fwd", "pipeline")]
        + reduce
        + [Coll("collective-permute", done, stages, stride, "bwd", "pipeline")]
    )


def circular_reorder(stage_weights: float, stages: int, repeats: int, stride: int) -> list[Coll]:
    """The circular schedule's once-per-pass weight moves, as GSPMD compiles boost_jax/parallel/pipeline.py
    (its `_copies` / `_sum_copies`, read from the compiled step): the stored contiguous blocks of layers
    become the stage's V chunks in their stored (fsdp, tensor) split, before the tick loop, and their
    summed float32 gradient goes back the same way after it. When the [L] split over S devices reshapes
    to [V, S, L/(S V)] evenly (V % S == 0 or S % V == 0) that is one all-to-all per weight each way
    (operand: the stage's stored weights on this device); otherwise (e.g. V 3 on 2 stages) XLA gathers
    the whole stack over `pipeline` each way (result: S x that). The copies keep the tensor split, as
    gpipe's do. stage_weights: the stage's stored weight elements on one device (fsdp-split). Axis
    `pipeline_weights`: float32 payloads."""
    if stages <= 1:
        return []
    if repeats % stages == 0 or stages % repeats == 0:
        return [
            Coll("all-to-all", stage_weights, stages, stride, phase, "pipeline_weights") for phase in ("fwd", "bwd")
        ]
    return [
        Coll("all-gather", stages * stage_weights, stages, stride, phase, "pipeline_weights")
        for phase in ("fwd", "bwd")
    ]


# ---------------------------------------------------------------- the trainer's strategies


def uniform_plan(
    strategy: str, sequence_parallel: bool = False, factored: bool = True, online_norm: bool = True
) -> tuple[str, tuple[str, ...], str, str]:
    """(residual layout, group choices, attention layout, act layout) of a trainer strategy, as its
    rule table lays it out (boost_jax/parallel/strategies.py; see `strategy_layers`)."""
    from boost_jax.parallel.strategies import registered  # imports jax: not at the planner's import

    registered(strategy)  # an unknown name: the ConfigError naming the registered ones
    for table in strategy_layers(factored, online_norm):
        if (table.name, table.sequence_parallel) == (strategy, bool(sequence_parallel)):
            return table.residual, choice_names(table, factored, online_norm), table.attention, table.act
    raise ValueError(f"strategy {strategy!r} has no sequence-parallel table")


def choice_names(table: TableLayer, factored: bool, online_norm: bool = True) -> tuple[str, ...]:
    """The choice names of a strategy's groups: each named after the first registered strategy whose
    table splits it alike (see `group_choices`)."""
    first: dict = {}
    for other in strategy_layers(factored, online_norm):
        if other.factored_only and not factored:
            continue
        for group, split in zip(GROUPS, other.splits):
            first.setdefault((group, split), other.name)
    return tuple(first.get((group, split), table.name) for group, split in zip(GROUPS, table.splits))
