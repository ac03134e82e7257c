"""Seconds and bytes of one operator: the α-β communication model, the GEMM/attention compute model,
the kept-activation and memory terms, and the cost model's constants (one a line below).

Communication (per device; p = group size, B = payload bytes, β/α from the group's link: intra-node
when the group fits in one node, else inter-node):
    all-reduce (ring)          2(p-1)/p · B/β + 2(p-1)·α
    all-gather, reduce-scatter  (p-1)/p · B/β +  (p-1)·α     (B = the whole gathered tensor)
    all-to-all                  (p-1)/p · B/β +  (p-1)·α     (B = this device's block)
    collective-permute                    B/β +        α
Tensor-axis collectives and pipeline hand-overs sit on the critical path; P(n x n)'s permutes overlap
its GEMMs (Σ_t max(compute, comm)); data/fsdp collectives hide behind the whole micro-batch
(step_terms.step_seconds). A GEMM (m, k, n) takes 2mkn / (peak · e · s(m) s(k) s(n)) with
s(x) = x / (x + h), h = cluster.gemm_half_dim; the backward twice the forward; elementwise work is
elementwise_passes x activation bytes of HBM traffic. Every byte kept for the backward moves through
HBM cluster.kept_passes times (the scanned stack writes it into its stacked residual and reads it back).
"""

from __future__ import annotations

from boost_jax import xla_gpu_flags
from boost_jax.parallel.pipeline.arithmetic import ticks, ticks_1f1b
from boost_jax.planner.ops.operators import Attn, Coll, Gemm, Op, StMatmul, attention_class
from boost_jax.planner.pricing.cluster import Cluster
from boost_jax.planner.pricing.plans import Cost

# The cost model's constants, one a line: its value, what it prices, where it was set ("§": that section of
# benchmarks/RESULTS.md). How each came to its value: RESULTS.md "2026-11-28: the planner's constants, their history".
#
# name                value       prices                                                  set on
# STATE_BYTES         4           bytes of a parameter, gradient, gradient reduction      the trainer's float32
# ADAM_STATE_BYTES    16          bytes per parameter: fp32 param + grad + Adam m, v      the trainer's float32
# ACCUM_BYTES         4           bytes per parameter of the grad_accum > 1 accumulator   the trainer's float32
# OPTIMIZER_TRAFFIC   32          HBM bytes per parameter per AdamW update                counted (p, m, v r/w; g)
# TICK_WEIGHT_TRAFFIC 32          HBM bytes per weight of a pipeline tick's chunk, a tick  counted, H100 HLO (§ 11-29)
# LOGIT_BUFFERS       3           f32 [rows, chunk, V/t] loss arrays (CPU, pipelined)     tests/test_planner.py
# GPU_LOGIT_BUFFERS   1           the same, unpipelined GPU steps                         § 2026-11-27 (third)
# GPU_LOGIT_CAST      1           compute-dtype [rows, chunk, V/t] cotangent, the same     § 2026-11-28 (planner picks)
# BUFFER_OVERHEAD     1.10        XLA:CPU's packed temporaries over the live ones         benchmarks/planner_memory.py
# GPU_BUFFER_OVERHEAD (1.0, 1.15) XLA:GPU's packing: else, a pipeline with another axis  § 2026-11-29
# OPTIMIZER_TEMP      9           bytes per local parameter the update holds beyond g     compiled cola_7b steps
# BACKWARD_LIVE       0.7         a backward's activation gradients, x its kept set       tests/test_planner.py
# STAGE_COPY          1.0         kept sets a stage-remat tick's backward holds more      tests/test_planner_pipeline.py
# CIRCULAR_COPIES     3.0         f32 stage-weight copies, circular, no stage remat, CPU  tests/test_planner_pipeline.py
# F1B_IN_FLIGHT       2           1F1B items a stage holds beyond its ring (float32 CPU)  tests/test_planner_pipeline.py
# F1B_IN_FLIGHT_GPU   3           the same in the GPU (bf16) program                      H100 1F1B compiles (history)
# PIPELINED_SIGMA     1.0         stacked σ(A·x) arrays per A output the pipeliner adds   § 2026-11-29
# SCAN_DOUBLE_BUFFER  1.0         stacked arrays the double-buffered scan adds (memory)   § 2026-11-27 (third), 11-29
# PIPELINER_NEEDS     (2 flags)   the XLA options under which PIPELINED_SIGMA applies     § 2026-11-27
STATE_BYTES = 4
ADAM_STATE_BYTES = 16
ACCUM_BYTES = 4
OPTIMIZER_TRAFFIC = 32
TICK_WEIGHT_TRAFFIC = 32
LOGIT_BUFFERS = 3
GPU_LOGIT_BUFFERS = 1
GPU_LOGIT_CAST = 1
BUFFER_OVERHEAD = 1.10
GPU_BUFFER_OVERHEAD = (1.0, 1.15)  # indexed by whether a pipelined step mixes kinds of parallelism
OPTIMIZER_TEMP = 9
BACKWARD_LIVE = 0.7
STAGE_COPY = 1.0
CIRCULAR_COPIES = 3.0
F1B_IN_FLIGHT = 2
F1B_IN_FLIGHT_GPU = 3
PIPELINED_SIGMA = 1.0
SCAN_DOUBLE_BUFFER = 1.0
PIPELINER_NEEDS = ("xla_gpu_enable_pipelined_all_gather", "xla_gpu_enable_pipelined_all_reduce")


