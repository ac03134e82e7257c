"""Pipeline schedules (gpipe, circular, 1f1b): analytic bubble, compiled temp memory per micro-batch
count, and executed collective elements per step; with --time, a measured step-time sanity check.

    python benchmarks/pipeline_bubble.py [--shape cola_1b|d1024] [--microbatches 4,16] [--json PATH]
    python benchmarks/pipeline_bubble.py --time [--stages 2] [--microbatches 2,4,8]
    python benchmarks/pipeline_bubble.py --smoke [--time]   # tiny widths: checks the command runs

--shape cola_1b (default): cola_1b widths with 8 layers, seq 2048, bf16, mesh pipeline 2 x data 2 x
tensor 2 (btp) on emulated CPU devices, one row per micro-batch and data replica (global batch 2 M);
for each schedule (gpipe; circular and 1f1b with V = 2 and 4 chunks of 2 and 1 layers per stage;
1f1b with V = 1) x remat.pipeline (none, stage) x M. --shape d1024: cola_350m widths (d 1024) with 4
layers, seq 2048, bf16, mesh pipeline 2 x tensor 2 (btp), one row per micro-batch; gpipe, circular
V 2, 1f1b V 1 and 2. Per row: ticks (gpipe and circular V M + S - 1; 1f1b its V M + V S + S - 2
lockstep ticks of at most one forward and one backward, whose compute adds up to V M + S - 1), bubble
(S-1)/(V M + S-1), the compiled train step's temp memory, and the elements its collectives execute
per step (in-loop ones x trip count; 1f1b's branches are counted every tick), by axis: `pipeline`
(the stage hand-overs, the stage-0 input gradient, circular's weight reorder), `data` (gradients),
`tensor`. Compile-only (memory_analysis, HLO): nothing is allocated.

--time: the pipelined train step against the same model with pipeline=1 on the same devices; on
emulated CPU devices the ratio mixes in the CPU's own scheduling: a sanity check, run it on GPUs.
Prints a table and writes JSON. `--smoke`: a 4-layer model of width 64 at seq 32, one micro-batch
count unless given, and (compile-only mode) circular V = 2 with stage remat only; JSON
to the temp directory unless --json: checks the command, measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from boost_jax.tools.devices import emulate_cpu_devices


def step_seconds(cfg, steps: int) -> float:
    import jax

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from step_time import build  # the benchmarks' one way to build a real, allocated train step

    step, state, batch = build(cfg, None)
    state, m = step(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    return (time.perf_counter() - t0) / steps


SCHEDULES = (("gpipe", 1), ("circular", 2), ("circular", 4), ("1f1b", 1), ("1f1b", 2), ("1f1b", 4))
CASES = tuple((schedule, repeats, remat) for schedule, repeats in SCHEDULES for remat in ("none", "stage"))
# --shape d1024: 2 layers per stage, V at most 2
D1024_CASES = tuple(c for c in CASES if c[1] <= 2)
# (config size, layers, mesh, rows per micro-batch and data replica, cases, JSON name)
SHAPES = {
    "cola_1b": ("1b", 8, dict(pipeline=2, data=2, tensor=2), CASES, "pipeline_schedules"),
    "d1024": ("350m", 4, dict(pipeline=2, data=1, tensor=2), D1024_CASES, "pipeline_schedules_d1024"),
}
SMOKE_CASES = (("circular", 2, "stage"), ("1f1b", 2, "none"))
# --smoke: widths small enough to compile in seconds, 4 layers (circular V = 2: a layer a chunk)
SMOKE = dict(d_model=64, n_heads=4, n_kv_heads=4, d_ff=128, rank=16, vocab_size=256, max_seq_len=64, n_layers=4)
SMOKE_SEQ = 32


def executed(compiled, mesh) -> dict:
    """Elements the program's collectives execute per step, by the axes they run over."""
    from boost_jax.tools.hlo_comm import parse_collectives

    out: dict = {}
    for c in parse_collectives(compiled.as_text(), mesh):
        key = "+".join(c.axes)
        out[key] = out.get(key, 0) + c.elements * (c.trips or 1)
    return out


