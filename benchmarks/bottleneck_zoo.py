"""The bottleneck family side by side: dense vs lowrank vs cola vs tt vs sltrain.

    python benchmarks/bottleneck_zoo.py [--steps 300] [--no-comm] [--kinds dense,lowrank,cola,tt,sltrain]
    python benchmarks/bottleneck_zoo.py --smoke   # 2 steps of 1-layer models, comm at seq 128: checks the command

1. Training at the tiny size (configs/tiny.py: d 128, 4 layers, r 32) on the embedded corpus, every
   kind on the same token budget (steps x batch x seq), same seed and data order: final eval loss,
   trained parameters, model FLOPs per token, median step time (wall clock of this machine: read it as
   a ratio between rows measured in one run).
2. The comm report at 7B shapes (cola_7b: d 4096, I 11008, 32 heads, r 1024; 4 emulated devices on the
   tensor axis, batch 1 x seq 4096, bf16): per-layer forward traffic on the tensor axis, in elements
   per token and in units of r, and the number of collectives. Low-rank kinds run BTP; dense runs
   Megatron (its natural plan; BTP is for bottlenecks).
Prints one Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile

# Kind fields at each size. tt: 2 + 2 cores at tiny (modes 16 x 8), BOOST's 6 at 7B, inner ranks r/4,
# SiLU at the bottleneck like CoLA; sltrain: SLTrain's density 0.03 and alpha 32, 4 x 4 blocks at tiny
# (16 x 16 leaves too few blocks in a 128 x 128 matrix), 16 x 16 at 7B.
KINDS = {
    "dense": ({}, {}),
    "lowrank": ({}, {}),
    "cola": ({}, {}),
    "tt": (
        {"tt_cores": 4, "tt_inner_rank": 8, "tt_activation": "silu"},
        {"tt_cores": 6, "tt_inner_rank": 256, "tt_activation": "silu"},
    ),
    "sltrain": (
        {"sparse_block": 4, "sparse_density": 0.03, "sltrain_alpha": 32.0},
        {"sparse_block": 16, "sparse_density": 0.03, "sltrain_alpha": 32.0},
    ),
}


def train_row(kind: str, fields: dict, steps: int, layers: int | None = None) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from boost_jax import train
    from boost_jax.config import base_config
    from boost_jax.model import build_model, flops_per_token

    cfg = base_config()
    cfg.model.update(linear=kind, only_lr_act=False, **fields)
    if layers:
        cfg.model.n_layers = layers
    cfg.train.update(
        steps=steps,
        warmup_steps=steps // 10,
        eval_every=steps,
        eval_batches=8,
        log_every=max(steps // 20, 1),
        progress=False,
    )
    cfg.checkpoint.update(every=steps, async_save=False)
    cfg.parallel.num_devices = 1
    with tempfile.TemporaryDirectory() as tmp:
        cfg.run_dir = tmp
        out = train.run(cfg)
        rows = [json.loads(line) for line in open(out["metrics"])]
    times = [r["step_time_s"] for r in rows if "step_time_s" in r][1:]  # the first window holds the compile
    state = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: build_model(cfg.model))))
    trained = sum(math.prod(x.shape) for x in jax.tree.leaves(state) if np.issubdtype(x.dtype, np.inexact))
    return {
        "kind": kind,
        "fields": fields,
        "tokens": steps * cfg.train.global_batch * cfg.train.seq_len,
        "final_eval_loss": out["evals"][-1][1],
        "params": trained,
        "flops_per_token": flops_per_token(cfg.model, cfg.train.seq_len),
        "step_time_s": statistics.median(times),
    }


def comm_row(kind: str, fields: dict, seq: int = 4096) -> dict:
    from boost_jax.config import sized_config
    from boost_jax.tools.comm_report import command as comm_report

    cfg = sized_config("7b", kind)
    cfg.model.update(only_lr_act=False, **fields)
    strategy = "megatron" if kind == "dense" else "btp"
    rep = comm_report.report(
        cfg,
        strategies=strategy,
        programs=("forward",),
        mesh=(1, 1, 4),
        batch=1,
        seq=seq,
        dtype="bfloat16",
        memory=False,
    )
    fwd = rep["strategies"][strategy]["per_layer_forward"]["tensor"]
    return {
        "strategy": strategy,
        "tp_fwd_elements_per_token": fwd["elements_per_token"],
        "tp_fwd_in_r": fwd["elements_per_token"] / cfg.model.rank,
        "tp_fwd_collectives": fwd["count"],
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--no-comm", action="store_true", help="skip the 7B comm report")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of the kinds")
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "bottleneck_zoo.json"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="2 steps of 1-layer models and the comm report at seq "
        "128: checks the command (JSON to the temp directory unless --json)",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps = 2 if args.steps == ap.get_default("steps") else args.steps
        if args.json == ap.get_default("json"):
            args.json = os.path.join(tempfile.gettempdir(), "bottleneck_zoo_smoke.json")
    from boost_jax.tools.devices import emulate_cpu_devices

    emulate_cpu_devices(4)  # before jax is imported; training runs on the first device
    import jax

    unknown = sorted(set(args.kinds.split(",")) - set(KINDS))
    if unknown:
        ap.error(f"--kinds: unknown {unknown}; choose from {','.join(KINDS)}")
    rows = []
    for kind in args.kinds.split(","):
        tiny, big = KINDS[kind]
        row = train_row(kind, tiny, args.steps, 1 if args.smoke else None)
        if not args.no_comm:
            row.update(comm_row(kind, big, 128 if args.smoke else 4096))
        rows.append(row)
        print(f"{kind}: done", file=sys.stderr)
    print(
        f"tiny (d 128, L {1 if args.smoke else 4}, r 32), {rows[0]['tokens']:,} tokens each, one "
        f"{jax.devices()[0].platform} device; 7B traffic: comm report, tensor 4, seq {128 if args.smoke else 4096}, "
        "per layer forward\n"
    )
    print(
        "| kind | final eval loss | params | FLOPs/token | step time (ms) | 7B plan | TP traffic/token/layer | "
        "in r | collectives |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        comm = (
            "| {strategy} | {tp_fwd_elements_per_token:,.0f} | {tp_fwd_in_r:.2f} | {tp_fwd_collectives} |".format(**r)
            if "strategy" in r
            else "| - | - | - | - |"
        )
        print(
            f"| {r['kind']} | {r['final_eval_loss']:.3f} | {r['params'] / 1e6:.2f}M | "
            f"{r['flops_per_token'] / 1e6:.2f}M | {1e3 * r['step_time_s']:.0f} " + comm
        )
    with open(args.json, "w") as f:
        json.dump(
            {"steps": args.steps, "smoke": args.smoke, "backend": jax.default_backend(), "rows": rows}, f, indent=2
        )
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