def pipeliner(pipelined: bool | None = None) -> bool:
    """Whether the GPU program compiles with the collective pipeliner PIPELINED_SIGMA prices:
    `pipelined` when given (Options.pipelined), else what boost_jax/xla_gpu_flags.py says
    this process's GPU steps get (the project's flags, XLA_FLAGS' overrides, the installed jaxlib)."""
    if pipelined is not None:
        return pipelined
    return set(PIPELINER_NEEDS) <= xla_gpu_flags.pipelined()


def double_buffering(on: bool | None = None) -> bool:
    """Whether the GPU program's layer scan is double-buffered (SCAN_DOUBLE_BUFFER prices it): `on`
    when given (Options.double_buffered), else what boost_jax/xla_gpu_flags.py says this
    process's GPU steps get (the project's flags, XLA_FLAGS' override)."""
    if on is not None:
        return on
    return xla_gpu_flags.double_buffered()


def buffer_overhead(gpu: bool, mixed: bool) -> float:
    """The allocation over the live temporaries: BUFFER_OVERHEAD for the float32 (CPU) program, else
    GPU_BUFFER_OVERHEAD by whether the step mixes kinds of parallelism (a pipeline with data x fsdp,
    tensor or context, but 1F1B without remat: memory.memory_bytes)."""
    return GPU_BUFFER_OVERHEAD[mixed] if gpu else BUFFER_OVERHEAD


def remat_policies() -> tuple[str, ...]:
    """The remat policies the planner prices, in search order (boost_jax/model/remat.py PRICED)."""
    from boost_jax.model.remat import PRICED  # lazy: imports jax (the model package): not at import time

    return tuple(PRICED)


# ---------------------------------------------------------------- communication


def link_bytes(kind: str, nbytes: float, p: int) -> float:
    """Bytes one device puts on its links for one collective."""
    if p <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (p - 1) / p * nbytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (p - 1) / p * nbytes
    if kind == "collective-permute":
        return nbytes
    raise ValueError(f"unknown collective {kind!r}")


def _steps(kind: str, p: int) -> int:
    return {"all-reduce": 2 * (p - 1), "collective-permute": 1}.get(kind, p - 1)


def collective_seconds(kind: str, nbytes: float, p: int, bandwidth: float, latency: float) -> float:
    """The α-β time of one collective (see the module docstring)."""
    if p <= 1:
        return 0.0
    return link_bytes(kind, nbytes, p) / bandwidth + _steps(kind, p) * latency


def coll_bytes(c: Coll, act_bytes: int) -> float:
    """Payload bytes: activations in the compute dtype; on data/fsdp, FSDP's weight gathers in the
    compute dtype too (the trainer casts the shard, then gathers) and gradient reductions in float32
    (parallel.grad_reduce_dtype's default); the circular schedule's weight moves (`pipeline_weights`)
    move the float32 stage copies; the context ring's dK/dV (`float32`) go home in float32."""
    if (c.axis == "data_fsdp" and c.kind != "all-gather") or c.axis == "pipeline_weights" or c.float32:
        return c.elements * STATE_BYTES
    return c.elements * act_bytes


def coll_seconds(c: Coll, cluster: Cluster, act_bytes: int) -> float:
    link = cluster.link(c.stride, c.size)
    return collective_seconds(c.kind, coll_bytes(c, act_bytes), c.size, link.bandwidth, link.latency)


# ---------------------------------------------------------------- compute


def gemm_efficiency(m: float, k: float, n: float, cluster: Cluster) -> float:
    h = cluster.gemm_half_dim
    s = 1.0
    for x in (m, k, n):
        s *= x / (x + h)
    return cluster.gemm_efficiency * s


