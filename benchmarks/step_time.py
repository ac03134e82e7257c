"""Wall-clock time of the sharded train step for each tensor-parallel strategy, in one run.

    python benchmarks/step_time.py [--config configs/cola_60m.py] [--layers 2] [--batch 8] [--seq 128]
        [--mesh auto|DATA,FSDP,TENSOR] [--strategy btp,vanilla,megatron] [--warmup 2] [--steps 10]
        [--dtype auto] [--json PATH]

Each strategy gets really allocated state and the jitted step of the runtime's builder,
on the available devices: GPUs when present, else CPU devices emulated with XLA_FLAGS (`--mesh auto`:
1,1,min(4, devices)). After the warm-up calls (the first compiles), the strategies' steps are timed
round-robin, one step each per round, each ended by block_until_ready, so slow drift of a shared
machine hits all of them alike. Ratios are between columns of this run only. Not a test: on a CPU
the emulated devices share cores, so the times say little about an accelerator.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

from boost_jax.tools.devices import emulate_cpu_devices, parse_mesh

ROOT = Path(__file__).resolve().parents[1]


def build(cfg, devices):
    """(step, state, batch) for one strategy: the runtime's build, state allocated in its shardings."""
    import jax
    import numpy as np

    from boost_jax.runtime.build import build as build_run

    built = build_run(cfg, devices)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (1, cfg.train.global_batch, cfg.train.seq_len + 1), np.int32)
    return built.train_step, built.init_state(), jax.device_put(tokens, built.batch_sharding)


def timed_steps(step, state, batch, warmup: int, steps: int):
    """(state, metrics, seconds per step): `warmup` untimed steps, then the mean of `steps` timed ones,
    each run ended by block_until_ready; the state is threaded through (a train step donates it)."""
    import jax

    metrics = None
    for _ in range(warmup):
        state, metrics = step(state, batch)
    jax.block_until_ready((state, metrics))
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return state, metrics, (time.perf_counter() - t0) / steps


def run(args) -> dict:
    import jax

    from boost_jax.tools.comm_report.programs import parse_strategies, variant_config
    from boost_jax.tools.devices import load_config

    devices = jax.devices()
    sizes = (1, 1, min(4, len(devices))) if args.mesh == "auto" else parse_mesh(args.mesh)
    n = math.prod(sizes)
    if n > len(devices):
        raise SystemExit(f"--mesh {args.mesh} needs {n} devices, JAX sees {len(devices)}")
    base = load_config(args.config)
    base.model.n_layers = args.layers
    cols = {}
    for name, linear in parse_strategies(args.strategy):
        cfg = variant_config(base, name, linear, sizes, args.batch, args.seq, args.dtype)
        label = name if linear is None else f"{name}:{linear}"
        step, state, batch = build(cfg, devices[:n])
        cols[label] = {"cfg": cfg, "step": step, "state": state, "batch": batch, "warmup_s": [], "times_s": []}
    for col in cols.values():  # warm-up (the first call compiles); the steps carry their own rules
        for _ in range(args.warmup):
            start = time.perf_counter()
            col["state"], metrics = col["step"](col["state"], col["batch"])
            jax.block_until_ready(metrics)
            col["warmup_s"].append(time.perf_counter() - start)
    for _ in range(args.steps):
        for col in cols.values():
            start = time.perf_counter()
            col["state"], metrics = col["step"](col["state"], col["batch"])
            jax.block_until_ready((col["state"], metrics))
            col["times_s"].append(time.perf_counter() - start)
    tokens = args.batch * args.seq
    out = {
        "config": base.name,
        "layers": args.layers,
        "batch": args.batch,
        "seq": args.seq,
        "mesh": dict(zip(("data", "fsdp", "tensor"), sizes)),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "warmup": args.warmup,
        "steps": args.steps,
        "strategies": {},
    }
    for label, col in cols.items():
        median = statistics.median(col["times_s"])
        out["strategies"][label] = {
            "config": col["cfg"].name,
            "linear": col["cfg"].model.linear,
            "dtype": str(col["cfg"].model.dtype),
            "median_s": median,
            "min_s": min(col["times_s"]),
            "mean_s": statistics.mean(col["times_s"]),
            "tokens_per_s": tokens / median,
            "warmup_s": col["warmup_s"],
            "times_s": col["times_s"],
        }
    first = next(iter(out["strategies"].values()))["median_s"]
    for s in out["strategies"].values():
        s["ratio_to_first"] = s["median_s"] / first
    return out


def table(out: dict) -> str:
    first = next(iter(out["strategies"]))
    lines = [
        (
            f"{out['config']} at {out['layers']} layers, batch {out['batch']} x seq {out['seq']}, mesh "
            f"{out['mesh']}, {out['platform']} ({out['device_kind']}); median of {out['steps']} steps "
            f"after {out['warmup']} warm-up"
        ),
        "",
        f"| strategy | model | ms/step (median) | ms/step (min) | tokens/s | time / {first} |",
        "|---|---|---|---|---|---|",
    ]
    for label, s in out["strategies"].items():
        lines.append(
            f"| {label} | {s['config']} ({s['linear']}) | {1e3 * s['median_s']:.1f} | "
            f"{1e3 * s['min_s']:.1f} | {s['tokens_per_s']:.0f} | {s['ratio_to_first']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "cola_60m.py"))
    ap.add_argument("--layers", type=int, default=2, help="override model.n_layers (CPU-sized)")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mesh", default="auto", help="data,fsdp,tensor or auto (1,1,min(4, devices))")
    ap.add_argument("--strategy", default="btp,vanilla,megatron", help="as comm_report's --strategy")
    ap.add_argument("--dtype", default="auto", help="model.dtype (auto: float32 on CPU, bfloat16 elsewhere)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", default=str(ROOT / "benchmarks" / "step_time.json"), help="write the times here")
    args = ap.parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be >= 1 (the first call compiles)")
    emulate_cpu_devices(4 if args.mesh == "auto" else math.prod(parse_mesh(args.mesh)))  # before jax loads
    out = run(args)
    print(table(out))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
