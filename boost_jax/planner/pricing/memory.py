"""A plan's peak memory per device, by term: optimizer states, kept weights and activations, the
pipeline's buffers, the GPU program's stacked arrays, the transient peak and the allocator's overhead."""

from __future__ import annotations

import dataclasses

from boost_jax.config import PROJECTION_GROUPS, ST, weights_cast_once
from boost_jax.kernels.norm_choice import choose_norm
from boost_jax.parallel.pipeline.arithmetic import ring_slots
from boost_jax.planner.ops import operators
from boost_jax.planner.ops.strategy_tables import strategy_layers
from boost_jax.planner.pricing import cost
from boost_jax.planner.pricing.plans import Layer, Mesh
from boost_jax.planner.pricing.pricer import LayerSummary, Pricer
from boost_jax.planner.pricing.schedule import Schedule

# Bytes per local parameter the optimizer update holds beyond the gradient where no accumulation loop
# runs (grad_accum 1, unpipelined; cost.OPTIMIZER_TEMP elsewhere): read from the live ranges of the
# llama_13b data 8 x tensor 8 Megatron-SP pick's deviceless H100 compile (benchmarks/RESULTS.md
# 2026-11-29, tenth session, h-island)
UPDATE_TEMP_NO_LOOP = 2


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
    stages, staged, per_tick = sched.stages, sched.staged, sched.layers_per_tick
    if stages > 1 and summary.regathered:
        # Pipelined, the sequence-parallel gathers' outputs count as kept: llama_7b's and llama_13b's
        # megatron-SP GPipe plans on p4 x f8 x t2 (benchmarks/aot_fit_nopipe.json) compile 9% over the
        # price without them
        r = summary.regathered
        summary = dataclasses.replace(
            summary,
            saved=summary.saved + r,
            kept_none=summary.kept_none + r,
            working=summary.working + cost.BACKWARD_LIVE * r,
        )
    gpu = operators.gpu(ctx)
    replica, accumulator = gathered_replica(mesh, summary, sched, gpu, policy != "none")
    # 1F1B's kept items per stage (a stage input each under stage remat, else a chunk's kept set)
    f1b_items = ring_slots(stages, sched.repeats, staged) + (cost.F1B_IN_FLIGHT_GPU if gpu else cost.F1B_IN_FLIGHT)
    microbatches = sched.microbatches
    loss = loss_peak(pr, mesh, sched, gpu, rest_fsdp_weights, summary.working)
    residual = ctx.local(layer.residual, block.d)  # one stage input
    memory = {
        "states": cost.state_bytes(params, grad_accum),
        "weights": kept_weights(pr, mesh, summary, sched, gpu),
        # pipelined over data x fsdp: each batch replica's float32 copy of its stage's weights
        # (FSDP: gathered once before the tick loop); its gradient accumulator: see `working`
        "gathered": replica,
        # under autodiff the tick loop keeps every tick's stage activations (the scan's residuals);
        # remat.pipeline=stage keeps only each tick's stage input
        # 1F1B keeps ring_slots items per stage whatever M is
        "activations": (
            f1b_items * (residual * opts.act_bytes if staged else per_tick * summary.saved)
            if sched.f1b
            else sched.ticks * residual * opts.act_bytes
            if staged
            else sched.runs * (summary.saved + fused_add_carry(pr, mesh, sched, gpu) * residual * opts.act_bytes)
        ),
        # the peak's transient part: the loss's float32 logits chunk with the embedding table and
        # LM head as used (FSDP: gathered) and their whole gradients before the fsdp reduction
        # (unpipelined on the GPU under remat: `remat_loss_peak`),
        # or one layer's backward (its recomputed activations under remat, st's and the context
        # ring's buffers), or the optimizer update's new state beyond what the backward kept (then freed)
        "transient": 0.0,
        # the pipelined micro-batches' inputs and outputs ([M, rows/M, T, d] each); 1F1B embeds each
        # micro-batch and runs its head inside the schedule: neither, but the tables (set below)
        "pipeline": 2 * residual * microbatches * opts.act_bytes if stages > 1 and not sched.f1b else 0.0,
        # XLA's collective pipeliner's stacked bottleneck arrays (cost.PIPELINED_SIGMA)
        "pipeliner": pipeliner_arrays(pr, mesh, summary, sched, gpu),
        # the double-buffered layer scan's extra stacked array (cost.SCAN_DOUBLE_BUFFER)
        "double_buffer": double_buffer_array(pr, mesh, grad_accum, summary, sched, gpu),
    }
    copies = layout_copies(pr, mesh, grad_accum, layer, summary, sched, gpu)
    memory["weights"] += copies + step_cast_copy(pr, mesh, grad_accum, layer, summary, sched, rest_fsdp_weights)
    if pr.unrolled and gpu:
        credit = unrolled_credit(pr, mesh, grad_accum, layer, summary, sched, params, memory["states"], copies)
        memory["activations"] = max(memory["activations"] - credit, 0.0)
    kept = memory["weights"] + memory["gathered"] + memory["activations"] + memory["pipeline"]
    # Under stage remat a tick's backward first re-runs one chunk of L/(S V) layers, which keep what
    # the layer policy keeps, then runs their backward one layer at a time.
    # The tick loop's backward also holds each replica's float32 stage-gradient accumulator (under stage
    # remat with FSDP, and one tick's stage weight gradient before it is added).
    stage_copy = cost.STAGE_COPY * summary.kept_none if policy == "none" and per_tick > 1 else 0.0
    working = accumulator + (per_tick * summary.saved + summary.working + stage_copy if staged else summary.working)
    if sched.f1b and gpu:
        # 1F1B embeds and runs the head inside its schedule: the tables as used and their float32
        # gradient accumulators live through the pass, beside the stage's backward
        table = rest_fsdp_weights * cost.table_bytes(mesh.fsdp, opts.act_bytes)
        memory["pipeline"], loss = table, loss - table
        kept += table
    update = cost.OPTIMIZER_TEMP if grad_accum > 1 or stages > 1 else UPDATE_TEMP_NO_LOOP
    memory["transient"] = max(loss, working, params * update - kept)
    arguments = params * (cost.ADAM_STATE_BYTES - cost.STATE_BYTES)  # parameters, Adam m and v
    # XLA's packing: what the counts above miss where a pipeline meets another kind of parallelism (cola
    # 1F1B lowrank on 64 H100s, GPipe and circular plans without remat). Elsewhere the step allocates
    # what they count: cola_7b btp f2 x t4 at seq 2048 (arguments and stacked arrays are the whole peak),
    # llama_1b megatron-SP f16 x t4 and llama_1b 1F1B p4 x d2 x f8 without remat (0.99 and 1.03 of the
    # compile without the gap)
    others = sum(n > 1 for n in (mesh.data * mesh.fsdp, mesh.context, mesh.tensor))
    mixed = stages > 1 and others > 0 and (policy != "none" or not sched.f1b)
    overhead = cost.buffer_overhead(gpu, mixed)
    # circular's stacked float32 chunks are whole buffers, written in place: no packing over them (RESULTS.md
    # 2026-11-29, eleventh session, h-cmem: the circular remat compiles priced with and without it)
    memory["allocator"] = (overhead - 1) * (
        sum(memory.values()) - arguments - remat_chunks(pr, mesh, summary, sched, gpu)
    )
    memory["total"] = sum(memory.values())
    return memory


