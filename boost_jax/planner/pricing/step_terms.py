"""A plan's step beyond its layers' tensor work: the data/fsdp traffic of the weights, the pipeline's
hand-overs and ends, the embedding and head, the step's seconds and the bytes on each link."""

from __future__ import annotations

import dataclasses

from boost_jax.planner.ops.operators import Coll
from boost_jax.planner.ops.outside_stack import circular_reorder, head, pipeline_ends, stage_shift
from boost_jax.planner.pricing import cost
from boost_jax.planner.pricing.plans import Cost, Layer, Mesh
from boost_jax.planner.pricing.pricer import LayerSummary, Pricer
from boost_jax.planner.pricing.schedule import Schedule


def f1b_rest(pr: Pricer, residual: str, mesh: Mesh, microbatches: int, dp_rest: list, rest: list):
    """1F1B's embedding and head traffic (parallel/pipeline/one_f_one_b.py `fused_loss`): the head and loss
    run per micro-batch at the last stage (the head op of one micro-batch's rows, M times), each
    micro-batch is embedded at stage 0, and the head's and the embedding's gradients (each stage and
    replica's float32 part) are all-reduced over pipeline x data x fsdp once per pass.
    -> (dp_rest, [(coll, times)])."""
    head_w = rest[0].weights + rest[1].weights  # the embedding's V d/t, the head's d V/t, the final norm's d
    ways = mesh.data * mesh.fsdp
    dp_rest = [dataclasses.replace(c, elements=c.elements - head_w) if c.kind == "all-reduce" else c for c in dp_rest]
    dp_rest.append(
        Coll(
            "all-reduce",
            head_w,
            mesh.pipeline * ways,
            mesh.tensor,
            "bwd",
            "pipeline_weights" if ways > 1 else "pipeline",
        )
    )
    one = head(pr.ctx, residual, 1)
    return dp_rest, [(c, 1) for c in rest[0].colls] + [(c, microbatches) for c in one.colls]


def gpu_shifts(shifts: list, sched: Schedule) -> list:
    """The tick loop's hand-overs as the GPU program runs them: the scanned step sums the gradient of
    the micro-batch entering stage 0 over `pipeline` every tick (stage_shift: what the CPU program,
    `--verify`, runs), where XLA:GPU moves that all-reduce out of the loop: one all-reduce of the M
    micro-batches' accumulated gradient after it (the compiled GPipe and circular steps' tables)."""
    return [
        (dataclasses.replace(c, elements=c.elements * sched.microbatches), 1) if c.kind == "all-reduce" else (c, t)
        for c, t in shifts
    ]


