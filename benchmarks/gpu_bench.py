"""GPU benchmark (never run in CI): RMSNorm kernel bandwidth and single-GPU train steps.

    python benchmarks/gpu_bench.py [--steps 10] [--json benchmarks/gpu_bench.json]

1. RMSNorm forward+backward of the Pallas kernel vs XLA in GB/s, and as a fraction of the device's
   measured copy bandwidth (target >= 80%).
2. One-GPU train step of llama_1b vs cola_1b with each BOOST optimisation toggled (linear grouping,
   the norm kernel, the remat policy): step time, tokens/s, MFU and peak memory, one table, one run.
   Each variant runs in a fresh process so peak memory is its own.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
VARIANTS = [  # (name, config, overrides)
    ("llama_1b", "llama_1b", {}),
    ("cola_1b", "cola_1b", {}),
    ("cola_1b ungrouped", "cola_1b", {"model.group_linears": False}),
    ("cola_1b pallas norm", "cola_1b", {"kernels.rmsnorm": "pallas"}),
    ("cola_1b remat lowrank", "cola_1b", {"remat.policy": "lowrank"}),
    ("cola_1b remat full", "cola_1b", {"remat.policy": "full"}),
    ("llama_1b remat full", "llama_1b", {"remat.policy": "full"}),
]


def timed(fn, *args, steps: int) -> float:
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / steps


def norm_bandwidth(steps: int) -> list[dict]:
    from boost_jax.kernels.rmsnorm import rmsnorm
    rows, d = 16384, 4096
    x = jax.random.normal(jax.random.key(0), (rows, d), jnp.bfloat16)
    w = jnp.ones((d,), jnp.float32)
    gy = jax.random.normal(jax.random.key(1), (rows, d), jnp.bfloat16)
    copy = jax.jit(lambda a: a * 1)  # one read + one write
    copy_gbs = 2 * x.nbytes / timed(copy, x, steps=steps) / 1e9
    out = []
    for impl in ("xla", "pallas"):
        def loss(x, w, impl=impl):
            y, s = rmsnorm(x, w, 1e-6, impl=impl)
            return jnp.sum(y.astype(jnp.float32) * gy) + jnp.sum(s)
        step = jax.jit(jax.grad(loss, argnums=(0, 1)))
        secs = timed(step, x, w, steps=steps)
        # forward reads x, writes y (kept for nothing: fused) ; backward reads x, dy, writes dx:
        # the minimum traffic of fwd+bwd is read x twice, read dy, write dx (+ y once if materialised).
        moved = 4 * x.nbytes
        out.append({"impl": impl, "seconds": secs, "gb_per_s": moved / secs / 1e9,
                    "fraction_of_copy": moved / secs / 1e9 / copy_gbs, "copy_gb_per_s": copy_gbs})
    return out


def train_variant(config: str, overrides: dict, steps: int, seq: int, batch: int) -> dict:
    from boost_jax.config import load_config_file
    from boost_jax.metrics import peak_flops
    from boost_jax.model import flops_per_token
    from step_time import build  # the benchmarks' one way to build a real, allocated train step

    cfg = load_config_file(os.path.join(HERE, "..", "configs", f"{config}.py"))
    cfg.train.update(seq_len=seq, global_batch=batch, grad_accum=1)
    cfg.parallel.update(data=1, fsdp=1, tensor=1, num_devices=1)
    for key, value in overrides.items():
        section, name = key.split(".")
        cfg[section][name] = value
    step, state, tokens, _, _ = build(cfg, None)
    state, _ = step(state, tokens)
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, metrics = step(state, tokens)
    jax.block_until_ready(metrics)
    secs = (time.perf_counter() - t0) / steps
    tok_s = batch * seq / secs
    peak = peak_flops(jax.devices()[0].device_kind)
    mfu = flops_per_token(cfg.model, seq) * tok_s / peak if peak else None
    stats = jax.devices()[0].memory_stats() or {}
    return {"step_s": secs, "tokens_per_s": tok_s, "mfu": mfu, "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--json", default=os.path.join(HERE, "gpu_bench.json"))
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one train variant, print JSON
    args = ap.parse_args(argv)
    if args.variant is not None:
        name, config, overrides = VARIANTS[int(args.variant)]
        print(json.dumps(train_variant(config, overrides, args.steps, args.seq, args.batch)))
        return 0
    if jax.default_backend() == "cpu":
        print("gpu_bench needs a GPU (jax.default_backend() is 'cpu')", file=sys.stderr)
        return 1
    device = jax.devices()[0].device_kind
    print(f"device: {device}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}\n")
    norms = norm_bandwidth(args.steps)
    print("| rmsnorm fwd+bwd | ms | GB/s | of copy bandwidth |\n|---|---|---|---|")
    for r in norms:
        print(f"| {r['impl']} | {1e3 * r['seconds']:.3f} | {r['gb_per_s']:.0f} | {100 * r['fraction_of_copy']:.0f}% |")
    print(f"(copy bandwidth {norms[0]['copy_gb_per_s']:.0f} GB/s)\n")
    rows = []
    for i, (name, _, _) in enumerate(VARIANTS):
        r = subprocess.run([sys.executable, __file__, "--variant", str(i), "--steps", str(args.steps),
                            "--seq", str(args.seq), "--batch", str(args.batch)], capture_output=True, text=True)
        result = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-500:]}
        rows.append({"variant": name, **result})
    base = next((r for r in rows if r["variant"] == "llama_1b" and "step_s" in r), None)
    print(f"| variant (seq {args.seq}, batch {args.batch}) | step ms | tokens/s | MFU | peak GiB | speed-up vs llama_1b |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['variant']} | failed: {r['error'].splitlines()[-1] if r['error'] else '?'} |||||")
            continue
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        speed = f"{base['step_s'] / r['step_s']:.2f}x" if base else "n/a"
        print(f"| {r['variant']} | {1e3 * r['step_s']:.1f} | {r['tokens_per_s']:.0f} | {mfu} | {r['peak_gib']:.1f} | {speed} |")
    with open(args.json, "w") as f:
        json.dump({"device": device, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                   "rmsnorm": norms, "train": rows}, f, indent=2)
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
