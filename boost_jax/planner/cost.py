"""Seconds and bytes: the α-β communication model, the GEMM/attention compute model and the memory model.

Communication (per device; p = group size, B = payload bytes, β/α from the group's link):
    all-reduce (ring)          2(p-1)/p · B/β + 2(p-1)·α
    all-gather, reduce-scatter  (p-1)/p · B/β +  (p-1)·α     (B = the whole gathered tensor)
    all-to-all                  (p-1)/p · B/β +  (p-1)·α     (B = this device's block)
    collective-permute                    B/β +        α
β and α are the cluster's intra-node link when the group fits in one node, else the inter-node one.
Tensor-axis collectives sit on the critical path (their result feeds the next GEMM); P(n x n)'s
permutes overlap the step's GEMM (Σ_t max(compute, comm)); data/fsdp collectives hide behind the
whole micro-batch (see search.evaluate). Pipeline stage hand-overs (one collective-permute of the
residual per GPipe tick, each way) sit on the critical path too: the next tick's stage reads them.

Kept activations: every byte an operator keeps for the backward (saved_bytes, by the remat policy)
moves through HBM cluster.kept_passes times (fitted to measured steps: the scanned layer stack writes
it into its stacked residual and reads it back in the backward, with the copies XLA adds around the
loop); it is why a step that keeps little (remat) can be faster than one that keeps everything.

Compute: a GEMM (m, k, n) takes 2mkn / (peak · e · s(m) s(k) s(n)), s(x) = x / (x + h): the skinny-GEMM
penalty (h = cluster.gemm_half_dim). Backward = 2 GEMMs of the same shape up to transposition, so
twice the forward. Elementwise work is HBM traffic: elementwise_passes x activation bytes.
"""
from __future__ import annotations

import dataclasses

from boost_jax.planner.cluster import Cluster
from boost_jax.planner.partitions import Attn, Coll, Op, StMatmul, attention_class