def unrolled_credit(
    pr: Pricer,
    mesh: Mesh,
    grad_accum: int,
    layer: Layer,
    summary: LayerSummary,
    sched: Schedule,
    params: float,
    states: float,
    copies: float,
) -> float:
    """What the unrolled GPU step's kept-activation counts over-count. Unrolled, each micro-batch's float32
    gradient is written into what the backward frees of the layers' kept activations. The accumulation
    loop's float32 carry is live from the loop's start (llama_1b data 8, cola_7b data 16 x tensor 4,
    llama_13b data 8 x tensor 8 held it at their peaks, the backward's start): on the data-only and BTP
    layers the unrolled counts were read from (kept_arrays.py GPU_UNROLLED_*) the credit takes it too,
    standing for what those counts keep over their programs; a Megatron tensor-split layer (its counts its
    program's) keeps it (benchmarks/RESULTS.md 2026-11-29, ninth session, "the unrolled Megatron-SP pick").
    At grad_accum 1 the data island (data > 1) runs no loop since the tenth session (parallel/grad_reduce.py),
    so no carry: on the data-only and BTP layers those counts' share of it goes too (a one-replica step at
    grad_accum 1 never ran the loop, and its price stays)."""
    grads = states - params * (cost.ADAM_STATE_BYTES - cost.STATE_BYTES)
    grads -= params * cost.STATE_BYTES if copies else 0.0
    column = column_weights(pr, layer, summary) if mesh.tensor > 1 else 0.0
    island = mesh.data > 1 and grad_accum == 1 and sched.stages == 1
    return grads + (params * cost.STATE_BYTES if island and not column else 0.0)


