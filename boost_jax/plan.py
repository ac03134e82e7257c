"""Plan the parallel layout of a training run: search mesh (pipeline x data x fsdp x tensor) x pipeline
schedule (gpipe, circular, 1f1b) and micro-batches x per-group partition choices x remat x micro-batching
with an α-β / GEMM-efficiency / memory cost model (boost_jax/planner), print the top plans and the
--config overrides that run the best one.

    python -m boost_jax.plan --config configs/cola_7b.py --devices 32 \
        --cluster configs/clusters/a100_4x.py [--batch 512] [--seq 256] [--top 5] \
        [--attention auto|xla|chunked|cudnn|pallas] [--remat none,lowrank,full] [--grad-accum N] \
        [--pipeline 1,2,4] [--microbatches M] [--schedule gpipe,circular,1f1b] [--repeats V]
        [--stage-remat none,stage] [--context 1,2,4] [--context-attention ring,all_gather]
        [--context-kv full,bottleneck] [--verify [--target h100|a100|a100_40gb|h200 [--device-memory GB]]]

Context splits (parallel.context) are searched where the micro-batch's rows run out: the comment
above `search_options`. `--verify` compiles the best plan the trainer can run (emulated CPU devices,
shrunk, with the comm report; or with `--target`, the plan's own step for that many GPUs without
them) and compares the planner's collectives and peak memory with the compiled step's: the comment
above `run_verify`.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from boost_jax.config import ST
from boost_jax.errors import ConfigError
from boost_jax.planner import Options, auto, load_cluster, search, verify
from boost_jax.planner.ops.operators import Block
from boost_jax.planner.pricing.cost import attention_kind, handover_ticks
from boost_jax.planner.pricing.trainer_flags import linear_partition
from boost_jax.planner.search import model_flops_per_token
from boost_jax.tools import aot
from boost_jax.tools.devices import emulate_cpu_devices, load_config
from boost_jax.tools.progress import ticking

GB = 1e9
# The activation layouts in the plans' layout column (boost_jax/planner/ops/).
LEGEND = (
    "layouts: R replicated over tensor, P partial sums (before their all-reduce), H split along the "
    "features over tensor, S split along the sequence over tensor"
)


def _gb(x: float) -> str:
    return f"{x / GB:.1f}"


def table(plans, batch: int) -> str:
    context = any(p.mesh.context > 1 for p in plans)  # the column shows where some plan splits the sequence
    head = (
        "| # | mesh p x d x f x t | micro x accum | pipeline schedule, M (bubble) | remat | residual "
        + ("| context C: attention / kv " if context else "")
        + "| qkv / o / mlp_in / mlp_out | attn / act "
        "| step s | tokens/s | MFU | GB/GPU | link GB/step intra / inter | trainer |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for i, p in enumerate(plans, 1):
        cp = (
            (f"| {p.mesh.context}: {p.context_attention} / {p.context_kv} " if p.mesh.context > 1 else "| 1 ")
            if context
            else ""
        )
        pipe = (
            f"{p.schedule}{f' V{p.repeats}' if p.repeats > 1 else ''}{' +stage' if p.stage_remat == 'stage' else ''}"
            f" M{p.microbatches} ({100 * p.bubble:.0f}%)"
            if p.mesh.pipeline > 1
            else "-"
        )
        lines.append(
            f"| {i} | {p.mesh} | {batch // p.grad_accum} x {p.grad_accum} | {pipe} | {p.remat_label} "
            f"| {p.layer.residual} "
            f"{cp}| {' / '.join(p.layer.choices)} | {p.layer.attention} / {p.layer.act} | {p.step_s:.3g} "
            f"| {p.tokens_per_s:,.0f} | {100 * p.mfu:.1f}% | {_gb(p.memory['total'])} "
            f"| {_gb(p.link_bytes['intra'])} / {_gb(p.link_bytes['inter'])} | {p.runnable} |"
        )
    return "\n".join(lines)


def breakdown(p, layers: int) -> str:
    lc, rc = p.layer_cost, p.rest_cost
    m = p.memory
    layer = (
        f"{1e3 * lc.total:.2f} ms (compute {1e3 * lc.compute:.2f}, tensor comm {1e3 * lc.comm:.2f}, "
        f"recompute {1e3 * lc.recompute:.2f}, kept activations' HBM traffic {1e3 * lc.kept:.2f})"
    )
    stages = p.mesh.pipeline
    if stages > 1:
        ticks = p.repeats * p.microbatches + stages - 1
        lockstep = (
            f" (in {handover_ticks(stages, p.microbatches, p.repeats, p.schedule)} lockstep ticks of at most "
            "one forward and one backward)"
            if p.schedule == "1f1b"
            else ""
        )
        path = (
            f"per accumulation micro-batch: {ticks} {p.schedule} ticks{lockstep} ({p.repeats * p.microbatches} "
            f"chunk passes + {stages - 1} bubble, {100 * p.bubble:.0f}%) x {layers // (stages * p.repeats)} layers x "
            f"{layer}"
            + (" + the stage's forward again (remat.pipeline=stage)" if p.stage_remat == "stage" else "")
            + f" + stage hand-overs {1e3 * p.shift_s:.2f} ms"
        )
    else:
        path = f"per micro-batch: {layers} layers x {layer}"
    exchange = [c for c in p.layer_colls if c.axis == "context"]
    if exchange:
        path += (
            f" (context {p.mesh.context}, {p.context_attention} / {p.context_kv}: "
            f"{sum(c.elements for c in exchange) / 1e6:.1f}M elements of K/V exchange per layer)"
        )
    return (
        f"{path} + embedding/head {1e3 * rc.total:.2f} ms + exposed data/fsdp {1e3 * p.exposed_dp_s:.2f} ms; "
        f"optimizer {1e3 * p.optimizer_s:.1f} ms per step\n"
        f"memory per GPU: states {_gb(m['states'])} + kept weights {_gb(m['weights'] + m['gathered'])} + kept "
        f"activations {_gb(m['activations'])} + transient (loss, a layer's backward or the optimizer update) "
        f"{_gb(m['transient'])} "
        + (f"+ pipeline buffers {_gb(m['pipeline'])} " if stages > 1 else "")
        + (f"+ XLA's collective pipeliner's bottleneck arrays {_gb(m['pipeliner'])} " if m.get("pipeliner") else "")
        + (f"+ the double-buffered layer scan's copy {_gb(m['double_buffer'])} " if m.get("double_buffer") else "")
        + f"+ allocation overhead {_gb(m['allocator'])} = {_gb(m['total'])} GB"
    )


# --verify lowers the best plan the trainer can run on emulated CPU devices (shrunk to at most 8
# devices, an st plan's fsdp x tensor grid kept whole up to 4 x 4; one sequence per batch shard, seq
# <= 128) with boost_jax.tools.comm_report and prints the planner's per-layer collectives (bytes and
# counts by class and kind) and peak memory next to the compiled step's; a GPipe plan (remat.pipeline
# none or stage) is compiled with 2 stages of 2 layers, a circular one with 2 stages of V = 2 or 3
# chunks of 1 layer (V 2 where the plan's weight reorder is an all-to-all, else 3), and compared over
# the whole scanned step (pipeline, pipeline-weight, tensor and data/fsdp traffic by kind, peak
# memory); pipelined st and replicated-residual (megatron, vanilla) pipelined plans are refused with
# the reason (planner/verify.py pipeline_refusal). `--verify --target h100` instead compiles the plan's
# own train step at full size for that many H100s without them (boost_jax.tools.aot, the aot extra) and
# compares the planner's peak memory per GPU with the compiled one (within 10%); where the compiled peak
# exceeds the GPU's usable memory (90%, or --device-memory GB), it says so in one line and compiles the
# search's next plan, up to 4, as `parallel.plan=auto` does on the GPUs (planner/auto.py first_that_fits).
def run_verify(cfg, cluster, plan, seq: int) -> bool:
    st = ST in plan.layer.choices
    sp = plan.sequence_parallel
    if plan.mesh.pipeline > 1:
        why = verify.pipeline_refusal(plan)
        if why:
            raise SystemExit(f"--verify: {why} (compile it with the overrides above instead)")
        mesh, vseq = verify.shrink_pipeline(plan.mesh, seq)
        micro = max(2, min(plan.microbatches, 4))
        chunked = plan.repeats > 1  # circular, interleaved 1f1b
        reps, per_chunk = (verify.verify_repeats(plan), 1) if chunked else (1, 2)
        if plan.schedule == "1f1b" and chunked:  # interleaved: the micro-batches go in groups of S = 2
            micro -= micro % 2
        shape = f"V {reps} chunks of 1 layer per stage" if chunked else "2 layers per stage"
        print(
            f"\n--verify: {plan.strategy}, mesh {mesh}, {plan.schedule}, {micro} micro-batches, {shape}, "
            f"seq {vseq}, remat {plan.remat}, remat.pipeline {plan.stage_remat}, compiled on emulated CPU devices "
            f"(the scanned train step, whole step per device; memory in {verify.COMPILE_DTYPE})"
        )
        rows = verify.compare_pipeline(
            cfg,
            cluster,
            mesh,
            plan.strategy,
            sp,
            plan.remat,
            micro,
            vseq,
            plan.layer,
            schedule=plan.schedule,
            repeats=reps,
            stage_remat=plan.stage_remat,
            layers_per_chunk=per_chunk,
        )
    else:
        try:
            mesh, batch, vseq = verify.shrink(plan.mesh, seq, grid=st)
        except ValueError as e:
            raise SystemExit(f"--verify: {e}") from e
        groups = f" + {linear_partition(plan.layer)} on the fsdp x tensor grid" if st else ""
        print(
            f"\n--verify: {plan.strategy}{' (SP)' if sp else ''}{groups}, mesh {mesh}, batch {batch} x seq {vseq}, "
            f"remat {plan.remat}, compiled on emulated CPU devices (bytes per layer per device; memory: the "
            f"full-depth step in {verify.COMPILE_DTYPE})"
        )
        if mesh.context > 1:
            print(f"context {mesh.context}: {plan.context_attention} / {plan.context_kv}")
        rows = verify.compare(
            cfg,
            cluster,
            mesh,
            plan.strategy,
            sp,
            plan.remat,
            batch,
            vseq,
            layer=plan.layer,
            memory=True,
            context_attention=plan.context_attention or "ring",
            context_kv=plan.context_kv or "full",
        )
    print(
        "| traffic | planner | HLO (comm_report) | planner / HLO | count planner / HLO | agrees |\n"
        "|---|---|---|---|---|---|"
    )
    for r in rows:
        counts = r.get("counts")
        count = "-" if counts is None else f"{counts[0]} / {counts[1]}" + (" (combined)" if r.get("combined") else "")
        print(
            f"| {r['traffic']} | {r['predicted']:,.0f} | {r['measured']:,.0f} | {r['ratio']:.3f} | {count} "
            f"| {'yes' if r['ok'] else 'NO'} |"
        )
    ok = all(r["ok"] for r in rows)
    whole = next((r for r in rows if r["traffic"] == verify.WHOLE), None)
    if not ok and whole is not None and whole["ok"]:
        print(
            "The whole program agrees but the per-layer split does not: XLA partitioned the 1-layer "
            "program differently from the 2-layer one (comm_report's per layer = 2-layer - 1-layer)."
        )
    return ok


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.target and not args.verify:
        raise SystemExit("--target compiles the plan for a GPU: it goes with --verify")
    if args.device_memory and not args.target:
        raise SystemExit("--device-memory is what the plan compiled for --target must fit: it goes with --target")
    if args.device_memory < 0:
        raise SystemExit(f"--device-memory: GB per GPU, >= 0; got {args.device_memory}")
    if args.verify and not args.target:
        emulate_cpu_devices(16)  # before anything imports jax; 16: an st plan on a 4 x 4 grid
    from boost_jax.model.attention import names as attention_names  # lazy: imports jax, after the devices are set
    from boost_jax.model.attention import under_context  # lazy: imports jax, after the devices are set

    if args.attention not in attention_names():
        raise SystemExit(f"--attention: {args.attention!r} is not one of {attention_names()}")
    cfg = load_config(args.config)
    try:
        cluster = load_cluster(args.cluster)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    batch = args.batch or int(cfg.train.global_batch)
    seq = args.seq or int(cfg.train.seq_len)
    opts = search_options(args, batch, seq)
    fpt = model_flops_per_token(cfg, seq)
    print(
        f"{cfg.name} ({cfg.model.linear}, d={cfg.model.d_model}, r={cfg.model.rank}, L={cfg.model.n_layers}) on "
        f"{args.devices} GPUs of {cluster.name} ({cluster.gpus_per_node}/node, {cluster.hbm_bytes / GB:.0f} GB); "
        f"batch {batch} x seq {seq} = {batch * seq:,} tokens/step; attention {args.attention} (priced as "
        f"{attention_kind(args.attention, Block.from_config(cfg), seq, opts.act_bytes)}, see planner/cost.py; "
        f"plans with context > 1 run {under_context(args.attention)})",
        flush=True,
    )
    try:
        with ticking(f"plan: searching plans for {args.devices} GPUs"):
            res = search(cfg, cluster, args.devices, opts, flops_per_token=fpt)
    except ValueError as e:
        raise SystemExit(str(e)) from e

    print(
        f"search: {res.considered} plans, {res.priced} priced in full (the others' lower bounds cannot enter the "
        f"top {opts.top}), {res.rejected_memory} of those over the usable {cluster.usable_hbm / GB:.0f} GB/GPU, in "
        f"{res.seconds:.2f} s"
    )
    return report(args, cfg, cluster, opts, res, batch, seq)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", required=True, help="a configs/*.py file, e.g. configs/cola_7b.py")
    ap.add_argument("--devices", type=int, required=True, help="number of GPUs")
    ap.add_argument("--cluster", required=True, help="a configs/clusters/*.py file")
    ap.add_argument("--batch", type=int, help="global batch in sequences (default: the config's train.global_batch)")
    ap.add_argument("--seq", type=int, help="sequence length (default: the config's train.seq_len)")
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument(
        "--attention",
        default="auto",
        help="model.attention the plan runs with, any registered implementation (default auto: "
        "cudnn on a GPU in bf16 where cuDNN takes the shapes, as the trainer picks); xla: "
        "materialised scores; chunked: blockwise in plain JAX; cudnn/pallas: fused flash kernels",
    )
    ap.add_argument(
        "--remat",
        default="",
        help="comma list of remat policies to search (default: every one the planner prices: none,lowrank,full)",
    )
    ap.add_argument("--grad-accum", type=int, default=0, help="fix train.grad_accum (default: search)")
    ap.add_argument(
        "--pipeline",
        default="",
        help="comma list of pipeline stage counts (default: every one that divides --devices and the layers)",
    )
    ap.add_argument(
        "--microbatches",
        type=int,
        default=0,
        help="fix the micro-batches per pass of pipelined plans (default: search S, 2S, 4S)",
    )
    ap.add_argument(
        "--schedule",
        default="gpipe,circular,1f1b",
        help="comma list of parallel.pipeline_schedule values to search (default gpipe,circular,1f1b)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="fix the chunks per stage V of circular and interleaved 1f1b (default: search every divisor "
        "> 1 of L/S; 1f1b also V 1)",
    )
    ap.add_argument(
        "--stage-remat", default="none,stage", help="comma list of remat.pipeline values to search (default none,stage)"
    )
    ap.add_argument(
        "--context",
        default="",
        help="comma list of parallel.context sizes to search (default: every "
        "divisor of --devices that splits --seq into 2C equal chunks, where the rows run out)",
    )
    ap.add_argument(
        "--context-attention",
        default="ring,all_gather",
        help="comma list of parallel.context_attention values to search (default ring,all_gather)",
    )
    ap.add_argument(
        "--context-kv",
        default="full,bottleneck",
        help="comma list of parallel.context_kv values to search (default full,bottleneck; bottleneck: "
        "kinds with a bottleneck)",
    )
    ap.add_argument("--verify", action="store_true", help="compile the best runnable plan and compare collectives")
    ap.add_argument(
        "--target",
        help="with --verify: compile the plan at full size for this GPU without one "
        "(h100, a100, a100_40gb, h200: boost_jax.tools.aot, the aot extra) and compare its peak memory",
    )
    ap.add_argument(
        "--device-memory",
        type=float,
        default=0.0,
        help="with --verify --target: the GB per GPU the compiled plan must fit (default: 90%% of the target's "
        "memory); a plan over it is named and the search's next plan compiled, as parallel.plan=auto does",
    )
    return ap


# parallel.context (the sequence split over C devices, boost_jax/parallel/context.py) is searched at
# every C dividing the devices that cuts seq into 2C equal chunks, with ring and all_gather attention
# and full or (bottleneck kinds) bottleneck K/V, where the micro-batch's rows run out (planner/search_space.py
# context_sizes); a context plan runs its attention's block form (`auto`: chunked's, model/attention/registry.py
# under_context), its exchange priced from the formula the comm report checks; --verify compiles it at context 2 with
# its modes.
def search_options(args, batch: int, seq: int) -> Options:
    """The search's options from the command line, each checked (a one-line SystemExit naming the flag)."""
    if args.devices < 1 or batch < 1 or seq < 1 or args.top < 1:
        raise SystemExit("--devices, --batch, --seq and --top must be positive")
    if args.grad_accum and batch % args.grad_accum:
        raise SystemExit(f"--grad-accum {args.grad_accum} does not divide --batch {batch}")
    try:
        pipeline = tuple(int(x) for x in args.pipeline.split(",") if x.strip())
    except ValueError as e:
        raise SystemExit(f"--pipeline: expected a comma list of integers, got {args.pipeline!r}") from e
    try:
        context = tuple(int(x) for x in args.context.split(",") if x.strip())
    except ValueError as e:
        raise SystemExit(f"--context: expected a comma list of integers, got {args.context!r}") from e
    if args.microbatches < 0 or args.repeats < 0 or any(s < 1 for s in pipeline):
        raise SystemExit("--pipeline, --microbatches and --repeats must be positive")
    return Options(
        batch=batch,
        seq=seq,
        attention=args.attention,
        grad_accum=args.grad_accum,
        top=args.top,
        remat=tuple(x.strip() for x in args.remat.split(",") if x.strip()),
        pipeline=pipeline,
        microbatches=args.microbatches,
        repeats=args.repeats,
        schedules=tuple(x.strip() for x in args.schedule.split(",") if x.strip()),
        stage_remat=tuple(x.strip() for x in args.stage_remat.split(",") if x.strip()),
        context=context,
        context_attention=tuple(x.strip() for x in args.context_attention.split(",") if x.strip()),
        context_kv=tuple(x.strip() for x in args.context_kv.split(",") if x.strip()),
    )


