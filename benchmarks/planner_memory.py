"""The planner's peak memory per device against the compiled train step's memory_analysis().

    python benchmarks/planner_memory.py [--json benchmarks/planner_memory.json]
    python benchmarks/planner_memory.py --smoke   # one row (an st plan): checks the command

Each row compiles the trainer's step as `plan --verify` does (boost_jax.tools.comm_report's
compile_program: the full-depth scanned train step from abstract shapes, nothing allocated) on
emulated CPU devices in float32 (the CPU backend runs bf16 partly in float32, so float32 is the dtype
whose bytes it reports as a GPU would) and prices the same plan with the planner (act_bytes 4, the
attention the CPU runs). Shapes: d 256, 4 heads, ff 640, r 48, 3 layers, vocab 512, loss chunks of
64 positions, batch 4 x seq 192, so activations dominate. Two rows are marked fitted: they set
cost.BUFFER_OVERHEAD and the factor 1/2 of operators.StMatmul.ring; the others are held out
(tests/test_planner.py checks 7B-width plans and the `--verify` shapes within 15%).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICES = 8
SHAPES = dict(
    d_model=256,
    n_heads=4,
    n_kv_heads=4,
    d_ff=640,
    rank=48,
    n_layers=3,
    vocab_size=512,
    max_seq_len=256,
    loss_chunk=64,
    only_lr_act=False,
)
BATCH, SEQ = 4, 192
# (strategy, linear, mesh, st groups or None, remat, attention)
CASES = [
    ("btp", "cola", (1, 2, 2), None, "none", "xla"),
    ("btp", "cola", (1, 2, 2), ("st",) * 4, "none", "xla"),
    ("btp", "cola", (1, 2, 2), ("btp", "st", "btp", "btp"), "none", "xla"),
    ("megatron", "dense", (1, 2, 2), None, "none", "xla"),
    ("megatron", "dense", (1, 2, 2), ("st",) * 4, "none", "xla"),
    ("megatron", "cola", (1, 2, 2), None, "none", "xla"),
    ("vanilla", "cola", (1, 2, 2), None, "none", "xla"),
    ("btp", "cola", (1, 2, 2), None, "none", "chunked"),
    ("btp", "lowrank", (1, 2, 2), None, "none", "xla"),
    ("btp", "cola", (1, 2, 2), None, "lowrank", "xla"),
    ("btp", "cola", (1, 2, 2), None, "full", "xla"),
    ("btp", "cola", (1, 2, 2), ("st",) * 4, "full", "xla"),
    ("btp", "dense", (1, 1, 1), None, "none", "xla"),
]
# The rows that set a constant of the model (cost.BUFFER_OVERHEAD; StMatmul.ring's factor 1/2).
FITTED = {0: "BUFFER_OVERHEAD", 11: "st ring factor"}
SMOKE_CASES = (1,)  # --smoke: the st plan on a 2 x 2 mesh


def measure(case) -> dict:
    from boost_jax.config import base_config
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
    from boost_jax.planner.ops.strategy_tables import uniform_plan
    from boost_jax.planner.pricing.trainer_flags import linear_partition
    from boost_jax.tools.comm_report.programs import compile_program, memory_breakdown, variant_config
    from boost_jax.tools.devices import pick_devices

    strategy, linear, mesh, choices, remat, attention = case
    base = base_config()
    base.model.update(linear=linear, attention=attention, **SHAPES)
    cfg = variant_config(base, strategy, linear, mesh, BATCH, SEQ, "float32", remat)
    residual, uniform, attn_layout, act = uniform_plan(strategy)
    layer = (
        Layer("R", ("none",) * 4, "R", "R") if mesh[2] == 1 else Layer(residual, choices or uniform, attn_layout, act)
    )
    cfg.parallel.linear_partition = linear_partition(layer)
    start = time.perf_counter()
    compiled, _, _ = compile_program(
        cfg, "train_step", pick_devices(DEVICES)[: mesh[0] * mesh[1] * mesh[2]], cfg.model.n_layers, unroll=False
    )
    xla = memory_breakdown(compiled)
    cluster = load_cluster(ROOT / "configs/clusters/a100_4x.py")  # memory does not depend on the cluster
    plan = plan_for(
        cfg,
        cluster,
        Mesh(*mesh),
        1,
        remat,
        layer,
        Options(batch=BATCH, seq=SEQ, attention=attention, act_bytes=4, check_memory=False),
        0.0,
    )
    return {
        "plan": f"{strategy} {'/'.join(layer.choices)}",
        "linear": linear,
        "mesh": "x".join(map(str, mesh)),
        "remat": remat,
        "attention": attention,
        "compiled_bytes": xla["total_bytes"],
        "planner_bytes": plan.memory["total"],
        "ratio": plan.memory["total"] / xla["total_bytes"],
        "planner_parts": {k: v for k, v in plan.memory.items() if k != "total"},
        "compile_s": round(time.perf_counter() - start, 1),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks/planner_memory.json"))
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one row only (checks the command; JSON to the temp directory unless --json)",
    )
    args = ap.parse_args(argv)
    if args.smoke and args.json == ap.get_default("json"):
        args.json = str(Path(tempfile.gettempdir()) / "planner_memory_smoke.json")
    sys.path.insert(0, str(ROOT))
    from boost_jax.tools.devices import emulate_cpu_devices

    emulate_cpu_devices(DEVICES)  # before jax is imported
    rows = []
    print(
        "| plan | linear | mesh | remat | attention | compiled MB | planner MB | planner / compiled | |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    for i, case in enumerate(CASES):
        if args.smoke and i not in SMOKE_CASES:
            continue
        r = measure(case)
        r["fitted"] = FITTED.get(i, "")
        rows.append(r)
        print(
            f"| {r['plan']} | {r['linear']} | {r['mesh']} | {r['remat']} | {r['attention']} "
            f"| {r['compiled_bytes'] / 1e6:.1f} | {r['planner_bytes'] / 1e6:.1f} | {r['ratio']:.3f} "
            f"| {'fitted (' + r['fitted'] + ')' if r['fitted'] else 'held out'} |",
            flush=True,
        )
    held = [r["ratio"] for r in rows if not r["fitted"]]
    if held:
        print(f"\nheld out: planner / compiled {min(held):.3f} - {max(held):.3f} over {len(held)} plans")
    Path(args.json).write_text(
        json.dumps({"shapes": SHAPES, "batch": BATCH, "seq": SEQ, "dtype": "float32", "rows": rows}, indent=1) + "\n"
    )
    return 0 if all(abs(r["ratio"] - 1) <= 0.15 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