def gathered_replica(mesh: Mesh, summary: LayerSummary, sched: Schedule, gpu: bool, remat: bool) -> tuple[float, float]:
    """(each batch replica's float32 copy of its stage's weights, the float32 bytes its backward holds
    for their gradient): pipelined over data x fsdp, st aside; 0 otherwise. `remat`: a layer remat policy."""
    stages, staged, per_stage = sched.stages, sched.staged, sched.layers_per_stage
    stage32 = 0.0 if summary.grid_w else per_stage * (summary.fsdp_w + summary.norm_w) * cost.STATE_BYTES
    replica = stage32 if mesh.data * mesh.fsdp > 1 and stages > 1 else 0.0
    # one tick's float32 gradient of the weights it ran (a chunk: 1/V of the stage) waits before it is
    # added: under stage remat with FSDP, and under 1F1B, whose backward takes each tick's by `jax.vjp`,
    # on the GPU and with FSDP (the float32 CPU program over data replicas alone adds it in place:
    # tests/test_planner_pipeline.py's 1F1B data_none plan: priced 1.21x its compile with the term),
    # and under GPipe with a layer remat policy and FSDP, whose tick backward writes the stage's gradient
    # into a fresh [L/S] stack before adding it (llama_13b GPipe p4 x f4 x t4 remat full on 64 A100s: the
    # backward's peak holds both, benchmarks/RESULTS.md 2026-11-29, eleventh session, h-cmem)
    gpipe_remat = sched.name == "gpipe" and remat and not staged
    tick = (
        sched.f1b
        and stages > 1
        and (gpu or mesh.fsdp > 1 and replica > 0)
        or ((staged or gpipe_remat) and mesh.fsdp > 1 and replica > 0)
    )
    accumulator = replica + (stage32 / sched.repeats if tick else 0.0)
    if sched.name == "circular" and not staged and gpu and remat:
        # the backward re-runs each layer from its stacked chunk (`remat_chunks`), not from the replica, which
        # dies at the forward's end as the accumulator (the replica's size) is born: one of the two is live
        # at a time (the circular remat compiles of benchmarks/RESULTS.md 2026-11-29, eleventh session,
        # h-cmem, peak at the forward's end, the replica live and no accumulator yet)
        accumulator -= replica
    if sched.name == "circular" and not staged and not gpu:  # the reordered stage copies (cost.CIRCULAR_COPIES)
        accumulator += cost.CIRCULAR_COPIES * per_stage * (summary.fsdp_w + summary.norm_w) * cost.STATE_BYTES
    return replica, accumulator


def kept_weights(pr: Pricer, mesh: Mesh, summary: LayerSummary, sched: Schedule, gpu: bool) -> float:
    """The compute-layout weights kept for the backward: without remat every layer's (FSDP: gathered);
    with it, one layer's gathered weights and gradient, double-buffered."""
    opts, policy, stages, per_stage = pr.opts, pr.policy, sched.stages, sched.layers_per_stage
    weights = gemm_weights(mesh, summary)
    # Pipelined without stage remat, the GPU program (bf16 compute) keeps the compute-dtype copies of
    # the stage's weights its GEMMs read for the backward (the float32 program reads the gathered
    # float32 replica itself): GPipe casts the stage's weights once before the tick loop (loop
    # invariant, hoisted out of the scan) and keeps that copy to the end of the backward; circular
    # selects and casts each tick's chunk inside the loop, so the scan stacks every tick's chunk as a
    # residual, ticks x L/(S V) layers (the deviceless H100 compiles of benchmarks/aot_fit.py: RESULTS.md
    # 2026-11-26, "the planner's memory terms against the compiled programs").
    tick_weights = 0.0
    if stages > 1 and gpu and not sched.staged and policy == "none":
        tick_weights = (sched.runs if sched.name == "circular" else per_stage) * weights * opts.act_bytes
    return (
        tick_weights + remat_chunks(pr, mesh, summary, sched, gpu)
        if stages > 1
        else per_stage * weights * opts.act_bytes
        if policy == "none"
        else 2 * summary.fsdp_w * cost.STATE_BYTES
        if mesh.fsdp > 1
        else 0.0
    )


