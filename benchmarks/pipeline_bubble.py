"""Pipeline bubble of the GPipe schedule: the analytic fraction and a measured step-time ratio.

    python benchmarks/pipeline_bubble.py [--stages 2] [--microbatches 2,4,8]

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


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--microbatches", default="2,4,8")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "pipeline_bubble.json"))
    args = ap.parse_args(argv)
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