def gemm_seconds(m: float, k: float, n: float, cluster: Cluster) -> float:
    """Forward time of one (m, k, n) GEMM."""
    if min(m, k, n) <= 0:
        return 0.0
    return 2 * m * k * n / (cluster.peak_flops * gemm_efficiency(m, k, n, cluster))


def gated_gemm_seconds(g: Gemm, cluster: Cluster, act_bytes: int) -> tuple[float, float, float]:
    """(forward, input gradient, weight gradient) of the gated down GEMM (act(gate)·up) @ W, gate and up
    [m, k] (kernels/gated_gemm.py): each kernel the slower of its GEMM's compute and its operand
    traffic through HBM, in elements: the forward reads gate and up (2mk) and W (kn) and writes mn; the
    input gradient reads dY (mn), W, gate and up and writes both their gradients (4mk + kn + mn); the
    weight gradient reads gate, up and dY and writes dW (2mk + mn + kn)."""
    compute = gemm_seconds(g.m, g.k, g.n, cluster)
    mk, kn, mn = g.m * g.k, g.k * g.n, g.m * g.n
    moved = (2 * mk + kn + mn, 4 * mk + kn + mn, 2 * mk + mn + kn)
    return tuple(max(compute, e * act_bytes / cluster.hbm_bandwidth) for e in moved)


def forward_seconds(g: Gemm, cluster: Cluster, act_bytes: int) -> float:
    """Forward time of one GEMM of an operator (a gated one as `gated_gemm_seconds`)."""
    return gated_gemm_seconds(g, cluster, act_bytes)[0] if g.gated else gemm_seconds(g.m, g.k, g.n, cluster)


def st_seconds(st: StMatmul, cluster: Cluster, act_bytes: int) -> tuple[float, float]:
    """(forward, backward) of P(n x n): each phase is n local GEMMs whose n-1 one-hop permutes run
    under the GEMMs (double-buffered), so a step costs max(GEMM, its two transfers)."""
    n = st.n
    step = gemm_seconds(st.m, st.k / n, st.out / n, cluster)  # st.m: this device's tokens already
    colls = st.colls()  # [skew I, skew W] + per step (fwd 2, dI 2, dW 2) + [unskew dI, dW back]
    seconds = lambda cs: sum(coll_seconds(c, cluster, act_bytes) for c in cs if c.elements)  # noqa: E731
    skew, unskew = seconds(colls[:2]), seconds(colls[-2:])
    pairs = [colls[2 + 6 * s : 8 + 6 * s] for s in range(n - 1)]

    def phase(j: int) -> float:
        return step + sum(max(step, seconds(p[j : j + 2])) for p in pairs)

    return skew + phase(0), phase(2) + phase(4) + unskew


def attention_kind(name: str, block, seq: int, act_bytes: int) -> str:
    """The cost class (boost_jax/model/attention/registry.py COST_CLASSES) that `model.attention = name`
    registered, i.e. how it runs on a GPU of the cluster: `auto` resolves as the trainer does
    (`auto_impl`) for a GPU in the compute dtype act_bytes stands for."""
    from boost_jax.model import attention  # lazy: imports jax; once per search, not per plan

    if name not in attention.names():
        raise ValueError(f"--attention: {name!r} is not one of {attention.names()}")
    if name == "auto":
        name = attention.auto_impl(on_gpu=True, half=act_bytes == 2, head_dim=block.head_dim, queries=seq, keys=seq)
    return attention.cost_class(name)