def remat_chunks(pr: Pricer, mesh: Mesh, summary: LayerSummary, sched: Schedule, gpu: bool) -> float:
    """The float32 chunks a circular GPU tick loop stacks under a layer remat policy (full, lowrank) without
    stage remat: each tick selects its chunk of the stage's float32 weights (L/(S V) layers, the norm
    scales with them) and hands it to the layers, which cast it inside their checkpoint, so the scan keeps
    the selected float32 chunk as a residual, ticks x L/(S V) layers of it (f32[ticks, L/(S V), 1, d, ff/t]
    and its siblings in XLA's memory-usage report of circular remat plans on 64 A100s: benchmarks/RESULTS.md
    2026-11-29, eleventh session, h-cmem). GPipe's stage weights are loop invariant (not stacked);
    remat.pipeline=stage re-selects the chunk in the tick's backward. The float32 CPU program's circular
    copies are cost.CIRCULAR_COPIES's (`gathered_replica`)."""
    if not (gpu and sched.name == "circular" and sched.stages > 1 and not sched.staged and pr.policy != "none"):
        return 0.0
    return sched.runs * (gemm_weights(mesh, summary) + summary.norm_w) * cost.STATE_BYTES


def gemm_weights(mesh: Mesh, summary: LayerSummary) -> float:
    """One layer's weights as its GEMMs read them (FSDP: gathered; st's grid: its own shard)."""
    return summary.fsdp_w + summary.grid_w / mesh.fsdp


def layout_copies(
    pr: Pricer, mesh: Mesh, grad_accum: int, layer: Layer, summary: LayerSummary, sched: Schedule, gpu: bool
) -> float:
    """Float32 copies of the stacked column-parallel weights (Megatron's qkv and mlp_in, split by their
    outputs over tensor) in the layout their GEMMs read: in the unrolled GPU step inside its
    accumulation loop (grad_accum > 1), XLA's layout assignment takes the layout the
    layers' GEMMs want for the loop-invariant stacked float32 parameters and transposes each once
    before the loop (`wrapped_transpose`, f32[out/t, L, d]); the copies live to the backward's end.
    The row-parallel weights (o, mlp_out) and BTP's layers keep their own layout, and a step without
    the loop (grad_accum 1, the data island's too) copies none (llama_13b data 8 x tensor 8 Megatron-SP
    held q, k, v, gate and up so inside the island's loop at grad_accum 1, which no longer runs one;
    cola_7b data 16 x tensor 4 BTP and llama_1b data 8 none: benchmarks/RESULTS.md 2026-11-29)."""
    if not (pr.unrolled and gpu and sched.stages == 1 and mesh.tensor > 1 and grad_accum > 1):
        return 0.0
    return sched.layers_per_stage * column_weights(pr, layer, summary) * cost.STATE_BYTES


def column_weights(pr: Pricer, layer: Layer, summary: LayerSummary) -> float:
    """One layer's weights (elements per tensor shard) in the groups `layer` splits by their outputs
    alone (Megatron's qkv and mlp_in; none under BTP), read from the strategy tables."""
    block = pr.ctx.block
    tables = {t.name: t for t in strategy_layers(block.factored, block.online_norm)}

    def by_outputs(group: str, choice: str) -> bool:  # the group's weights split by their outputs alone
        split = tables[choice].splits[PROJECTION_GROUPS.index(group)] if choice in tables else None
        return split is not None and (split.first, split.second)[block.factored] == "out" and split.first != "in"

    choice = dict(zip(PROJECTION_GROUPS, layer.choices))
    column = {g for g in ("qkv", "mlp_in") if by_outputs(g, choice[g])}
    return sum(op.weights for op in summary.ops if op.name.split(":")[0] in column)