def data_colls(
    mesh: Mesh,
    fsdp_weights: float,
    other_weights: float,
    remat: str,
    pipelined: bool = False,
    grid_weights: float = 0.0,
    matrices: int = 1,
    seq_split: bool = False,
    copies: bool = False,
    island: bool = False,
) -> tuple[list[Coll], list[Coll], list[Coll]]:
    """Data/fsdp traffic of one layer's parameters (elements per tensor shard) as (once, per_pass, island):
    `once` runs once per layer per accumulation micro-batch, `per_pass` once per layer pass (every
    GPipe tick when pipelined). FSDP gathers the weights before use, in the compute dtype (again in the
    backward when remat recomputes the forward). Each weight gradient is all-reduced over data x fsdp
    in float32 at its gathered size, then sliced to the stored shard (the compiled HLO: GSPMD reduces
    `rules.weight_einsum`'s float32 product in the compute layout), in `matrices` all-reduces (one per
    weight matrix under a tensor axis, one a layer without), the norm scales' in one more (over the
    tensor shards too where the residual is split over them, `seq_split`); the trainer sums
    micro-batch gradients in the parameters' layout, so this happens once per micro-batch.
    Pipelined (boost_jax/parallel/pipeline/, read from its compiled HLO): the stage's weights are
    gathered once before the tick loop, every batch replica accumulates its own float32 gradient over
    the ticks, and that is all-reduced over data x fsdp once per pass, at full size (the accumulator is
    the whole stage's gradient), so both land in `once`; nothing over data/fsdp runs per tick, remat
    included (the gathered copies are the loop's inputs). `copies` (GPipe, circular: gspmd.py's
    `replica_copies`): the copies are made in float32 and gathered so, and their summed gradient goes
    back to the fsdp-split stack by a reduce-scatter where there is no data axis (the compiled step).
    Pipelined st plans keep GSPMD's placement (see pipeline.once_per_pass_axes), priced as below.
    st's weights (`grid_weights`) stay split over fsdp: their gradient, summed over the grid's rows
    by the Cannon schedule, is only all-reduced over data.
    Under parallel.context = C the gradient of every weight (per tensor shard, whole: the compiled
    step all-reduces it over `context` before the fsdp/data reduction, or with it) is all-reduced over
    `context` too, once per micro-batch: context acts like data for the gradients. (Where the mesh
    also has data or fsdp, XLA folds part of the two reductions into one over both axes: the
    separate pricing here is an upper bound on those bytes.)
    `island` (the data-replica island runs: parallel/grad_reduce.py): the per-pass reductions are over
    fsdp only (each replica's gradient), and the third list holds the island's sum over data of the
    stored shard (float32), once per optimizer step: -> (once, per_pass, island)."""
    t, f, d = mesh.tensor, mesh.fsdp, mesh.data
    once, per_pass, reduced = [], [], []
    if island:  # the replicas' gradients, each at its stored shard, summed over data once a step
        reduced.append(
            Coll("all-reduce", fsdp_weights / f + other_weights, d, f * mesh.context * t, "bwd", "data_fsdp")
        )
        d = 1
    if pipelined and not grid_weights:
        if f > 1:
            once.append(Coll("all-gather", fsdp_weights, f, t, "fwd", "data_fsdp", float32=copies))
        if d * f > 1:
            kind = "reduce-scatter" if copies and d == 1 else "all-reduce"
            once.append(Coll(kind, fsdp_weights + other_weights, d * f, t, "bwd", "data_fsdp"))
    else:
        if grid_weights and d > 1:
            per_pass.append(Coll("all-reduce", grid_weights / f, d, f * t, "bwd", "data_fsdp"))
        if f > 1:
            once.append(Coll("all-gather", fsdp_weights, f, t, "fwd", "data_fsdp"))
            if remat != "none":
                per_pass.append(Coll("all-gather", fsdp_weights, f, t, "bwd", "data_fsdp"))
        if d > 1 and f == 1:
            per_pass.append(Coll("all-reduce", fsdp_weights + other_weights, d, t, "bwd", "data_fsdp"))
        elif f > 1:  # each weight gradient all-reduced at its gathered size, one per matrix (see above)
            per_pass += [Coll("all-reduce", fsdp_weights / matrices, d * f, t, "bwd", "data_fsdp")] * matrices
            # the norm scales' gradient: over the token shards too where the residual is split over tensor
            norm_ways = t if seq_split else 1
            per_pass.append(Coll("all-reduce", other_weights, d * f * norm_ways, t // norm_ways, "bwd", "data_fsdp"))
    if mesh.context > 1:  # the weights are replicated over `context`: their gradient is summed over it
        per_pass.append(Coll("all-reduce", fsdp_weights + other_weights, mesh.context, mesh.tensor, "bwd", "data_fsdp"))
    return once, per_pass, reduced


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
    outside: list = dataclasses.field(default_factory=list)  # [(collective, times)] before/after the tick loop
    island: list = dataclasses.field(default_factory=list)  # [(collective, times)]: the data island's, once a step


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
    shift = stage_shift(ctx, layer.residual, stages, mesh.data * mesh.fsdp * mesh.tensor, sched.name)
    ends = pipeline_ends(
        ctx, layer.residual, stages, mesh.data * mesh.fsdp * mesh.tensor, sched.microbatches, sched.name
    )
    if sched.name == "circular" or (sched.f1b and sched.repeats > 1):  # interleaved 1F1B: circular's chunk layout
        stage_weights = sched.layers_per_stage * ((summary.fsdp_w + summary.grid_w) / mesh.fsdp + summary.norm_w)
        ends += circular_reorder(stage_weights, stages, sched.repeats, mesh.data * mesh.fsdp * mesh.tensor)
    # The tick loop is a scan: every tick hands over each way (the last forward one feeds nothing,
    # but the scanned step runs it).
    shifts = [(c, sched.handovers) for c in shift]
    shift_seconds = sum(
        times * cost.coll_seconds(c, cluster, act_bytes) for c, times in gpu_shifts(shifts, sched)
    ) + sum(cost.coll_seconds(c, cluster, act_bytes) for c in ends)

    # The data-replica island (parallel/grad_reduce.py: data > 1, no pipeline, no st grid) sums every
    # gradient over data once per step, after the backward: see island_exposed.
    runs_island = mesh.data > 1 and not pipelined and not summary.grid_w
    data_once, data, island_layer = data_colls(
        mesh,
        summary.fsdp_w,
        summary.norm_w,
        pr.policy,
        pipelined=pipelined,
        grid_weights=summary.grid_w,
        # one all-reduce per matrix where `rules.weight_einsum`'s barrier (a tensor axis) keeps each beside its
        # GEMM; without one XLA's all-reduce combiner merges a layer's
        matrices=summary.matrices if mesh.tensor > 1 else 1,
        seq_split=layer.residual == "S",
        copies=pipelined and not sched.f1b,
        island=runs_island,
    )
    # embedding and head, once (pipelined: their gradient is all-reduced over fsdp too, as compiled)
    rest_once, rest_pass, island_rest = data_colls(
        mesh, rest_fsdp_weights, ctx.block.d, "none", pipelined=pipelined, matrices=2, island=runs_island
    )
    data_rest = rest_once + rest_pass
    rest_colls = [(c, 1) for op in rest for c in op.colls]
    if sched.f1b:  # the head runs per micro-batch at the last stage, its gradient summed over stages and replicas
        data_rest, rest_colls = f1b_rest(pr, layer.residual, mesh, sched.microbatches, data_rest, rest)
    redo = summary.forward_colls if sched.staged else []  # remat.pipeline=stage: the stage's forward, again
    # Pipelined (but st), the stage's gather and gradient reduction run once per optimizer step, not
    # per accumulation micro-batch (boost_jax/parallel/pipeline/): 1/grad_accum of them per micro-batch.
    once = sched.layers_per_stage / grad_accum if pipelined and not summary.grid_w else sched.layers_per_stage
    island = [(c, sched.executed / grad_accum) for c in island_layer] + [(c, 1 / grad_accum) for c in island_rest]
    counted = (
        island
        + [(c, sched.executed) for c in data + redo]
        + [(c, once) for c in data_once]
        + shifts
        + rest_colls
        + [(c, 1) for c in data_rest + ends]
    )
    # Pipelined, the stage's and the embedding's and head's gathers run before the tick loop and their
    # gradient reductions after it (the compiled step: nothing to run beside them): on the path.
    outside = [(c, once) for c in data_once] + [(c, 1) for c in data_rest] if pipelined else []
    return StepCollectives(shift, ends, shift_seconds, data_once, data, data_rest, rest_colls, counted, outside, island)


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
    rest_cost: Cost,
    params: float,
    ticks_s: float = 0.0,
) -> tuple[float, float, float]:
    """(step seconds, exposed data/fsdp seconds per micro-batch, optimizer seconds). `ticks_s`: the
    tick loop's own work beyond its layer passes, per micro-batch (`f1b_tick_seconds`)."""
    cluster = pr.cluster
    seconds = lambda pairs: sum(times * cost.coll_seconds(c, cluster, pr.opts.act_bytes) for c, times in pairs)  # noqa: E731
    out = {id(c) for c, _ in colls.outside + colls.island}
    data_seconds = seconds((c, t) for c, t in colls.counted if c.axis == "data_fsdp" and id(c) not in out)
    # Data/fsdp collectives run on their own stream, mostly over other links (their groups span nodes,
    # tensor groups usually do not): they hide behind the whole micro-batch, only the excess shows;
    # those outside a pipeline's tick loop (colls.outside) have nothing beside them: all show.
    # Every tick runs every stage (bubble ticks compute on nothing), then hands over: ticks x stage.
    path = (
        sched.runs * (summary.cost.total + (summary.forward if sched.staged else 0.0))
        + colls.shift_seconds
        + rest_cost.total
        + ticks_s
    )
    optimizer_seconds = params * cost.OPTIMIZER_TRAFFIC / cluster.hbm_bandwidth
    exposed = max(0.0, data_seconds - path) + seconds(colls.outside)
    if sched.stages == 1 and any(c.axis == "data_fsdp" and c.kind == "all-gather" for c in colls.data_once):
        exposed = fsdp_exposed(pr, summary, sched, colls)  # fsdp: each layer's gathers and reductions in its pass
    exposed += island_exposed(pr, grad_accum, optimizer_seconds, colls)
    micro_seconds = path + exposed
    return grad_accum * micro_seconds + optimizer_seconds, exposed, optimizer_seconds


# 1F1B's per-tick work beyond its layer passes, in HBM bytes at the cluster's bandwidth (read off the
# step-time tables of the A100 1F1B picks: benchmarks/RESULTS.md 2026-11-29, tenth session, h-1f1b)
F1B_WEIGHT_BYTES = 40  # per element of a tick's chunk weights and of the embedding and head (float32 accumulators)
F1B_ITEM_PASSES = 20  # per byte of an item's kept activations (the ring, the chunk's stacked residuals)


def f1b_tick_seconds(pr: Pricer, mesh: Mesh, summary: LayerSummary, sched: Schedule, head_weights: float) -> float:
    """The 1F1B tick loop's own work per accumulation micro-batch (parallel/pipeline/one_f_one_b.py), beyond
    its layer passes' compute, every one of its V M + V S + S - 2 lockstep ticks: memory-bound passes
    over (1) the tick's chunk weights as the device holds them (gathered over fsdp before the loop; st's
    grid weights stay split): the chunk's float32 gradient added into the stage's (`_add_at`), the
    zero-filled float32 buffers the chunk's backward writes each layer's gradient into and their copies,
    the weights cast to the compute dtype for the forward and the backward, the loop carry's copies;
    (2) the embedding and head (`head_weights`, per tensor shard): their float32 gradients accumulated in
    the tick's branches (`at_head`, `embed_grad`); (3) one item's kept activations: written into the
    ring and read back (`_Tick._forward`, `_backward`), stacked by the chunk's layer scan and read by its
    backward. The constants count bytes at the cluster's peak HBM bandwidth, as `elementwise_passes` does.
    0 for the other schedules (their tick loop is differentiated by autodiff: another program)."""
    if not sched.f1b:
        return 0.0
    chunk = sched.layers_per_tick * (summary.fsdp_w + summary.norm_w + summary.grid_w / mesh.fsdp)
    item = sched.layers_per_tick * summary.saved
    moved = F1B_WEIGHT_BYTES * (chunk + head_weights) + F1B_ITEM_PASSES * item
    return sched.handovers * moved / pr.cluster.hbm_bandwidth


# A GPipe or circular tick's work beyond its layer passes that cost.TICK_WEIGHT_TRAFFIC leaves out, in
# HBM bytes at the cluster's bandwidth: the bytes the step-time table's kernels of the tick scan move
# (sources parallel/pipeline/gspmd.py and unnamed copies, inside the tick loop or on its [ticks, ...]
# stacks), over the share of the datasheet bandwidth its copy kernels reach (0.68). Read off the A100
# llama_7b circular and llama_13b GPipe picks on 64 (benchmarks/RESULTS.md 2026-11-29, eleventh
# session, h-pipe; the circular constants also off the pick they moved to, 13b circular V 10 under remat
# full); the layer scan's own stacks inside a tick are the cluster's kept_passes.
# circular, per chunk weight element, both together: 54.7 with the stack in bf16 (7b, remat none), 69.6 in
# float32 (13b, V 10, remat full); the two below solve the pair
CIRCULAR_SELECT_TRAFFIC = 40  # per chunk weight element: circular's float32 chunk selection
CIRCULAR_STACK_PASSES = 7.5  # per byte of the selected chunk circular's tick scan stacks
TICK_ITEM_PASSES = 15  # per byte of the chunk's kept activations: 14.0 (7b circular), 16.7 (13b GPipe)


def tick_weight_seconds(pr: Pricer, summary: LayerSummary, sched: Schedule, fsdp: int = 1) -> float:
    """Seconds per micro-batch a GPipe or circular tick loop spends beside the layers' own work (the
    compiled step, boost_jax/parallel/pipeline/gspmd.py), every tick, bubble ticks included:
    (1) on its chunk's weights: every tick slices each layer's compute-dtype weights out of the
    stage's stack (and casts the float32 copies again where the backward re-runs the forward), and
    every backward tick makes the chunk's float32 weight gradient (zeroed, written layer by layer
    into its stack) and adds it into the gradient the loop carries: cost.TICK_WEIGHT_TRAFFIC bytes
    per weight element of the chunk (whole: the per-replica copies are gathered over fsdp, the st
    grid's stay split); circular's tick also selects its chunk of the stage's V (`stage_fn`'s
    dynamic index, float32, and its scatter-add into the V chunks' gradient in the backward):
    CIRCULAR_SELECT_TRAFFIC more, and its scan stacks the selected chunk for the backward tick
    (written, zero-filled, sliced back): CIRCULAR_STACK_PASSES per byte of it, the compute-dtype
    cast without remat, the float32 selection under a remat policy (the layers' checkpoints take the
    float32 weights), none under remat.pipeline=stage (the stage's checkpoint keeps no chunk);
    (2) on its activations: the tick scan stacks what the chunk's layers keep, [ticks, ...] per
    array (zero-filled, the layer scan's stack copied in, the whole stack copied between the forward
    and backward loops, sliced and converted by the backward tick): TICK_ITEM_PASSES per byte of the
    chunk's kept set (remat.pipeline=stage: the re-run forward's, priced alike). 1F1B runs its own loop
    (parallel/pipeline/one_f_one_b.py, f1b_tick_seconds): not priced here."""
    if sched.stages == 1 or sched.f1b:
        return 0.0
    chunk = sched.layers_per_tick * (summary.fsdp_w + summary.norm_w + summary.grid_w / fsdp)
    per_weight = cost.TICK_WEIGHT_TRAFFIC
    if sched.name == "circular":
        stacked = 0 if sched.staged else pr.opts.act_bytes if pr.policy == "none" else cost.STATE_BYTES
        per_weight += CIRCULAR_SELECT_TRAFFIC + CIRCULAR_STACK_PASSES * stacked
    item = sched.layers_per_tick * summary.saved
    return sched.ticks * (chunk * per_weight + item * TICK_ITEM_PASSES) / pr.cluster.hbm_bandwidth


# The share of a layer pass's compute its own fsdp collectives hide behind: each runs inside the
# layer's pass (the scanned stack's loop body), beside only the compute XLA schedules between its
# start and its done: the gather before the forward GEMMs that read it, each gradient's all-reduce
# after the backward GEMM that makes it (read off the step-time tables of the fsdp x tensor picks:
# benchmarks/RESULTS.md 2026-11-29, tenth session, h-fsdptp).
FSDP_HIDDEN_SHARE = 1 / 3


def fsdp_exposed(pr: Pricer, summary: LayerSummary, sched: Schedule, colls: StepCollectives) -> float:
    """Exposed data/fsdp seconds of one micro-batch where each layer's fsdp traffic runs inside its
    pass: the layer passes' collectives beyond FSDP_HIDDEN_SHARE of their compute (not their tensor
    collectives: a collective hides behind no other), and the embedding's and head's in full (their
    gathers before the first layer, their gradients' all-reduces after the last: nothing beside)."""
    seconds = lambda pairs: sum(times * cost.coll_seconds(c, pr.cluster, pr.opts.act_bytes) for c, times in pairs)  # noqa: E731
    layers = seconds((c, sched.executed) for c in colls.data) + seconds(
        (c, sched.layers_per_stage) for c in colls.data_once
    )
    compute = sched.runs * (summary.cost.total - summary.cost.comm)
    return max(0.0, layers - FSDP_HIDDEN_SHARE * compute) + seconds((c, 1) for c in colls.data_rest)


def island_exposed(pr: Pricer, grad_accum: int, optimizer_seconds: float, colls: StepCollectives) -> float:
    """Exposed seconds per micro-batch of the data island's reductions (colls.island, 1/grad_accum of
    the step's per micro-batch). They start when the backward is over: a layer's weights are one
    stacked array [L, ...] (unrolled stacks too), whose gradient is complete only with layer 0's
    backward, and the embedding's with the last (after the accumulation loop, grad_accum > 1). Beside
    them runs only the optimizer's update of the gradients already summed: the step waits for the rest
    (the compiled step's schedule, benchmarks/RESULTS.md 2026-11-29, eleventh session)."""
    seconds = sum(times * cost.coll_seconds(c, pr.cluster, pr.opts.act_bytes) for c, times in colls.island)
    return max(0.0, seconds - optimizer_seconds / grad_accum)


def link_bytes_per_step(
    pr: Pricer, grad_accum: int, summary: LayerSummary, sched: Schedule, colls: StepCollectives
) -> dict:
    """Bytes on each GPU's links per step ({"intra", "inter"} node), recomputed collectives included."""
    links = {k: v * sched.executed for k, v in summary.tensor_links.items()}
    for c, times in colls.counted:
        where = "inter" if pr.cluster.spans_nodes(c.stride, c.size) else "intra"
        links[where] += times * cost.link_bytes(c.kind, cost.coll_bytes(c, pr.opts.act_bytes), c.size)
    return {k: grad_accum * v for k, v in links.items()}