def attention_seconds(a: Attn, kind: str, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) of causal attention on this device, as its cost class `kind` (a name of
    boost_jax/model/attention/registry.py COST_CLASSES) describes it."""
    c = attention_class(kind)
    flops = 4 * a.queries * a.keys * a.head_dim * a.heads  # q·kᵀ and p·v over every key
    if c.fused:  # skips masked blocks; the busiest token block sets the pace
        fwd = 0.5 * flops * a.imbalance / (cluster.peak_flops * cluster.flash_efficiency)
        return fwd, c.backward * fwd
    gemm = flops / (
        cluster.peak_flops * gemm_efficiency(a.queries, a.head_dim, min(a.keys, c.block or a.keys), cluster)
    )
    traffic = a.queries * a.keys * a.heads / cluster.hbm_bandwidth
    if not c.block:
        return gemm + c.score_bytes[0] * traffic, c.backward * gemm + c.score_bytes[1] * traffic
    blocks = -(-a.keys // c.block)
    visible = (blocks + 1) / (2 * blocks) * a.imbalance  # the diagonal blocks are computed whole
    return (visible * (gemm + c.score_bytes[0] * traffic), visible * (c.backward * gemm + c.score_bytes[1] * traffic))


# ---------------------------------------------------------------- one operator


def recomputed(op: Op, policy: str) -> tuple[list, list, bool, list]:
    """(GEMMs, st matmuls, attention?, collectives) a remat policy re-runs. `lowrank` keeps the
    reduced first-stage (A) outputs, so it redoes everything after them, collectives included unless
    their result is the kept tensor; `full` redoes the whole forward."""
    if policy == "none" or not op.recompute:
        return [], [], False, []
    fwd = [c for c in op.colls if c.phase == "fwd"]
    gemms = op.gemms if op.redo_gemms is None else op.redo_gemms
    if policy == "full":
        return gemms, op.st, op.attn is not None, fwd
    if policy == "lowrank":
        return (
            [g for g in gemms if g.tag != "A"],
            [s for s in op.st if s.tag != "A"],
            op.attn is not None,
            [c for c in fwd if not c.saved],
        )
    raise ValueError(f"--remat: {policy!r} is not one of {remat_policies()}")


def st_recomputed(op: Op, policy: str) -> list:
    """The st matmuls' permutes a remat policy re-runs in the backward, as the compiled step shows:
    `full` re-runs their forward input moves (skews and row rings; the weights' moves do not change
    and XLA keeps them from the forward); `lowrank` re-skews only the first stages' inputs (the
    second stages' inputs come from the kept A outputs)."""
    if policy == "none" or not op.recompute:
        return []
    if policy == "full":
        return [c for s in op.st for c in s.colls() if c.phase == "fwd" and c.axis == "tensor"]
    return [c for s in op.st if s.tag == "A" for c in s.colls()[:1] if c.elements]


def ring_permute(c: Coll) -> bool:
    """A context ring hop (boost_jax/parallel/context.py): issued before the block it overlaps."""
    return c.axis == "context" and c.kind == "collective-permute"


def ring_exposed(op: Op, attn: tuple[float, float], cluster: Cluster, act_bytes: int) -> float:
    """The context ring's hops not hidden behind the attention: each hop's transfer runs under one
    remote block's compute (the ring issues the next block's permute before the current block), the
    C-1 remote blocks being (C-1)/C of the attention (every step costs the same L x 2L scores); per
    direction, what the transfers take beyond that shows."""
    return sum(
        hops_exposed([c for c in op.colls if c.phase == phase], a, cluster, act_bytes)
        for phase, a in zip(("fwd", "bwd"), attn)
    )


def hops_exposed(colls: list, attention_s: float, cluster: Cluster, act_bytes: int) -> float:
    """What the ring hops among `colls` (one direction's) take beyond the (C-1)/C of `attention_s`
    they run under (see ring_exposed)."""
    hops = [c for c in colls if ring_permute(c)]
    if not hops:
        return 0.0
    c = hops[0].size
    return max(0.0, sum(coll_seconds(h, cluster, act_bytes) for h in hops) - (c - 1) / c * attention_s)


def price(op: Op, cluster: Cluster, policy: str = "none", attention: str = "materialized", act_bytes: int = 2) -> Cost:
    """Forward + backward (+ recompute) time of one operator on one device. `attention`: one of
    attention cost classes (see attention_kind)."""
    gemm = [forward_seconds(g, cluster, act_bytes) for g in op.gemms]
    # a GEMM's backward costs twice its forward (gemm_passes 3), a gated one's kernels their own
    passes = sum(
        sum(gated_gemm_seconds(g, cluster, act_bytes)) if g.gated else op.gemm_passes * t
        for g, t in zip(op.gemms, gemm)
    )
    st = [st_seconds(s, cluster, act_bytes) for s in op.st]
    attn = attention_seconds(op.attn, attention, cluster) if op.attn else (0.0, 0.0)
    elementwise = cluster.elementwise_passes * op.acts * act_bytes / cluster.hbm_bandwidth
    cost = Cost(
        compute=passes + sum(map(sum, st)) + sum(attn) + elementwise,
        comm=sum(
            max(0.0, coll_seconds(c, cluster, act_bytes) - (gemm[0] if c.beside_gemm and gemm else 0.0))
            for c in op.colls
            if not ring_permute(c)
        )
        + ring_exposed(op, attn, cluster, act_bytes),
        kept=cluster.kept_passes * saved_bytes(op, policy, act_bytes) / cluster.hbm_bandwidth
        if cluster.kept_passes
        else 0.0,
    )
    if policy != "none":
        g_re, st_re, attn_re, c_re = recomputed(op, policy)
        cost.recompute = (
            sum(forward_seconds(g, cluster, act_bytes) for g in g_re)
            + sum(st_seconds(s, cluster, act_bytes)[0] for s in st_re)
            + attn[0] * attn_re
            + elementwise / 3 * op.recompute
            + sum(coll_seconds(c, cluster, act_bytes) for c in c_re if not ring_permute(c))
            # the re-run forward's ring hops overlap its attention as the forward's do
            + hops_exposed(c_re, attn[0] * attn_re, cluster, act_bytes)
        )
    return cost