STATE_BYTES = 4  # parameters, gradients and their reductions are float32 in the trainer
ADAM_STATE_BYTES = 16  # fp32 param + fp32 grad + Adam m and v
ACCUM_BYTES = 4  # the fp32 gradient accumulator of grad_accum > 1
OPTIMIZER_TRAFFIC = 32  # HBM bytes per parameter per AdamW update (read/write p, m, v; read g, norm)
# The compiled step's transient buffers, read from its memory report (tests/test_planner.py):
LOGIT_BUFFERS = 3  # float32 [rows, chunk, V/t] arrays live in the loss (logits, exp, gradient)
# The GPU program (bf16 compute) holds one float32 [rows, chunk, V/t] array of the loss at a time, and
# per element of the embedding table and LM head their float32 gradient and the bf16 cast it gathers
# (llama_1b fsdp 8 on 8 H100 and cola_7b fsdp 8 remat lowrank on 8 A100 40GB, deviceless, read from
# XLA's buffer assignment: f32[16384, 32000], benchmarks/RESULTS.md 2026-11-27 (third)). Unpipelined
# steps only: the pipelined plans stay priced with LOGIT_BUFFERS, as their terms were fitted (the
# circular llama_1b step of tests/test_aot.py stacks 6.0 GB of tick-loop activations against the 4.5
# priced, which the three buffers make up for: 0.87 of its compile with one, 0.93 with three).
GPU_LOGIT_BUFFERS = 1
# XLA packs the step's temporaries into one allocation (memory_analysis().temp_size_in_bytes), which
# exceeds the bytes live at its peak (its live-range report: 1.11-1.25x over the plans of
# benchmarks/planner_memory.py). FITTED: 1.10 x the live temporaries this model counts puts that
# benchmark's btp cola plan (d 256, 3 layers, mesh 1x2x2, CPU compiler, float32) on its
# memory_analysis. Parameters and optimizer state are arguments, allocated as they are.
BUFFER_OVERHEAD = 1.10
# XLA:GPU's packing, (one kind of parallelism, several): with every array counted, a step that shards
# one way (batch over data x fsdp, or tensor, or pipeline, or context alone) allocates what is live
# (llama_1b fsdp 8 on 8 H100: 58.9 GB allocated, 59.8 in the live-range report's sum; llama_7b megatron
# and cola_7b btp on tensor 8 at batch 8 x seq 2048 and BOOST's LLaMA-7B-shaped BTP on tensor 4 are
# within 6% of the planner's count without an overhead); where two meet, the many differently shaped
# buffers leave gaps (llama_1b megatron-SP fsdp 16 x tensor 4 on 64 A100 40GB: 9.6 GB allocated, 7.9
# live; cola_7b btp f16 x t4 remat lowrank: 8.4 against 5.1, benchmarks/RESULTS.md 2026-11-27 (third)).
# FITTED 1.15 for those with the GPU counts of partitions.py, over the 47 deviceless rows of
# benchmarks/aot_fit{,_a100,_nopipe,_fixed}.json (2026-11-27 (fifth)).
GPU_BUFFER_OVERHEAD = (1.0, 1.15)
# The optimizer update: the step checks that every updated weight is finite before it keeps any, so
# the new parameters and moments live next to the gradient and the old state. FITTED: 9 bytes per
# local parameter beyond the gradient puts the compiled cola_7b step (32 layers, batch 4 x seq 128,
# mesh 2x2x2 or 1x2x2, where this phase is the peak) within 6% of its memory_analysis.
OPTIMIZER_TEMP = 9
# A layer's backward (without remat) holds gradients of its activations next to what is kept: FITTED:
# 0.7 x the layer's kept set puts the compiled btp step at 7B widths (tests/test_planner.py's top
# plan, 1x1x2x4) within 1%; its other plans are held out.
BACKWARD_LIVE = 0.7
# remat.pipeline=stage under remat.policy=none: a tick's backward holds the recomputed chunk's kept
# activations, one layer's backward and, when the chunk has more than one layer (its layers run as a
# scan), one more layer's kept set. FITTED: 1 layer puts the compiled
# 2-stage steps of tests/test_planner_pipeline.py (btp, pipeline 2 x data 2 x tensor 2 and pipeline 2 x
# fsdp 2 x tensor 2, 2 layers per stage) within 6% of memory_analysis; their other policies are held out.
STAGE_COPY = 1.0
# The circular schedule without stage remat holds more than GPipe at the same layers per stage (the
# stage copies in both layouts, their gradient before it is reordered back, the per-tick chunk
# selections XLA keeps around the loop): FITTED 3.0 stage-weight copies (float32, gathered size) put
# the compiled circular steps (V 2, pipeline 2 x data 2 x tensor 2 and pipeline 2 x data 2 x fsdp 2,
# remat none) within 1% and 7% of memory_analysis; held out: pipeline 2 x fsdp 2 x tensor 2 (V 2) and
# pipeline 2 x data 2 x tensor 2 (V 3), within 6% and 1% (tests/test_planner_pipeline.py). Under stage
# remat the compiled circular step holds less than GPipe (lowrank + stage, p2 x f2 x t2: 7.8 MB against
# GPipe's 10.1 MB at 2 layers per stage), and no such term is added. The float32 program's only: the
# GPU program's (bf16 compute) per-tick chunk copies are priced as they are kept there (search.py,
# `tick_weights`).
CIRCULAR_COPIES = 3.0
# 1F1B (boost_jax/parallel/pipeline.py) keeps C.ring_slots items per stage, and a tick holds more:
# the one its forward produces before it is filed in the ring and the one its backward reads out of
# it (a slice the branch takes as an operand). The float32 CPU program: 2, counted (the compiled steps
# of tests/test_planner_pipeline.py, pipeline 2 x data 2 x tensor 2 and pipeline 2 x fsdp 2 x tensor 2,
# 2 layers per stage, remat none, keep 3 items of 1.5 MB in the ring and fit in XLA's temporaries
# like GPipe's 5 ticks). The GPU program (bf16): FITTED 3, which puts the deviceless H100 compiles of
# the planner's 1F1B picks for cola_13b and llama_13b on 32 and 64 H100s (benchmarks/RESULTS.md
# 2026-11-27 (sixth)) within 6% (0.94-1.00; with 2, 0.90-0.97).
F1B_IN_FLIGHT = 2
F1B_IN_FLIGHT_GPU = 3
# XLA's collective pipeliner (boost_jax/xla_gpu_flags.py PIPELINED: the project's GPU flags
# turn it on; jaxlib >= 0.11 has retired it) on an unpipelined FSDP plan of a σ(A·x) bottleneck kind
# (cola) without remat: the deviceless H100 compiles of benchmarks/aot_fit.py peak 8-39% higher than
# with its options off (benchmarks/aot_fit_nopipe.md); llama's move by at most 1%, pipelined plans are 1-8% lower.
# Switching the options off one at a time (cola_1b fsdp 8): all-gather off 57.1 GB, all-reduce off
# 58.5, against 62.6 with all on and 57.3 with all off; reduce-scatter off changes nothing (62.6). What
# it is, read from XLA's buffer assignment (benchmarks/RESULTS.md 2026-11-27): cola_7b fsdp 8 keeps 16
# more stacked r-wide arrays [L, T, r] of the bottleneck (2.3 per A output) and the stacked gathered
# bf16 weights twice; cola_1b fsdp 8 and cola_7b fsdp 16 x tensor 4 keep the same arrays live at their
# peaks as without the options (55.8 vs 55.3 GB; 43.6 vs 43.5 GB), but XLA packs them into 12% and 35%
# more memory than is live (at the top of the latter's allocation: the backward's transposed copies of
# the stacked residuals). Priced as more stacked arrays of the bottleneck's A outputs: FITTED 3.0
# arrays per A output, the count that puts the most of the 47 deviceless rows of
# benchmarks/aot_fit{,_a100,_nopipe,_fixed}.json within 10% with the GPU counts of partitions.py,
# GPU_LOGIT_BUFFERS, SCAN_DOUBLE_BUFFER and GPU_BUFFER_OVERHEAD (re-fitted with them, 2026-11-27 (fifth);
# 2.0 before, when the GPU counts left out the replicated norm's float32 arrays).
PIPELINED_SIGMA = 3.0
# XLA's while-loop double buffering (the project's GPU flags: the layer scan unrolled x2) keeps one more
# copy of a stacked residual of the unpipelined layer scan without remat: llama_1b fsdp 8 on 8 H100
# holds a double_buffer_clone of the SwiGLU product bf16[24, T, 5472] beside the 5 it stacks, llama_1b
# fsdp 16 x tensor 4 (sequence parallel) on 64 A100 40GB one of bf16[24, T, 5472/4] (benchmarks/
# RESULTS.md 2026-11-27 (third)). Priced as one [layers, T, ff/t] array in the compute dtype, on GPU
# steps compiled with the flag (double_buffering()).
SCAN_DOUBLE_BUFFER = 1.0
# the options it takes (all-gather or all-reduce off removes the extra; see above)
PIPELINER_NEEDS = ("xla_gpu_enable_pipelined_all_gather", "xla_gpu_enable_pipelined_all_reduce")