def report(args, cfg, cluster, opts: Options, res, batch: int, seq: int) -> int:
    """Print the search's plans, the best one's breakdown and the overrides that run the best runnable one
    (and --verify it); the exit status."""
    if not res.plans and res.smallest is None:  # nothing was priced: the choices exclude every plan
        layers = int(cfg.model.n_layers)
        raise SystemExit(
            f"no plan to price: no layout of {layers} layers on {args.devices} GPUs meets --pipeline "
            f"{args.pipeline or '(any)'}, --schedule {args.schedule}, --repeats {args.repeats or '(any)'}"
            f", --microbatches {args.microbatches or '(any)'} (circular's V must divide the layers per "
            "stage, L/S, and leave a chunk of at least one layer); widen them"
        )
    if not res.plans:
        s = res.smallest
        hint = "raise --devices or lower --batch" + (
            "" if not opts.remat or "full" in opts.remat else ", or add full to --remat"
        )
        raise SystemExit(
            f"no plan fits in {cluster.usable_hbm / GB:.0f} GB/GPU; the smallest needs "
            f"{_gb(s.memory['total'])} GB ({s.mesh}, remat {s.remat}, states "
            f"{_gb(s.memory['states'])} GB): {hint}"
        )
    print()
    print(table(res.plans, batch))
    print(LEGEND)
    best = res.plans[0]
    print(f"\nbest: {breakdown(best, int(cfg.model.n_layers))}")
    runnable = res.best_runnable
    if runnable is None:
        print("\nno plan the trainer can run fits (every fitting plan needs st or mixed choices)")
        return 1
    if runnable is not best:
        print(
            f"\nThe best plan is not runnable yet ({best.runnable}). The best the trainer can run is "
            f"{runnable.step_s / best.step_s - 1:.1%} slower: {runnable.mesh}, {runnable.layer}, "
            f"remat {runnable.remat}, {runnable.step_s:.3f} s/step, MFU {100 * runnable.mfu:.1f}%."
        )
        print("  " + breakdown(runnable, int(cfg.model.n_layers)).replace("\n", "\n  "))
    print(f"\nrun it with:\n  python -m boost_jax.train --config {args.config} {runnable.overrides}")
    if args.verify and args.target:
        return 0 if run_verify_target(args, cfg, cluster, opts, runnable) else 1
    if args.verify:
        return 0 if run_verify(cfg, cluster, runnable, seq) else 1
    return 0