def step_cast_copy(
    pr: Pricer, mesh: Mesh, grad_accum: int, layer: Layer, summary: LayerSummary, sched: Schedule, rest: float
) -> float:
    """The compute-dtype copy of the weights the train step casts once per step, before its micro-batches
    (config/schema.py `weights_cast_once`, runtime/state.py `step_casts`): every weight the model uses only in the
    compute dtype (the layers' matrices, the embedding and head: not the norm scales), in its stored
    layout, live through the accumulation loop. None under a pipeline or spatial-temporal GEMMs, none
    that `fsdp` gathers (with fsdp > 1 every matrix), none in a float32 program."""
    block = pr.ctx.block
    if not (operators.gpu(pr.ctx) and weights_cast_once(block.weight_casts, block.factored, grad_accum)):
        return 0.0
    if sched.stages > 1 or mesh.fsdp > 1 or ST in layer.choices:
        return 0.0
    return (sched.layers_per_stage * summary.fsdp_w + rest) * pr.opts.act_bytes


def pipeliner_arrays(pr: Pricer, mesh: Mesh, summary: LayerSummary, sched: Schedule, gpu: bool) -> float:
    """The σ(A·x) bottleneck arrays XLA's collective pipeliner makes the scanned layers keep more of."""
    opts, per_stage = pr.opts, sched.layers_per_stage
    # Unpipelined FSDP without remat, XLA's collective pipeliner (when the GPU program gets it) makes
    # the scanned layers keep more stacked arrays of the σ(A·x) bottleneck (cost.PIPELINED_SIGMA). Pipelined
    # plans gather their stage once before the tick loop, so it has no per-layer gather to move there.
    # Not with context parallelism: the README's cola_13b seq-32k plan (fsdp 4 x context 8 x tensor 2,
    # ring, bottleneck) compiles with the pipeliner under what the planner prices without the term
    # (RESULTS.md 2026-11-27, "the collective pipeliner's memory"). Nor on a tensor-split (online-norm) layer:
    # cola_7b btp f2 x t4 at seq 2048 stacks one more bf16 qkv A output and one float32 copy of it fewer
    # (RESULTS.md 2026-11-29).
    return (
        cost.PIPELINED_SIGMA * per_stage * summary.bottleneck * opts.act_bytes
        if sched.stages == 1
        and mesh.fsdp > 1
        and mesh.context == 1
        and mesh.tensor == 1
        and gpu
        and pr.policy == "none"
        and summary.bottleneck
        and cost.pipeliner(opts.pipelined)
        else 0.0
    )


def double_buffer_array(
    pr: Pricer, mesh: Mesh, grad_accum: int, summary: LayerSummary, sched: Schedule, gpu: bool
) -> float:
    """The GPU program's double-buffered layer scan (when the program gets the flag; an unrolled stack
    has no scan to double-buffer), unpipelined: without remat it keeps one more stacked [layers, T,
    ff/t] array (cost.SCAN_DOUBLE_BUFFER). Under remat lowrank on a tensor-split σ(A·x) layer XLA can
    give the stack of the widest A output (qkv's, all-reduced over tensor) a second buffer, one per copy
    of the loop body (A100 cola_13b btp f16 x t4: `loop_dynamic_update_slice_fusion.1` and its
    `double_buffer_clone`, bf16[L, 3r, T] at two offsets in XLA's memory-usage report); some such
    programs share one buffer (H100 cola_7b f16 x t4), and which do is not modelled: the term counts
    the second buffer, an upper bound (benchmarks/RESULTS.md 2026-11-29, "the planner's picks now"), but
    in the data island's step at grad_accum 1 (parallel/grad_reduce.py: the layer scan vmapped over the
    data replicas), whose clones share the one buffer (H100 cola_7b and cola_13b data 8 x fsdp 4 x tensor 2:
    RESULTS.md 2026-11-29, eleventh session, h-mem2)."""
    ctx, opts = pr.ctx, pr.opts
    if sched.stages > 1 or not gpu or not opts.double_buffered or pr.unrolled:
        return 0.0
    layers = sched.layers_per_stage
    if pr.policy == "none":
        return cost.SCAN_DOUBLE_BUFFER * layers * ctx.tokens * ctx.block.ff / mesh.tensor * opts.act_bytes
    widest = max((op.bottleneck for op in summary.ops), default=0.0)
    island = mesh.data > 1 and grad_accum == 1 and not summary.grid_w
    if pr.policy == "lowrank" and mesh.tensor > 1 and widest and not island:
        return cost.SCAN_DOUBLE_BUFFER * layers * widest * opts.act_bytes
    return 0.0


