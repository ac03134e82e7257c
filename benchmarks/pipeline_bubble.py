"""Pipeline bubble of the GPipe schedule: the analytic fraction and a measured step-time ratio; with
--memory, the compiled train step's temp memory per micro-batch count, with and without stage remat.

    python benchmarks/pipeline_bubble.py [--stages 2] [--microbatches 2,4,8]
    python benchmarks/pipeline_bubble.py --memory [--microbatches 4,16] [--json benchmarks/pipeline_memory.json]

--memory: cola_1b shapes with 2 layers per stage (4 layers), seq 2048, pipeline 2 x tensor 2 (btp) on
emulated CPU devices, one row per micro-batch (global batch = M), bf16, remat.policy none and lowrank,
remat.pipeline none (GPipe's autodiff keeps every micro-batch's activations) and stage (one stage
input per micro-batch; the stage is recomputed in the backward). Compile-only (memory_analysis).

The bubble is (S-1)/(M+S-1) of the ticks (every stage idles while the pipeline fills and drains).
The measured column times the pipelined train step against the same model with pipeline=1 on the
same devices; on emulated CPU devices that ratio mixes in the CPU's own scheduling and is only a
sanity check: run it on GPUs for real numbers. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from boost_jax.tools.devices import emulate_cpu_devices


def step_seconds(cfg, steps: int) -> float:
    import jax

    from step_time import build  # the benchmarks' one way to build a real, allocated train step

    step, state, batch, _, _ = build(cfg, None)
    state, m = step(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
    jax.block_until_ready(m)
    return (time.perf_counter() - t0) / steps


def memory(microbatches: list[int], path: str) -> int:
    import jax

    from boost_jax.config import sized_config
    from boost_jax.runtime.build import build
    rows = []
    for policy in ("none", "lowrank"):
        for remat_pipeline in ("none", "stage"):
            for m in microbatches:
                cfg = sized_config("1b", "cola")
                cfg.data.update(source="embedded", batching="stream")
                cfg.model.update(n_layers=4, dtype="bfloat16")
                cfg.train.update(seq_len=2048, global_batch=m, grad_accum=1)
                cfg.parallel.update(num_devices=4, pipeline=2, tensor=2, data=1, microbatches=m, strategy="btp")
                cfg.remat.update(policy=policy, pipeline=remat_pipeline)
                mem = build(cfg, jax.devices()[:4]).lower_train().compile().memory_analysis()
                rows.append({"remat.policy": policy, "remat.pipeline": remat_pipeline, "microbatches": m,
                             "temp_bytes": int(mem.temp_size_in_bytes)})
                print(f"  {policy} {remat_pipeline} M={m}: {mem.temp_size_in_bytes / 2**30:.2f} GiB", file=sys.stderr)
    print("| remat.policy | remat.pipeline | " + " | ".join(f"temp GiB, M={m}" for m in microbatches)
          + f" | M={microbatches[-1]} / M={microbatches[0]} |")
    print("|---|---|" + "---|" * (len(microbatches) + 1))
    for policy in ("none", "lowrank"):
        for remat_pipeline in ("none", "stage"):
            got = [r["temp_bytes"] for r in rows if (r["remat.policy"], r["remat.pipeline"]) == (policy, remat_pipeline)]
            print(f"| {policy} | {remat_pipeline} | " + " | ".join(f"{b / 2**30:.2f}" for b in got)
                  + f" | {got[-1] / got[0]:.2f}x |")
    with open(path, "w") as f:
        json.dump({"shape": "cola_1b, 4 layers (2 per stage), seq 2048, pipeline 2 x tensor 2, 1 row per "
                   "micro-batch, bf16", "rows": rows}, f, indent=2)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", default="2,4,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--memory", action="store_true", help="compiled temp memory per M, with and without stage remat")
    args = ap.parse_args(argv)
    here = os.path.dirname(__file__)
    if args.memory:
        emulate_cpu_devices(4)
        return memory([int(x) for x in args.microbatches.split(",")],
                      args.json or os.path.join(here, "pipeline_memory.json"))
    args.json = args.json or os.path.join(here, "pipeline_bubble.json")
    emulate_cpu_devices(args.stages)
    from boost_jax.config import base_config
    from boost_jax.parallel.pipeline import bubble_fraction

    rows = []
    for m in (int(x) for x in args.microbatches.split(",")):
        cfg = base_config()
        cfg.model.update(n_layers=4, d_model=256, n_heads=4, n_kv_heads=4, d_ff=688, rank=64)
        cfg.train.update(seq_len=128, global_batch=8 * m)
        cfg.parallel.update(data=1, num_devices=args.stages, pipeline=args.stages, microbatches=m)
        piped = step_seconds(cfg, args.steps)
        cfg.parallel.update(pipeline=1, data=args.stages)
        flat = step_seconds(cfg, args.steps)
        rows.append({"stages": args.stages, "microbatches": m, "bubble": bubble_fraction(args.stages, m),
                     "pipelined_s": piped, "data_parallel_s": flat})
    print("| stages | micro-batches | bubble (analytic) | pipelined step s | same devices as DP s |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stages']} | {r['microbatches']} | {100 * r['bubble']:.1f}% | {r['pipelined_s']:.3f} | "
              f"{r['data_parallel_s']:.3f} |")
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