def schedules(microbatches: list[int], path: str, smoke: bool = False, shape: str = "cola_1b") -> int:
    import math

    import jax

    from boost_jax.config import sized_config
    from boost_jax.parallel.pipeline.arithmetic import bubble_fraction, ticks, ticks_1f1b
    from boost_jax.runtime.build import build

    rows = []
    size, layers, mesh, cases, _ = SHAPES[shape]
    cases = SMOKE_CASES if smoke else cases
    devices = math.prod(mesh.values())
    for schedule, repeats, remat_pipeline in cases:
        for m in microbatches:
            cfg = sized_config(size, "cola")
            cfg.data.update(source="embedded", batching="stream")
            cfg.model.update(n_layers=layers, dtype="bfloat16")
            cfg.model.update(SMOKE if smoke else {})
            cfg.train.update(seq_len=SMOKE_SEQ if smoke else 2048, global_batch=mesh["data"] * m, grad_accum=1)
            cfg.parallel.update(
                num_devices=devices,
                fsdp=1,
                microbatches=m,
                strategy="btp",
                pipeline_schedule=schedule,
                pipeline_repeats=repeats,
                **mesh,
            )
            cfg.remat.update(pipeline=remat_pipeline)
            built = build(cfg, jax.devices()[:devices])
            compiled = built.lower_train().compile()
            n_ticks = ticks_1f1b(2, m, repeats) if schedule == "1f1b" else ticks(2, m, repeats)
            rows.append(
                {
                    "schedule": schedule,
                    "repeats": repeats,
                    "remat.pipeline": remat_pipeline,
                    "microbatches": m,
                    "ticks": n_ticks,
                    "bubble": bubble_fraction(2, m, repeats),
                    "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                    "executed_elements": executed(compiled, built.mesh),
                }
            )
            print(
                f"  {schedule} V={repeats} {remat_pipeline} M={m}: {rows[-1]['temp_bytes'] / 2**30:.2f} GiB",
                file=sys.stderr,
            )
    axes = ("pipeline", "data", "tensor")
    print(
        "| schedule | V | remat.pipeline | M | ticks | bubble | temp GiB | "
        + " | ".join(f"{a} elements/step" for a in axes)
        + " |"
    )
    print("|---|---|---|---|---|---|---|" + "---|" * len(axes))
    for r in rows:
        e = r["executed_elements"]
        print(
            f"| {r['schedule']} | {r['repeats']} | {r['remat.pipeline']} | {r['microbatches']} | {r['ticks']} | "
            f"{100 * r['bubble']:.1f}% | {r['temp_bytes'] / 2**30:.2f} | "
            + " | ".join(f"{e.get(a, 0) / 1e6:.1f}M" for a in axes)
            + " |"
        )
    print("\ntemp memory M = {1} / M = {0}:".format(microbatches[0], microbatches[-1]))
    for schedule, repeats, remat_pipeline in cases:
        got = [
            r["temp_bytes"]
            for r in rows
            if (r["schedule"], r["repeats"], r["remat.pipeline"]) == (schedule, repeats, remat_pipeline)
        ]
        print(f"  {schedule} V={repeats} remat.pipeline={remat_pipeline}: {got[-1] / got[0]:.2f}x")
    with open(path, "w") as f:
        widths = (
            f"--smoke model {SMOKE}, seq {SMOKE_SEQ}"
            if smoke
            else (f"{'cola_1b' if size == '1b' else 'cola_350m'} widths, {layers} layers, seq 2048")
        )
        grid = " x ".join(f"{k} {v}" for k, v in mesh.items())
        json.dump(
            {
                "shape": f"{widths}, bf16, {grid} (btp), 1 row per micro-batch and data replica",
                "smoke": smoke,
                "rows": rows,
            },
            f,
            indent=2,
        )
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="cola_1b", choices=sorted(SHAPES), help="compile-only mode's model and mesh")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", default=None, help="default 4,16 (--time: 2,4,8)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--time", action="store_true", help="measured step time against data parallelism (see above)")
    ap.add_argument("--smoke", action="store_true", help="tiny widths, one micro-batch count: checks the command")
    args = ap.parse_args(argv)
    here = os.path.dirname(__file__) if not args.smoke else tempfile.gettempdir()
    name = "{}_smoke.json" if args.smoke else "{}.json"
    if not args.time:
        emulate_cpu_devices(8)
        return schedules(
            [int(x) for x in (args.microbatches or ("2" if args.smoke else "4,16")).split(",")],
            args.json or os.path.join(here, name.format(SHAPES[args.shape][4])),
            args.smoke,
            args.shape,
        )
    args.json = args.json or os.path.join(here, name.format("pipeline_bubble"))
    emulate_cpu_devices(args.stages)
    from boost_jax.config import base_config
    from boost_jax.parallel.pipeline.arithmetic import bubble_fraction

    rows = []
    for m in (int(x) for x in (args.microbatches or ("2" if args.smoke else "2,4,8")).split(",")):
        cfg = base_config()
        cfg.model.update(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, d_ff=688, rank=64)
        if args.smoke:
            cfg.model.update(SMOKE)
        cfg.train.update(seq_len=SMOKE_SEQ if args.smoke else 128, global_batch=8 * m)
        cfg.parallel.update(data=1, num_devices=args.stages, pipeline=args.stages, microbatches=m)
        piped = step_seconds(cfg, args.steps)
        cfg.parallel.update(pipeline=1, data=args.stages)
        flat = step_seconds(cfg, args.steps)
        rows.append(
            {
                "stages": args.stages,
                "microbatches": m,
                "bubble": bubble_fraction(args.stages, m),
                "pipelined_s": piped,
                "data_parallel_s": flat,
            }
        )
    print("| stages | micro-batches | bubble (analytic) | pipelined step s | same devices as DP s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['stages']} | {r['microbatches']} | {100 * r['bubble']:.1f}% | {r['pipelined_s']:.3f} | "
            f"{r['data_parallel_s']:.3f} |"
        )
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
