"""Between the operators: an activation's redistribution from one layout to another (`edge`), the
RMSNorms and the residual add."""

from __future__ import annotations

from boost_jax.planner.ops.kept_arrays import (
    GPU_KEPT_ONLINE_NORM_INPUT32,
    GPU_SAVED_NORM,
    GPU_SAVED_NORM_XLA,
    SAVED_NORM,
)
from boost_jax.planner.ops.operators import Coll, Ctx, Op, gpu, norm_in_gemm


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
    # An all-reduce (P -> R) hands back the producer's own elements summed: the GEMM that wrote the
    # partial output counts them (its acts), and no kernel but the collective touches them in between
    # (the compiled vanilla / Megatron steps: no elementwise kernel on an all-reduce's output).
    op.acts = 0.0 if (src, dst) == ("P", "R") else ctx.local(dst, width)
    if saves and not (gpu(ctx) and not ctx.block.fused_norm):  # its output is a GEMM's input, kept for
        # the weight gradient (a normalised row gathered); with XLA's norm the GPU program keeps the
        # token shard instead (GPU_SAVED_NORM_XLA["S"])
        op.saved = op.acts
        # The GPU program keeps the token shard with the fused norm too and gathers it again in its
        # backward: no [layers, T, d] in llama_1b / llama_7b megatron-SP f16 x t4's buffers
        # (benchmarks/RESULTS.md 2026-11-29); the time terms still count the pass (`saved`)
        op.kept = (0.0, 0.0) if gpu(ctx) else None
    return op


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
    if fused and gpu(ctx) and ctx.block.fused_norm:  # the online norm's float32 arrays, in memory (scanned)
        op.kept = (op.saved, op.saved32 + GPU_KEPT_ONLINE_NORM_INPUT32 * width)
        op.kept_unrolled = (op.saved, op.saved32)
    if gpu(ctx) and norm_in_gemm(ctx):  # in memory: the GEMM after it normalises the rows it loads, so
        # no normalised rows are kept, only the stream and 1/rms (kernels/norm_gemm.py; the time terms
        # keep their passes)
        op.kept = op.kept_unrolled = ((kept - 1) * width, op.saved32)
    if fs > 1 and not fused:  # the statistics are kept by the lowrank policy: never recomputed
        op.colls = [Coll("all-reduce", ctx.tokens / ts, fs, 1, p, saved=p == "fwd") for p in ("fwd", "bwd")]
    return op


def residual_add(ctx: Ctx, layout: str) -> Op:
    return Op(f"add@{layout}", acts=ctx.local(layout, ctx.block.d))
