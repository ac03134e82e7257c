"""The layer's cores, run in whatever layout they are fed: causal attention (with parallel.context's
K/V exchange) and the MLP activation."""

from __future__ import annotations

from boost_jax.planner.ops.kept_arrays import (
    GPU_GATE_PRODUCT,
    GPU_SAVED_SWIGLU,
    GPU_UNROLLED_ATTENTION,
    GPU_UNROLLED_ATTENTION_MEGATRON,
    GPU_UNROLLED_SWIGLU,
    RING_SCORE_BLOCKS,
    SAVED_SWIGLU,
)
from boost_jax.planner.ops.operators import (
    Attn,
    Coll,
    Ctx,
    Gemm,
    Op,
    attention_class,
    divides,
    gpu,
    kernels_in_gemms,
    rope_in_gemm,
)


def attention(ctx: Ctx, layout: str) -> Op | None:
    """Causal attention fed q, k, v in `layout` (None where it cannot run). Token splits gather the
    keys and values of the whole sequence and carry the causal imbalance. Under parallel.context the
    sequence is already split (load-balanced: no imbalance) and the context exchange joins it
    (`context_exchange`); the trainer's attention then runs on whole heads or features only."""
    b = ctx.block
    fs, ts = ctx.splits(layout)
    if layout == "P" or not divides(fs, b.heads, b.kv_heads) or not divides(ts, ctx.seq):
        return None
    if ctx.context > 1 and ts > 1:
        return None
    q, kv = b.heads * b.head_dim, b.kv_heads * b.head_dim
    op = Op(f"attention@{layout}")
    # rotated q, k (by the q and k σ kernels where they rotate them: no RoPE kernel) and the output
    op.acts = ctx.local(layout, q if rope_in_gemm(ctx) else 2 * q + kv)
    gathered = 0.0
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
    op.saved = ctx.local(layout, 2 * q + 2 * kv + (c.kept - 4) * q) + gathered
    rows = op.attn.queries * op.attn.heads
    if c.kept_scores:
        op.saved32 = c.kept_scores * rows * ctx.seq
        op.saved += rows * ctx.seq if ctx.act_bytes != 4 else 0.0
    else:
        op.saved32 = rows
    if ctx.context > 1:
        context_exchange(ctx, op, fs)
    elif gpu(ctx) and ctx.t > 1 and not b.factored:  # an unrolled Megatron layer: q, k, v and the output
        op.kept_unrolled = (op.saved - (c.kept - GPU_UNROLLED_ATTENTION_MEGATRON) * ctx.local(layout, q), op.saved32)
    elif gpu(ctx):  # the memory of an unrolled stack (kept_arrays.GPU_UNROLLED_ATTENTION)
        more = GPU_UNROLLED_ATTENTION if ctx.t > 1 or not b.factored else 0
        op.kept_unrolled = (op.saved + more * ctx.local(layout, q), op.saved32)
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
    from boost_jax.parallel.context import layer_exchange  # lazy: imports jax; once per pricer (memoised ops)

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


def activation(ctx: Ctx, layout: str) -> Op | None:
    """The MLP's σ(gate)·up (or gate·up) in `layout`: elementwise, no communication."""
    fs, _ = ctx.splits(layout)
    if layout == "P" or ctx.block.ff % fs:
        return None
    width = ctx.local(layout, ctx.block.ff)
    op = Op(
        f"act@{layout}",
        acts=width * (1 if ctx.block.only_lr_act else 2),
        saved=width * (GPU_SAVED_SWIGLU if gpu(ctx) else SAVED_SWIGLU)[ctx.block.only_lr_act],
        kept_unrolled=(width * GPU_UNROLLED_SWIGLU, 0.0) if gpu(ctx) else None,  # the memory of an unrolled stack
    )
    # the gate product inside the down GEMM, where d_ff is whole (model/transformer.py MLP: a shard of
    # d_ff falls back to the gate kernel): the product is not kept (kept_arrays.GPU_GATE_PRODUCT)
    if kernels_in_gemms(ctx)[0] and fs == 1:
        op.kept = (op.saved - GPU_GATE_PRODUCT * width, 0.0)
        op.kept_unrolled = (width * (GPU_UNROLLED_SWIGLU - GPU_GATE_PRODUCT), 0.0)
        # no elementwise kernel: the down GEMM's prologue forms the product, its input gradient's
        # epilogue the two gradients (kernels/gated_gemm.py; their traffic: cost.gated_gemm_seconds)
        op.acts = 0.0
    return op