def pipeliner(pipelined: bool | None = None) -> bool:
    """Whether the GPU program compiles with the collective pipeliner PIPELINED_SIGMA prices:
    `pipelined` when given (Options.pipelined), else what boost_jax/xla_gpu_flags.py says
    this process's GPU steps get (the project's flags, XLA_FLAGS' overrides, the installed jaxlib)."""
    if pipelined is not None:
        return pipelined
    from boost_jax.xla_gpu_flags import pipelined as options_on

    return set(PIPELINER_NEEDS) <= options_on()


def double_buffering(on: bool | None = None) -> bool:
    """Whether the GPU program's layer scan is double-buffered (SCAN_DOUBLE_BUFFER prices it): `on`
    when given (Options.double_buffered), else what boost_jax/xla_gpu_flags.py says this
    process's GPU steps get (the project's flags, XLA_FLAGS' override)."""
    if on is not None:
        return on
    from boost_jax.xla_gpu_flags import double_buffered

    return double_buffered()


def buffer_overhead(gpu: bool, mixed: bool) -> float:
    """The allocation over the live temporaries: BUFFER_OVERHEAD for the float32 (CPU) program, else
    GPU_BUFFER_OVERHEAD by whether the step mixes kinds of parallelism (two or more of data x fsdp,
    tensor, pipeline and context)."""
    return GPU_BUFFER_OVERHEAD[mixed] if gpu else BUFFER_OVERHEAD


def remat_policies() -> tuple[str, ...]:
    """The remat policies the planner prices, in search order (boost_jax/model/remat.py PRICED)."""
    from boost_jax.model.remat import PRICED  # imports jax (the model package): not at import time

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


def st_seconds(st: StMatmul, cluster: Cluster, act_bytes: int) -> tuple[float, float]:
    """(forward, backward) of P(n x n): each phase is n local GEMMs whose n-1 one-hop permutes run
    under the GEMMs (double-buffered), so a step costs max(GEMM, its two transfers)."""
    n = st.n
    step = gemm_seconds(st.m, st.k / n, st.out / n, cluster)  # st.m: this device's tokens already
    colls = st.colls()  # [skew I, skew W] + per step (fwd 2, dI 2, dW 2) + [unskew dI, dW back]
    seconds = lambda cs: sum(coll_seconds(c, cluster, act_bytes) for c in cs if c.elements)  # noqa: E731
    skew, unskew = seconds(colls[:2]), seconds(colls[-2:])
    pairs = [colls[2 + 6 * s: 8 + 6 * s] for s in range(n - 1)]

    def phase(j: int) -> float:
        return step + sum(max(step, seconds(p[j:j + 2])) for p in pairs)

    return skew + phase(0), phase(2) + phase(4) + unskew