def loss_peak(
    pr: Pricer, mesh: Mesh, sched: Schedule, gpu: bool, rest_fsdp_weights: float, working: float = 0.0
) -> float:
    """The loss's float32 logits chunk with the embedding table and LM head as used (FSDP: gathered) and
    their gradients. Pipelined, the loss runs one pipeline micro-batch's rows at a time (model/loss.py
    row_groups); its GPU count is the unpipelined program's only (cost.GPU_LOGIT_BUFFERS). The
    unpipelined GPU step under a remat policy: `remat_loss_peak` (`working`: one layer's backward)."""
    ctx, opts, block = pr.ctx, pr.opts, pr.ctx.block
    if gpu and sched.stages == 1 and pr.policy != "none":
        return remat_loss_peak(pr, mesh, working)
    microbatches = sched.microbatches
    rest_tokens = ctx.tokens * microbatches
    return cost.loss_bytes(
        rest_tokens / ctx.local_seq / microbatches,
        ctx.local_seq,
        block.loss_chunk,
        block.vocab / mesh.tensor,
        gpu and sched.stages == 1,
        opts.act_bytes,
    ) + rest_fsdp_weights * cost.table_bytes(mesh.fsdp, opts.act_bytes)


def remat_loss_peak(pr: Pricer, mesh: Mesh, working: float) -> float:
    """The unpipelined GPU step's loss beside the kept activations, under a remat policy: the head GEMM's
    logits and their cotangent in the compute dtype (model.logits_dtype `compute`, the default) with the
    LM head as used, then the cotangent with the head's float32 gradient at its gathered size, then the
    cotangent (its dW GEMM scheduled late) through the last layer's recomputed backward (`working`). The
    embedding's gradient comes at the backward's end, after the kept activations. Read from the
    deviceless H100 compiles' live ranges of cola_1b data 8 x fsdp 8 (the data island) and cola_7b fsdp
    8, remat lowrank (benchmarks/RESULTS.md 2026-11-29, eleventh session, h-mem2); without remat the
    loss keeps the count above (not read)."""
    ctx, a, block = pr.ctx, pr.opts.act_bytes, pr.ctx.block
    chunk = block.loss_chunk
    positions = ctx.local_seq if not 0 < chunk < ctx.local_seq else chunk
    logits = ctx.tokens / ctx.local_seq * positions * block.vocab / mesh.tensor  # elements, one chunk
    head = block.d * block.vocab / mesh.tensor
    return max(2 * a * logits + a * head, a * logits + cost.STATE_BYTES * head, a * logits + working)


def fused_add_carry(pr: Pricer, mesh: Mesh, sched: Schedule, gpu: bool) -> int:
    """Arrays of the residual stream's width a remat policy keeps per layer beyond the layer input
    (the summary's carry): where the residual adds run inside the norms (kernels/norm_choice.py's
    `fused_add`), a layer hands the next its input and its un-added MLP output, and the scan keeps
    both (benchmarks/RESULTS.md 2026-11-28, "the fused add's second carry")."""
    block = pr.ctx.block
    if not gpu or pr.policy == "none":
        return 0
    choice = choose_norm(
        block.norm_kernel,
        block.residual_norm,
        gpu=True,
        triton=True,  # the GPU programs plans are priced for have jax-triton (the gpu extra)
        mesh=True,
        tensor=mesh.tensor,
        pipeline=sched.stages > 1,
        online_norm=block.online_norm,
        factored=block.factored,
    )
    return int(choice.fused_add)
