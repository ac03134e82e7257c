"""The search space: meshes (pipeline x data x fsdp x context x tensor), context sizes and modes, stage
counts, pipeline micro-batches, schedules and remat policies; and the trainer's rules for a pipeline."""

from __future__ import annotations

import dataclasses

from boost_jax.config import CONTEXT_ATTENTION, CONTEXT_KV, PIPELINE_SCHEDULES
from boost_jax.parallel.unroll import unrolls
from boost_jax.planner.ops.operators import Block
from boost_jax.planner.pricing import cost
from boost_jax.planner.pricing.plans import STAGE_REMAT, Mesh, Options

# GPipe micro-batches searched per pass, as multiples of the stage count S (the trainer's default is 2S).
MICROBATCHES_PER_STAGE = (1, 2, 4)
# ... and for 1F1B alone, whose kept activations do not grow with M: more micro-batches, less bubble.
MICROBATCHES_PER_STAGE_1F1B = (8, 16)


def meshes(devices: int, stages=(1,), contexts=(1,)):
    """Every pipeline x data x fsdp x context x tensor factorisation with pipeline in `stages` and
    context in `contexts` (context > 1 unpipelined: see context_sizes). The pipeline axis is
    outermost (boost_jax.parallel.mesh.AXES): its groups are the ones that cross nodes first."""
    for pp in stages:
        for cp in contexts:
            if devices % (pp * cp) or (cp > 1 and pp > 1):
                continue
            rest = devices // (pp * cp)
            for t in divisors(rest):
                for f in divisors(rest // t):
                    yield Mesh(rest // (t * f), f, t, pp, cp)


def context_sizes(devices: int, seq: int, opts: Options, attention: str) -> list[int]:
    """parallel.context sizes to search: 1 and every divisor C of the device count that splits seq
    into 2C equal chunks (boost_jax/parallel/mesh.py check_context), or opts.context (each checked:
    a size that does not split seq is a one-line error naming --context). With C = 1 in the search,
    `search` prices a context plan only where its micro-batch's rows per batch shard do not split C
    ways: otherwise the same mesh with `context` folded into `data` runs the same tokens per device
    (the same GEMMs, activations and causal attention work, states replicated alike) without the
    exchange, and under a fused attention the trainer cannot use under context. Context earns its
    place where the rows run out: long sequences, few of them per step. Context needs an attention
    implementation with a block form (`auto` runs chunked there); pipelined plans run without it here
    (the comm report, which --verify compiles with, runs context without a pipeline)."""
    from boost_jax.model.attention import names, takes_context  # lazy: imports jax; not at the planner's import

    for c in opts.context:
        if c < 1 or devices % c:
            raise ValueError(f"--context: {c} does not divide --devices {devices}")
        if c > 1 and seq % (2 * c):
            raise ValueError(
                f"--context: {c} devices hold 2 of {2 * c} equal chunks of each row, which --seq {seq} "
                f"does not split into; use a C with seq a multiple of 2C"
            )
        if c > 1 and not takes_context(attention):
            raise ValueError(
                f"--context: --attention {attention} cannot run with the sequence split over context; use "
                f"one of {tuple(n for n in names() if takes_context(n))}"
            )
    if opts.context:
        return sorted(set(opts.context))
    if not takes_context(attention):
        return [1]
    return [c for c in divisors(devices) if c == 1 or seq % (2 * c) == 0]


def context_modes(block: Block, context: int, opts: Options) -> list[tuple[str, str]]:
    """(parallel.context_attention, parallel.context_kv) to search at this context size: each
    attention mode, with bottleneck K/V where the kind has a bottleneck. ("ring", "full") alone at
    C = 1, where neither applies."""
    if context == 1:
        return [("ring", "full")]
    bad = [x for x in opts.context_attention if x not in CONTEXT_ATTENTION] + [
        x for x in opts.context_kv if x not in CONTEXT_KV
    ]
    if bad:
        raise ValueError(f"--context-attention / --context-kv: {bad} not in {CONTEXT_ATTENTION} / {CONTEXT_KV}")
    return [(a, kv) for a in opts.context_attention for kv in opts.context_kv if kv == "full" or block.factored]


def stage_counts(devices: int, layers: int, opts: Options) -> list[int]:
    """Pipeline sizes: divisors of the device count that split the layers evenly (the trainer's GPipe
    cuts the stack into equal stages), restricted to opts.pipeline when given."""
    out = [s for s in divisors(devices) if layers % s == 0 and (not opts.pipeline or s in opts.pipeline)]
    if not out:
        raise ValueError(
            f"--pipeline: none of {list(opts.pipeline) or 'the sizes'} divides both --devices "
            f"{devices} and the model's {layers} layers"
        )
    return out


def microbatch_counts(stages: int, rows: int, opts: Options) -> list[int]:
    """GPipe micro-batches per pass that split `rows` (sequences per data x fsdp shard of one
    accumulation micro-batch) evenly: S, 2S, 4S (and for 1f1b 8S, 16S) or opts.microbatches. 1 without
    pipelining."""
    if stages == 1:
        return [1]
    deep = MICROBATCHES_PER_STAGE_1F1B if "1f1b" in opts.schedules else ()
    wanted = [opts.microbatches] if opts.microbatches else [k * stages for k in MICROBATCHES_PER_STAGE + deep]
    return [m for m in wanted if rows % m == 0]


def pipeline_variants(layers: int, stages: int, microbatches: int, opts: Options) -> list[tuple[str, int, str]]:
    """(schedule, repeats V, remat.pipeline) to search on `stages` stages: gpipe, and circular with
    every V > 1 dividing the L/S layers per stage (or opts.repeats) where M >= S, 1f1b with V 1 and
    those V where S divides M, each with and without stage remat (as opts allow); at the M searched for
    1f1b alone (more than 4S), 1f1b with V 1 only. Unpipelined: [("gpipe", 1, "none")]."""
    if stages == 1:
        return [("gpipe", 1, "none")]
    bad = [x for x in opts.schedules if x not in PIPELINE_SCHEDULES] + [
        x for x in opts.stage_remat if x not in STAGE_REMAT
    ]
    if bad:
        raise ValueError(f"--schedule / --stage-remat: {bad} not in {PIPELINE_SCHEDULES} / {STAGE_REMAT}")
    out = []
    per_stage = layers // stages
    deep = not opts.microbatches and microbatches > MICROBATCHES_PER_STAGE[-1] * stages  # searched for 1f1b only
    for schedule in opts.schedules:
        if deep and schedule != "1f1b":
            continue
        if schedule == "gpipe":
            reps = [1]
        elif microbatches < stages:
            reps = []
        else:
            reps = [opts.repeats] if opts.repeats else [v for v in divisors(per_stage) if v > 1]
            reps = [v for v in reps if v > 1 and per_stage % v == 0]
        if schedule == "1f1b":  # V = 1, and interleaved (V > 1) where the micro-batches go in groups of S
            # (not at the deep M: its bubble is at most 1/9 there, and interleaving costs V x the hand-overs)
            reps = ([1] if opts.repeats in (0, 1) else []) + [
                v for v in reps if microbatches % stages == 0 and not deep
            ]
        out += [(schedule, v, staged) for v in reps for staged in opts.stage_remat]
    return out


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def stacks(mesh: Mesh, policy: str, opts: Options) -> list[bool]:
    """The layer stacks a plan may run (False: scanned, True: unrolled). The trainer's `auto` unrolls
    (model/autos.py `pick`, mirrored by `auto_unrolls`) where only `data` splits the mesh, and where
    `tensor` splits it too with remat none; so the unrolled stack is searched there, as remat `none`,
    first (where the two price alike, as without a kept-activation term, the search keeps what `auto` runs)."""
    return [True, False] if opts.unroll and policy == "none" and auto_unrolls(mesh, policy) else [False]


def auto_unrolls(mesh: Mesh, policy: str) -> bool:
    """Whether the trainer's `auto` unrolls the layer stack on a GPU on this mesh under this remat
    policy (parallel/unroll.py, the rule model/autos.py `pick` reads too)."""
    sizes = {"pipeline": mesh.pipeline, "data": mesh.data, "fsdp": mesh.fsdp, "context": mesh.context}
    return unrolls({a for a, n in {**sizes, "tensor": mesh.tensor}.items() if n > 1}, policy)


def unrolled_cluster(cluster):
    """The cluster an unrolled stack is priced on: no kept-activation traffic (`kept_passes` 0). The
    fitted kept term prices what the scanned stack does with its saved activations (stacked per layer,
    sliced back in the backward); unrolled, XLA fuses and schedules across the layers, and the planner
    prices the measured unrolled steps without that term (benchmarks/planner_time_fit.py, the
    `unmodelled` rows). Its memory is priced as the scanned remat `none` stack's, an upper bound (the
    measurements: benchmarks/RESULTS.md 2026-11-28, "planner: the unrolled stack")."""
    return dataclasses.replace(cluster, kept_passes=0.0)


def policies(block: Block, opts: Options) -> list[str]:
    priced = cost.remat_policies()
    bad = [p for p in opts.remat if p not in priced]
    if bad:
        raise ValueError(f"--remat: {bad} not in {priced}")
    # `lowrank` keeps the bottleneck activations: only factorised models have them.
    return [p for p in opts.remat or priced if block.factored or p != "lowrank"]


def check_pipeline(layers: int, stages: int, microbatches: int, schedule: str, repeats: int, stage_remat: str):
    """The trainer's rules for a pipeline schedule (boost_jax/config/checks.py, parallel/mesh.py), as ValueError."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {PIPELINE_SCHEDULES}")
    if stage_remat not in STAGE_REMAT:
        raise ValueError(f"remat.pipeline {stage_remat!r} is not one of {STAGE_REMAT}")
    if stages == 1:
        if stage_remat != "none" or repeats != 1 or schedule != "gpipe":
            raise ValueError("pipeline_schedule, pipeline_repeats and remat.pipeline=stage need pipeline > 1")
        return
    if repeats < 1 or (schedule == "gpipe" and repeats != 1):
        raise ValueError(f"{repeats} chunks per stage need the circular or 1f1b schedule (gpipe holds one)")
    if schedule == "1f1b" and repeats > 1:
        if layers % (stages * repeats):
            raise ValueError(f"pipeline_repeats {repeats} does not divide the {layers // stages} layers per stage")
        if microbatches % stages:
            raise ValueError(
                f"interleaved 1f1b runs the micro-batches in groups of {stages} stages ({microbatches} micro-batches)"
            )
    if schedule == "circular":
        if layers % (stages * repeats):
            raise ValueError(f"pipeline_repeats {repeats} does not divide the {layers // stages} layers per stage")
        if microbatches < stages:
            raise ValueError(
                f"the circular schedule needs at least one micro-batch per stage ({microbatches} < {stages})"
            )
