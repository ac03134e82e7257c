"""The records a partition choice is priced in: a transformer block's shapes (`Block`), the context of one
pricing (`Ctx`: tensor size, tokens, layouts), and an operator's GEMMs, collectives and kept activations
(`Op` with its `Gemm`, `StMatmul`, `Coll` and `Attn`). The layouts: this package's docstring."""

from __future__ import annotations

import dataclasses

from boost_jax.errors import ConfigError
from boost_jax.model.kinds import kind_class


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
    norm_kernel: str = "auto"  # kernels.rmsnorm and kernels.residual_norm as configured (the memory model
    residual_norm: str = "auto"  # resolves them per plan: kernels/norm_choice.py)
    max_seq_len: int = 0  # model.max_seq_len: a plan at a longer train.seq_len raises it in its flags
    # as configured (model/autos.py resolves them per plan: `kernels_in_gemms`)
    linear: str = ""
    group_linears: bool | str = "auto"
    gate_kernel: str = "auto"
    bottleneck_kernel: str = "auto"
    weight_casts: str = "auto"  # train.weight_casts (the step's bf16 copy: planner/pricing/memory.py)

    @classmethod
    def from_config(cls, cfg) -> Block:
        """The model of `cfg`."""
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
            fused_norm=cfg.kernels.rmsnorm != "xla",  # `auto` is a fused kernel on the GPUs plans are priced for
            norm_kernel=str(cfg.kernels.rmsnorm),
            residual_norm=str(cfg.kernels.get("residual_norm", "auto")),
            max_seq_len=int(m.max_seq_len),
            linear=str(m.linear),
            # a flag set over `auto` may read back as a string (benchmarks/aot_fit.py `reprice`)
            group_linears={"true": True, "false": False}.get(str(m.group_linears).lower(), m.group_linears),
            gate_kernel=str(m.get("gate_kernel", "auto")),
            bottleneck_kernel=str(m.get("bottleneck_kernel", "auto")),
            weight_casts=str(cfg.train.get("weight_casts", "auto")),
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
    # runs beside its op's first GEMM, which does not read it (BTP's norm statistics beside the A
    # GEMM): priced at the part of it that GEMM leaves exposed
    beside_gemm: bool = False


@dataclasses.dataclass(frozen=True)
class Gemm:
    m: float
    k: float
    n: float
    tag: str  # A (first stage), B (second stage), W (dense), head
    # the MLP's gate product read into this GEMM (model.gate_kernel=gemm, kernels/gated_gemm.py): its k
    # is d_ff, and it loads the gate and up outputs in place of their product (cost.gated_gemm_seconds)
    gated: bool = False


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
    # counted per operator from its memory report (see kept_arrays.py and tests/test_planner.py).
    saved: float = 0.0
    saved32: float = 0.0
    saved_lowrank: float = 0.0  # what the `lowrank` remat policy keeps (compute dtype)
    # (compute dtype, float32) elements the GPU program keeps in memory where that differs from (saved,
    # saved32), which the time terms read as passes: with the scanned stack, and unrolled (the memory
    # terms read them: cost.kept_bytes; None: saved, saved32)
    kept: tuple | None = None
    kept_unrolled: tuple | None = None
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
    devices: int = 0  # GPUs of the whole mesh (1: the one-device program; 0: not given)

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


def divides(t: int, *xs: int) -> bool:
    return all(x % t == 0 for x in xs)


def gpu(ctx: Ctx) -> bool:
    """Whether the priced program is the GPU's: computed in bf16/fp16 (the CPU checks compile float32,
    as XLA:CPU runs bf16 partly in float32), so its kept arrays are the GPU_SAVED_* counts."""
    return ctx.act_bytes != 4


def kernels_in_gemms(ctx: Ctx) -> tuple[bool, bool]:
    """(the MLP's gate product inside the down projection's first GEMM, σ inside the B GEMMs) as the
    GPU program of this plan runs them: model/autos.py `pick` resolves `auto` (the grouping and the
    gate kernel on this tensor size), the kind's `bottleneck_kernels` and model/linear.py's
    `act_kernels_run` the σ kernels (one device only). The gate's fallback where d_ff is split is
    the MLP core's layout (cores.activation). Neither on the CPU's float32 program or a dense kind."""
    b = ctx.block
    if not gpu(ctx) or not b.factored or not b.linear:
        return False, False
    if ctx not in _KERNELS:
        from boost_jax.model.autos import pick  # lazy: the model imports jax; the planner loads without it
        from boost_jax.model.linear import act_kernels_run  # lazy: as above
        from boost_jax.model.transformer import GATE_IN_GEMM  # lazy: as above

        v = pick(
            group=b.group_linears,
            unroll=False,
            policy="none",
            norm="xla",
            linear=b.linear,
            gpu=True,
            sizes={"tensor": ctx.t},
            triton=False,
            gate=b.gate_kernel,
        )
        m = {"bottleneck_kernel": b.bottleneck_kernel, "gate_kernel": v["gate_kernel"]}
        act, _ = kind_class(b.linear).bottleneck_kernels(m)
        fuses_norm = b.online_norm and ctx.t > 1  # BTP's online norm rides in the A all-reduce
        runs = act_kernels_run(act, v["group_linears"], fuses_norm, ctx.devices)
        _KERNELS[ctx] = (
            v["gate_kernel"] == GATE_IN_GEMM,
            runs,
            # the residual add + norm inside the grouped first stage's GEMM (model/linear.py
            # `add_norm_first`): where the σ kernels run, the fused norm does and the first stages are grouped
            runs and b.fused_norm and bool(v["group_linears"]) and kind_class(b.linear).norm_kernel(m),
            # q and k rotated by RoPE inside their σ kernels (model/linear.py `rope_in_gemm`)
            runs and kind_class(b.linear).bottleneck_kernels(m)[1],
        )
    return _KERNELS[ctx][:2]


def rope_in_gemm(ctx: Ctx) -> bool:
    """Whether the GPU program of this plan rotates q and k by RoPE inside their σ kernels
    (`kernels_in_gemms`' σ and model.bottleneck_kernel rope or norm): no RoPE kernel of its own."""
    return kernels_in_gemms(ctx)[1] and _KERNELS[ctx][3]


def norm_in_gemm(ctx: Ctx) -> bool:
    """Whether the GPU program of this plan reads each norm into the GEMM after it (`kernels_in_gemms`'
    conditions and model.bottleneck_kernel=norm): the norm then keeps no normalised rows, only the
    stream and each row's 1/rms (kernels/norm_gemm.py)."""
    return kernels_in_gemms(ctx)[1] and _KERNELS[ctx][2]


_KERNELS: dict = {}


def attention_class(name: str):
    """The attention cost class registered as `name` (boost_jax/model/attention/registry.py COST_CLASSES)."""
    from boost_jax.model.attention import COST_CLASSES  # lazy: imports jax; once, then a dict lookup

    if name not in COST_CLASSES:
        raise ValueError(f"attention cost class {name!r} is not one of {tuple(COST_CLASSES)}")
    return COST_CLASSES[name]
