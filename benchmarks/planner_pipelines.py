"""cola_13b on 16 and 32 GPUs: where pipelines win in the planner's model (issue 21).

For each cluster and device count, one search (batch 512 x seq 256, attention auto, every
pipeline x data x fsdp x tensor mesh, st allowed, GPipe and circular with every V, remat.pipeline
none/stage) and the best plan of each kind: unpipelined, GPipe, GPipe + stage remat, circular,
circular + stage remat. Prints markdown (benchmarks/planner.md, "cola_13b: where pipelines win").

    python benchmarks/planner_pipelines.py
    python benchmarks/planner_pipelines.py --smoke   # h100_8x on 8 GPUs only: checks the command
"""

from __future__ import annotations

import argparse
from pathlib import Path

from boost_jax.config import sized_config
from boost_jax.planner import Options, load_cluster, search
from boost_jax.planner.search import model_flops_per_token

ROOT = Path(__file__).resolve().parents[1]
# (name, pipeline stage counts, schedules, remat.pipeline): one restricted search each
KINDS = (
    ("no pipeline", (1,), ("gpipe",), ("none",)),
    ("gpipe", (2, 4, 8), ("gpipe",), ("none",)),
    ("gpipe + stage remat", (2, 4, 8), ("gpipe",), ("stage",)),
    ("circular", (2, 4, 8), ("circular",), ("none",)),
    ("circular + stage remat", (2, 4, 8), ("circular",), ("stage",)),
)


def row(name, p, best) -> str:
    if p is None:
        return f"| {name} | - | | | | | | | | |"
    sched = (
        "-"
        if p.mesh.pipeline == 1
        else (
            f"{p.schedule}{f' V{p.repeats}' if p.schedule == 'circular' else ''}"
            f" M{p.microbatches} ({100 * p.bubble:.0f}%)"
        )
    )
    return (
        f"| {name} | {p.mesh} | {sched} | {p.remat} x {p.grad_accum} | {p.layer.residual}: {' / '.join(p.layer.choices)} "  # noqa: E501
        f"| {p.step_s:.3f} | {p.step_s / best - 1:+.1%} | {100 * p.mfu:.1f}% | {p.memory['total'] / 1e9:.1f} "
        f"| {p.runnable} |"
    )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="one search set: h100_8x on 8 GPUs (checks the command)")
    args = ap.parse_args(argv)
    cfg = sized_config("13b", "cola")
    fpt = model_flops_per_token(cfg, 256)
    for cluster_name in ("h100_8x",) if args.smoke else ("h100_8x", "a100_4x"):
        cluster = load_cluster(ROOT / f"configs/clusters/{cluster_name}.py")
        for devices in (8,) if args.smoke else (16, 32):
            found = {
                name: search(
                    cfg,
                    cluster,
                    devices,
                    Options(batch=512, seq=256, pipeline=stages, schedules=sched, stage_remat=remat),
                    flops_per_token=fpt,
                )
                for name, stages, sched, remat in KINDS
            }
            best = min(r.plans[0].step_s for r in found.values() if r.plans)
            print(
                f"\n**cola_13b on {devices} x {cluster_name}** (batch 512 x seq 256; "
                f"{sum(r.considered for r in found.values())} plans priced, "
                f"{sum(r.rejected_memory for r in found.values())} over {cluster.usable_hbm / 1e9:.0f} GB)\n"
            )
            print(
                "| best of | mesh p x d x f x t | schedule, M (bubble) | remat x accum | residual: qkv / o / mlp_in / "
                "mlp_out | step s | vs best | MFU | GB/GPU | trainer |"
            )
            print("|---|---|---|---|---|---|---|---|---|---|")
            for name, *_ in KINDS:
                plans = found[name].plans
                print(row(name, plans[0] if plans else None, best))
                if plans and plans[0].runnable != "yes" and found[name].best_runnable is not None:
                    print(row(f"{name}, runnable", found[name].best_runnable, best))


if __name__ == "__main__":
    main()