# ---------------------------------------------------------------- memory


def saved_bytes(op: Op, policy: str, act_bytes: int = 2) -> float:
    """Activation bytes this operator keeps for the backward under a remat policy (one micro-batch)."""
    if policy == "full":
        return 0.0
    if policy == "lowrank":
        return op.saved_lowrank * act_bytes
    return op.saved * act_bytes + op.saved32 * 4


def kept_bytes(op: Op, policy: str, act_bytes: int = 2, unrolled: bool = False) -> float:
    """The bytes of `saved_bytes` the program keeps in memory: Op.kept (Op.kept_unrolled for an
    unrolled stack) where the GPU program keeps other arrays than the time terms' passes count."""
    pair = (op.kept_unrolled if unrolled and op.kept_unrolled is not None else None) or op.kept
    if policy in ("full", "lowrank") or pair is None:
        return saved_bytes(op, policy, act_bytes)
    return pair[0] * act_bytes + pair[1] * 4


def backward_working(ops: list, policy: str, act_bytes: int, unrolled: bool = False) -> float:
    """Bytes one layer's backward holds besides what is kept for it: the gradients of its
    activations (BACKWARD_LIVE x its kept-without-remat set), or under remat its recomputed
    activations (the whole set), plus st's received ring blocks."""
    layer = sum(kept_bytes(op, "none", act_bytes, unrolled) for op in ops)
    return layer * (BACKWARD_LIVE if policy == "none" else 1.0) + sum(op.ring for op in ops) * act_bytes


def table_bytes(fsdp: int, act_bytes: int) -> float:
    """Bytes per element of the embedding table and LM head live around the loss: the float32
    gradient at full (gathered) size and the FSDP-gathered float32 copy (float32 program), or the
    gradient and the compute-dtype cast, which the GPU program gathers (GPU_LOGIT_BUFFERS)."""
    if act_bytes != STATE_BYTES:
        return STATE_BYTES + act_bytes
    return STATE_BYTES + (STATE_BYTES if fsdp > 1 else 0)


def loss_bytes(
    rows: float, seq: int, chunk: int, vocab_local: float, gpu: bool = False, act_bytes: int = STATE_BYTES
) -> float:
    """The loss's float32 [rows, chunk, V/t] buffers (one chunk of positions at a time; chunk 0 or
    >= seq: the whole sequence). rows: sequences of the micro-batch on this device. `gpu`: the
    bf16-compute program's count (GPU_LOGIT_BUFFERS), else LOGIT_BUFFERS; with a compute dtype
    narrower than float32 (act_bytes), the GPU program also holds the logits' cotangent cast to it
    (GPU_LOGIT_CAST), which the head's two backward GEMMs read (model/loss.py)."""
    positions = seq if not 0 < chunk < seq else chunk
    if gpu:
        per = GPU_LOGIT_BUFFERS * 4 + (GPU_LOGIT_CAST * act_bytes if act_bytes < STATE_BYTES else 0)
    else:
        per = LOGIT_BUFFERS * 4
    return per * rows * positions * vocab_local


def pipeline_ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Ticks of one pass: GPipe M + S - 1; circular (V chunks per stage, V rounds of the ring)
    V M + S - 1. Every tick every stage runs one chunk of L/(S V) layers."""
    return ticks(stages, microbatches, repeats) if stages > 1 else 1


def handover_ticks(stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe") -> int:
    """Ticks that hand over (one collective-permute each way per tick): the pass's ticks; 1F1B's lockstep
    ticks each run at most one forward and one backward, V M + V S + S - 2 of them, whose compute adds
    up to V M + S - 1 ticks of both (its warm-up ticks run forwards only, its last ones backwards only;
    parallel/pipeline/arithmetic.py `ticks_1f1b`)."""
    if schedule == "1f1b" and stages > 1:
        return ticks_1f1b(stages, microbatches, repeats)
    return pipeline_ticks(stages, microbatches, repeats)


def state_bytes(params: float, grad_accum: int) -> float:
    """Parameters, gradients and AdamW moments (fp32), plus the accumulator when accumulating."""
    return params * (ADAM_STATE_BYTES + (ACCUM_BYTES if grad_accum > 1 else 0))
