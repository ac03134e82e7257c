"""What runs outside the layer stack: the token embedding, the head and loss, and a pipeline's
hand-overs between stages, its once-per-pass ends and the circular schedule's weight reorder."""

from __future__ import annotations

from boost_jax.planner.ops.edges import edge
from boost_jax.planner.ops.operators import Coll, Ctx, Gemm, Op


def embedding(ctx: Ctx, residual: str) -> Op:
    """Token embedding into the residual layout: a d-split table feeds H without traffic; a
    vocab-split one leaves partial rows that are reduced (R) or reduce-scattered (S)."""
    b = ctx.block
    src = "H" if residual == "H" else "P"
    op = edge(ctx, src, residual, b.d) if ctx.t > 1 else Op("embed")
    op.name, op.weights = f"embed->{residual}", b.vocab * b.d / ctx.t
    return op


def head(ctx: Ctx, residual: str, row_groups: int = 1, grad_ways: int = 1, per_item: bool = False) -> Op:
    """Gather the hidden rows, final norm, vocab-parallel LM head and loss: 3 scalars per token for the
    loss's reductions, and the head's input gradient all-reduced in the backward (over tensor, times
    `grad_ways`: a GPipe or circular pipeline hands every stage the finished micro-batches and sums
    their gradient over pipeline x tensor, one all-reduce, the compiled step's
    `placement.PerShardNorm`). The loss runs in pieces (model/loss.py): chunks of model.loss_chunk
    positions, times `row_groups` (pipelined: one per pipeline micro-batch); each piece reduces its
    own scalars, and a loss in several pieces recomputes each one's logits (the head GEMM: four
    passes), reductions included, in the backward. `per_item` (1F1B): each micro-batch's head and loss
    run by themselves (their own vjp, `one_f_one_b.fused_loss`): the row groups are not pieces of one
    loss, none is recomputed."""
    b, t, m = ctx.block, ctx.t, ctx.tokens
    seq = ctx.local_seq  # under context each device scans its own positions (model/loss.py seq_groups)
    pieces = (-(-seq // b.loss_chunk) if 0 < b.loss_chunk < seq else 1) * row_groups
    op = edge(ctx, residual, "R", b.d)
    op.name = f"{residual}->head"
    op.gemms = [Gemm(m, b.d, b.vocab / t, "head")]
    op.weights = b.d * b.vocab / t + b.d
    if pieces // (row_groups if per_item else 1) > 1:  # the chunked loss recomputes each piece's logits
        op.gemm_passes = 4.0
    if t > 1:
        op.colls = op.colls + [
            Coll("all-reduce", 3 * m / pieces, t, 1, phase)
            for phase in ("fwd",) + ("bwd",) * (pieces > 1)
            for _ in range(pieces)
        ]
    if t * grad_ways > 1:
        op.colls = op.colls + [Coll("all-reduce", m * b.d, t * grad_ways, 1, "bwd")]
    return op


def stage_shift(ctx: Ctx, residual: str, stages: int, stride: int, schedule: str = "gpipe") -> list[Coll]:
    """One tick's pipeline traffic (boost_jax/parallel/pipeline/): every stage's output, the residual
    stream of one pipeline micro-batch in its layout, moves one stage on (a roll over the `pipeline`
    axis: one collective-permute); the backward sends its gradient back, and (GPipe, circular) sums the
    gradient of the micro-batch entering stage 0 over the pipeline axis (the micro-batch buffer it is
    read from is replicated over it: one all-reduce per tick, as the scanned program runs it on the
    CPU, where XLA:GPU sums the M micro-batches' gradient once after the loop: step_terms.gpu_shifts;
    1F1B files it at stage 0 and hands it over once per pass). `stride`: devices per stage (the
    pipeline axis is outermost)."""
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
    """The pipeline's once-per-pass traffic, as GSPMD compiles boost_jax/parallel/pipeline/: the
    last stage hands the M finished micro-batches to every stage for the head (GPipe: a permute and
    an all-reduce, a permute back in the backward; circular: the all-reduce alone, its outputs are
    filed where they are reduced; 1F1B embeds each micro-batch and runs the head inside its ticks:
    nothing)."""
    if stages <= 1 or schedule == "1f1b":
        return []
    done = microbatches * ctx.local(residual, ctx.block.d)
    reduce = [Coll("all-reduce", done, stages, stride, "fwd", "pipeline")]
    if schedule == "circular":
        return reduce
    return (
        [Coll("collective-permute", done, stages, stride, "fwd", "pipeline")]
        + reduce
        + [Coll("collective-permute", done, stages, stride, "bwd", "pipeline")]
    )


def circular_reorder(stage_weights: float, stages: int, repeats: int, stride: int) -> list[Coll]:
    """The circular schedule's once-per-pass weight moves, as GSPMD compiles boost_jax/parallel/pipeline/
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