def attention_kind(name: str, block, seq: int, act_bytes: int) -> str:
    """The cost class (boost_jax/model/attention.py COST_CLASSES) that `model.attention = name`
    registered, i.e. how it runs on a GPU of the cluster: `auto` resolves as the trainer does
    (`auto_impl`) for a GPU in the compute dtype act_bytes stands for."""
    from boost_jax.model import attention  # imports jax: once per search, not per plan

    if name not in attention.names():
        raise ValueError(f"--attention: {name!r} is not one of {attention.names()}")
    if name == "auto":
        name = attention.auto_impl(on_gpu=True, half=act_bytes == 2, head_dim=block.head_dim, queries=seq, keys=seq)
    return attention.cost_class(name)


def attention_seconds(a: Attn, kind: str, cluster: Cluster) -> tuple[float, float]:
    """(forward, backward) of causal attention on this device, as its cost class `kind` (a name of
    boost_jax/model/attention.py COST_CLASSES) describes it."""
    c = attention_class(kind)
    flops = 4 * a.queries * a.keys * a.head_dim * a.heads  # q·kᵀ and p·v over every key
    if c.fused:  # skips masked blocks; the busiest token block sets the pace
        fwd = 0.5 * flops * a.imbalance / (cluster.peak_flops * cluster.flash_efficiency)
        return fwd, c.backward * fwd
    gemm = flops / (cluster.peak_flops * gemm_efficiency(a.queries, a.head_dim, min(a.keys, c.block or a.keys),
                                                         cluster))
    traffic = a.queries * a.keys * a.heads / cluster.hbm_bandwidth
    if not c.block:
        return gemm + c.score_bytes[0] * traffic, c.backward * gemm + c.score_bytes[1] * traffic
    blocks = -(-a.keys // c.block)
    visible = (blocks + 1) / (2 * blocks) * a.imbalance  # the diagonal blocks are computed whole
    return (visible * (gemm + c.score_bytes[0] * traffic),
            visible * (c.backward * gemm + c.score_bytes[1] * traffic))


# ---------------------------------------------------------------- one operator

@dataclasses.dataclass
class Cost:
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
        return ([g for g in gemms if g.tag != "A"], [s for s in op.st if s.tag != "A"], op.attn is not None,
                [c for c in fwd if not c.saved])
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
    return sum(hops_exposed([c for c in op.colls if c.phase == phase], a, cluster, act_bytes)
               for phase, a in zip(("fwd", "bwd"), attn))


def hops_exposed(colls: list, attention_s: float, cluster: Cluster, act_bytes: int) -> float:
    """What the ring hops among `colls` (one direction's) take beyond the (C-1)/C of `attention_s`
    they run under (see ring_exposed)."""
    hops = [c for c in colls if ring_permute(c)]
    if not hops:
        return 0.0
    c = hops[0].size
    return max(0.0, sum(coll_seconds(h, cluster, act_bytes) for h in hops) - (c - 1) / c * attention_s)


def price(op: Op, cluster: Cluster, policy: str = "none", attention: str = "materialized",
          act_bytes: int = 2) -> Cost:
    """Forward + backward (+ recompute) time of one operator on one device. `attention`: one of
    attention cost classes (see attention_kind)."""
    gemm = [gemm_seconds(g.m, g.k, g.n, cluster) for g in op.gemms]
    st = [st_seconds(s, cluster, act_bytes) for s in op.st]
    attn = attention_seconds(op.attn, attention, cluster) if op.attn else (0.0, 0.0)
    elementwise = cluster.elementwise_passes * op.acts * act_bytes / cluster.hbm_bandwidth
    cost = Cost(compute=op.gemm_passes * sum(gemm) + sum(map(sum, st)) + sum(attn) + elementwise,
                comm=sum(coll_seconds(c, cluster, act_bytes) for c in op.colls if not ring_permute(c))
                + ring_exposed(op, attn, cluster, act_bytes),
                kept=cluster.kept_passes * saved_bytes(op, policy, act_bytes) / cluster.hbm_bandwidth
                if cluster.kept_passes else 0.0)
    if policy != "none":
        g_re, st_re, attn_re, c_re = recomputed(op, policy)
        cost.recompute = (sum(gemm_seconds(g.m, g.k, g.n, cluster) for g in g_re)
                          + sum(st_seconds(s, cluster, act_bytes)[0] for s in st_re) + attn[0] * attn_re
                          + elementwise / 3 * op.recompute
                          + sum(coll_seconds(c, cluster, act_bytes) for c in c_re if not ring_permute(c))
                          # the re-run forward's ring hops overlap its attention as the forward's do
                          + hops_exposed(c_re, attn[0] * attn_re, cluster, act_bytes))
    return cost


# ---------------------------------------------------------------- memory

def saved_bytes(op: Op, policy: str, act_bytes: int = 2) -> float:
    """Activation bytes this operator keeps for the backward under a remat policy (one micro-batch)."""
    if policy == "full":
        return 0.0
    if policy == "lowrank":
        return op.saved_lowrank * act_bytes
    return op.saved * act_bytes + op.saved32 * 4


def backward_working(ops: list, policy: str, act_bytes: int) -> float:
    """Bytes one layer's backward holds besides what is kept for it: the gradients of its
    activations (BACKWARD_LIVE x its kept-without-remat set), or under remat its recomputed
    activations (the whole set), plus st's received ring blocks."""
    layer = sum(saved_bytes(op, "none", act_bytes) for op in ops)
    return layer * (BACKWARD_LIVE if policy == "none" else 1.0) + sum(op.ring for op in ops) * act_bytes


def table_bytes(fsdp: int, act_bytes: int) -> float:
    """Bytes per element of the embedding table and LM head live around the loss: the float32
    gradient at full (gathered) size and the FSDP-gathered float32 copy (float32 program), or the
    gradient and the compute-dtype cast, which the GPU program gathers (GPU_LOGIT_BUFFERS)."""
    if act_bytes != STATE_BYTES:
        return STATE_BYTES + act_bytes
    return STATE_BYTES + (STATE_BYTES if fsdp > 1 else 0)


def loss_bytes(rows: float, seq: int, chunk: int, vocab_local: float, gpu: bool = False) -> float:
    """The loss's float32 [rows, chunk, V/t] buffers (one chunk of positions at a time; chunk 0 or
    >= seq: the whole sequence). rows: sequences of the micro-batch on this device. `gpu`: the
    bf16-compute program's count (GPU_LOGIT_BUFFERS), else LOGIT_BUFFERS."""
    positions = seq if not 0 < chunk < seq else chunk
    return (GPU_LOGIT_BUFFERS if gpu else LOGIT_BUFFERS) * rows * positions * vocab_local * 4


PIPELINE_SCHEDULES = ("gpipe", "circular", "1f1b")  # parallel.pipeline_schedule
STAGE_REMAT = ("none", "stage")  # remat.pipeline


def pipeline_ticks(stages: int, microbatches: int, repeats: int = 1) -> int:
    """Ticks of one pass: GPipe M + S - 1; circular (V chunks per stage, V rounds of the ring)
    V M + S - 1. Every tick every stage runs one chunk of L/(S V) layers."""
    return repeats * microbatches + stages - 1 if stages > 1 else 1


def handover_ticks(stages: int, microbatches: int, repeats: int = 1, schedule: str = "gpipe") -> int:
    """Ticks that hand over (one collective-permute each way per tick): the pass's ticks; 1F1B's lockstep
    ticks each run at most one forward and one backward, V M + V S + S - 2 of them, whose compute adds
    up to V M + S - 1 ticks of both (its warm-up ticks run forwards only, its last ones backwards only;
    = boost_jax.parallel.pipeline.ticks_1f1b)."""
    if schedule == "1f1b" and stages > 1:
        return repeats * microbatches + repeats * stages + stages - 2
    return pipeline_ticks(stages, microbatches, repeats)


def ring_slots(stages: int, repeats: int = 1, reread_first: bool = True) -> int:
    """1F1B's kept items per stage (= boost_jax.parallel.pipeline.ring_slots): one more than the longest
    wait of an item between its forward and its backward, 2(S-1-s) + 2(V-1-v)S ticks at stage s for
    chunk v; `reread_first` (stage remat): stage 0's first chunk is read from the pass's input again."""
    delay = repeats * stages + stages - 2
    waits = [(repeats - 1 - 2 * v) * stages + delay - 2 * s for s in range(stages) for v in range(repeats)
             if not (reread_first and s == 0 and v == 0)]
    return 1 + max(waits + [0])


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The idle share of the ticks, (S-1)/(V M + S-1) (V = 1: GPipe's (S-1)/(M+S-1); 1F1B's as well,
    = boost_jax.parallel.pipeline.bubble_fraction, which imports jax)."""
    return (stages - 1) / (repeats * microbatches + stages - 1)


def state_bytes(params: float, grad_accum: int) -> float:
    """Parameters, gradients and AdamW moments (fp32), plus the accumulator when accumulating."""
    return params * (ADAM_STATE_BYTES + (ACCUM_BYTES if grad_accum > 1 else 0))