TARGET_MEMORY_TOLERANCE = 0.10  # the planner's peak per GPU against the deviceless GPU compile


def run_verify_target(args, cfg, cluster, opts: Options, plan) -> bool:
    """--verify --target GPU: the plan's own train step, at full size on all its devices, compiled for
    that GPU without one (boost_jax.tools.aot); where its peak per GPU exceeds the GPU's usable memory,
    the search's next plan, compiled in turn (planner/auto.py first_that_fits, as parallel.plan=auto
    does on the GPUs); the planner's peak memory per GPU next to the compiled one of the last compiled."""
    target, devices = args.target, args.devices
    print(
        f"\n--verify --target {target}: the plan's train step compiled for {devices} x {target} (deviceless, full size)"
    )
    label, compiled = f"--verify --target {target}", {}

    def pick(exclude):
        p = plan
        if exclude:
            p = search(cfg, cluster, devices, dataclasses.replace(opts, exclude=exclude, top=1)).best_runnable
            if p is None:
                return None
        return p, f"{label}: {auto.short(p)}", p

    def fits(p, _):
        flags = [a for a in p.overrides.split() if a.startswith("--config.")]
        rep = aot.compile_config(aot.load(args.config, flags), target, devices, programs=("train",))
        compiled["plan"], compiled["rep"] = p, rep
        r = rep["train"]
        share = r["usable_bytes"] / r["device_memory_bytes"]
        if args.device_memory:
            return r["peak_bytes"], args.device_memory * GB, "--device-memory", rep
        return r["peak_bytes"], r["usable_bytes"], f"{share:.0%} of the {target}'s memory", rep

    what = f"{cfg.name} at batch {opts.batch} x seq {opts.seq}"
    fix = "use more --devices or a lower --batch"
    ok = True
    try:
        aot.require()
        auto.first_that_fits(pick, fits, print, what, label=label, fix=fix)
    except aot.AotError as e:
        raise SystemExit(f"{label}: {e}") from None
    except ConfigError as e:
        print(str(e).replace("config field `parallel.plan`: auto: ", f"{label}: "))
        ok = False
    if not compiled:
        return False
    plan, rep = compiled["plan"], compiled["rep"]
    r = rep["train"]
    predicted, peak = plan.memory["total"], r["peak_bytes"]
    within = abs(predicted - peak) <= TARGET_MEMORY_TOLERANCE * max(predicted, peak)
    print(aot.to_text(rep))
    print(
        "| memory per GPU | planner | compiled | planner / compiled | within 10% |\n|---|---|---|---|---|\n"
        f"| peak | {predicted / GB:.3f} GB | {peak / GB:.3f} GB | {predicted / peak:.3f} | "
        f"{'yes' if within else 'NO'} |"
    )
    return ok and within and peak <= (args.device_memory * GB if args.device_memory else r["usable_bytes"])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
