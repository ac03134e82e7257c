"""What each operator keeps for the backward, in arrays of its width: the counts read from the compiled
train step (CPU, float32) and from the GPU program (bf16/fp16), and the context ring's score blocks."""

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
GPU_SAVED_ONLINE_NORM32 = 2  # float32 arrays of the A output (what the time terms count)
# BTP's online norm without its local rms, in memory (Op.kept): the scanned stack keeps float32 copies of
# qkv's A output twice, of mlp_in's once, and with a fused norm kernel two float32 arrays of the norm's
# local width per norm (cola_7b btp t8 at seq 2048 stacks f32[L, T, 3, r] x 2, f32[L, T, 2, r] x 1 and
# f32[L, T, d/8] x 4; cola_1b btp circular p2 x d4 x f4 x t2 the same; cola_7b f2 x t4: 1, 1 and 6).
GPU_KEPT_ONLINE_NORM32 = {"qkv": 2, "mlp_in": 1}
GPU_KEPT_ONLINE_NORM_INPUT32 = 2
# What the GPU program keeps in memory where that differs from the counts above (Op.kept_unrolled; the
# time terms keep reading the counts above). The unrolled stack (model.scan_unroll, remat none) lets XLA
# recompute elementwise work in its backward and keeps other arrays (benchmarks/RESULTS.md 2026-11-29: the
# memory reports of llama_1b data 8, cola_1b data 8 and cola_7b tensor 2 at seq 256): no float32 copy of
# BTP's online-norm A outputs; a σ(A·x) bottleneck keeps A's output and σ's, no internals (cola_7b:
# [T, 3r] x 2, [T, 2r] x 2, [T, r] x 2 each for o and mlp_out); the MLP core its gate, up and their
# product (llama_1b [T, 2 ff] + [T, ff]; cola_7b [T, 2 ff/t] in 28 of 32 layers + [T, ff/t]; cola_1b
# 3.2 ff); attention 3 arrays of q's width more than the scanned layer where the layer is dense or
# tensor-split (outside the projections and the MLP llama_1b keeps 12.4 d, cola_7b on tensor 2 12 d/t,
# where the scanned counts give 9; a factored layer on one tensor shard, cola_1b on data 8, 8.9 d).
GPU_UNROLLED_SIGMA = 2
GPU_UNROLLED_SWIGLU = 3
GPU_UNROLLED_ATTENTION = 3
# An unrolled Megatron (dense, tensor-split) layer's attention keeps q, k (rotated), v and the output, and
# none of the counts' further arrays: 4 arrays of q's width where the scanned count (its cost class's
# `kept`) says 5 and the rule above 8 (llama_13b data 8 x tensor 8 and llama_1b data 16 x tensor 4,
# Megatron-SP: per layer bf16[T, q/t] x 4 beside the norms' bf16[T/t, d] x 4 at the peak: benchmarks/
# RESULTS.md 2026-11-29, ninth session).
GPU_UNROLLED_ATTENTION_MEGATRON = 4
# The kernels that read elementwise work into a GEMM (kernels/gated_gemm.py; which of them run: the
# planner's operators.kernels_in_gemms, from the model's own rules), in memory (Op.kept, Op.kept_unrolled;
# benchmarks/RESULTS.md 2026-11-29, "the planner's memory with the kernels in the GEMMs"): with the gate
# product inside the down projection's first GEMM the MLP core keeps its gate and up, not their product:
# one array of width ff fewer (cola_1b on one H100, 64 rows x 256, gate_kernel pallas -> gemm: unrolled
# 43.85 -> 39.62 GB, 0.98 of a [T, ff] array per layer; scanned, remat none, 52.53 -> 48.58 GB, the
# stacked bf16[L, T, ff] 3 -> 2). With σ inside the B GEMMs a σ(A·x) bottleneck keeps A's output alone,
# scanned or unrolled (bottleneck_kernel xla -> gemm: unrolled 39.62 -> 36.80, 1.00 of the layer's A
# outputs [T, 7r] per layer; scanned 48.58 -> 40.20, 2.97 of them; RoPE inside q's and k's moves nothing).
GPU_GATE_PRODUCT = 1
GPU_SIGMA_IN_GEMM = 1
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
