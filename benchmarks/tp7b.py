"""The planner against the step-time table on BOOST's 7B TP-4 rows (cola_7b BTP and vanilla, llama_7b Megatron
on 4 H100s and 4 A100-40GB; seq 4096, 4 micro-batches of one row, remat none, the `auto` defaults).

    python benchmarks/tp7b.py [--stack auto|scanned] [--clusters configs/clusters] [--markdown PATH]
        [--exposure] [--parts]

Each row's table is benchmarks/tp7b/CONFIG_STRATEGY_TARGET.json, written by `python -m boost_jax.tools.aot
--target TARGET --devices 4 --config configs/CONFIG.py --mesh 1,1,4 --train-only --profile
--config.parallel.strategy=STRATEGY --config.train.seq_len=4096 --config.train.global_batch=4
--config.train.grad_accum=4 --config.remat.policy=none --config.model.max_seq_len=4096 --json ...`.
The planner prices the strategy's plan (strategy_tables.uniform_plan) on the cluster file of that GPU
with the stack the recorded program ran (`--stack scanned`: the scanned stack, as the planner priced a
tensor mesh before it mirrored `auto`'s unrolling). tests/test_planner_time.py holds the rows within 15%.
`--exposure`: the share s of the layers' backward tensor-axis collectives the step would wait for (the
forward ones on the critical path) that fits the six rows best (least squares of planner / table - 1,
s from 0 to 1.5), and the layers' all-reduces per layer and micro-batch, planner and compiled program.
`--parts`: the layers' GEMMs, attention, bandwidth-bound work and tensor collectives, planner and table
(the table's elementwise, norm and copies/layout together; its collectives at their exposed part).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = [("cola_7b", "btp"), ("cola_7b", "vanilla"), ("llama_7b", "megatron")]
CLUSTERS = {"h100": "h100_8x", "a100_40gb": "a100_4x"}


MESH = {"pipeline": 1, "data": 1, "fsdp": 1, "context": 1, "tensor": 4}


def record(config: str, strategy: str, target: str) -> dict:
    """The recorded table of one row, checked to be the program the row names (ValueError otherwise)."""
    path = ROOT / "benchmarks" / "tp7b" / f"{config}_{strategy}_{target}.json"
    rec = json.loads(path.read_text())
    got = (rec.get("target"), rec.get("config"), rec.get("mesh"), rec.get("resolved", {}).get("remat.policy"))
    if got != (target, f"configs/{config}.py", MESH, "none") or "profile" not in rec:
        raise ValueError(f"{path}: not the {config} {target} TP-4 remat-none step with --profile; rerun its command")
    return rec


def rows(stack: str = "auto", clusters=ROOT / "configs" / "clusters") -> list[dict]:
    """One dict per row: config, strategy, target, table_ms, planner_ms, ratio, ... `clusters`: the cluster
    files' folder, or {target: Cluster} (those targets alone)."""
    from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
    from boost_jax.planner.ops.strategy_tables import uniform_plan
    from boost_jax.planner.pricing import cost
    from boost_jax.tools.devices import load_config

    if not isinstance(clusters, dict):
        clusters = {t: load_cluster(Path(clusters) / f"{name}.py") for t, name in CLUSTERS.items()}
    out = []
    for target, cluster in clusters.items():
        for config, strategy in ROWS:
            rec = record(config, strategy, target)
            cfg = load_config(str(ROOT / "configs" / f"{config}.py"))
            cfg.model.max_seq_len = 4096
            plan = plan_for(
                cfg,
                cluster,
                Mesh(1, 1, 4),
                4,
                "none",
                Layer(*uniform_plan(strategy)),
                Options(batch=4, seq=4096, check_memory=False),
                unrolled=stack == "auto" and bool(rec["resolved"]["model.scan_unroll"]),
            )
            table = rec["profile"]["predicted_step_s"] * 1e3
            by = {k: v * 1e3 for k, v in rec["profile"]["time_by_category"].items()}
            tensor = [c for c in plan.layer_colls if c.axis == "tensor"]
            backward = sum(cost.coll_seconds(c, cluster, 2) for c in tensor if c.phase != "fwd") * 4 * 32e3
            out.append(
                dict(
                    config=config,
                    strategy=strategy,
                    target=target,
                    table_ms=table,
                    planner_ms=plan.step_s * 1e3,
                    ratio=plan.step_s * 1e3 / table,
                    backward_ms=backward,
                    planner_all_reduces=sum(c.kind == "all-reduce" for c in tensor),
                    table_all_reduces=layer_all_reduces(rec),
                    planner_parts=layer_parts(cfg, cluster, strategy),
                    table_parts={
                        "gemm": by["gemm"],
                        "attention": by["attention"],
                        "elementwise": by["elementwise"] + by["norm"] + by["copies/layout"],
                        "collectives": by["collectives"],
                    },
                )
            )
    return out


# Where the layers' all-reduces come from in the compiled program (the step-time table's sources); the
# loss's, the embedding's and the optimizer's are the step's, not a layer's.
LAYER_SOURCES = ("parallel/rules.py:weight_einsum", "parallel/online_norm.py", "parallel/placement.py")


def layer_all_reduces(rec: dict) -> float:
    """The recorded program's all-reduces per layer and micro-batch (4 x 32 of them): those the layers'
    code issues (LAYER_SOURCES), each as often as the step runs it."""
    ks = rec["profile"]["collectives"]["by_kernel"]
    n = sum(k["count"] for k in ks if k["kind"] == "all-reduce" and any(s in k["source"] for s in LAYER_SOURCES))
    return n / (4 * 32)


def layer_parts(cfg, cluster, strategy: str) -> dict:
    """ms per step of the layers' GEMMs, attention, elementwise work and tensor collectives, as the planner
    prices them (4 micro-batches x 32 layers)."""
    from boost_jax.planner import Layer, Options
    from boost_jax.planner.ops.operators import Block, Ctx
    from boost_jax.planner.ops.strategy_tables import uniform_plan
    from boost_jax.planner.pricing import cost
    from boost_jax.planner.pricing.layer_summary import layer_summary
    from boost_jax.planner.pricing.pricer import Pricer
    from boost_jax.planner.search import plan_attention

    opts = Options(batch=4, seq=4096, check_memory=False)
    block = Block.from_config(cfg)
    kind = plan_attention(opts, block, 1)
    pr = Pricer(Ctx(block, 4, 4096, 4096, False, kind, 2, 1, "ring", "full"), cluster, "none", opts)
    ops = layer_summary(pr, Layer(*uniform_plan(strategy))).ops
    n = 4 * 32 * 1e3
    return {
        "gemm": n
        * sum(op.gemm_passes * sum(cost.gemm_seconds(g.m, g.k, g.n, cluster) for g in op.gemms) for op in ops),
        "attention": n * sum(sum(cost.attention_seconds(op.attn, kind, cluster)) for op in ops if op.attn),
        "elementwise": n * sum(cluster.elementwise_passes * op.acts * 2 / cluster.hbm_bandwidth for op in ops),
        "collectives": n
        * sum(cost.coll_seconds(c, cluster, 2) for op in ops for c in op.all_colls() if c.axis == "tensor"),
    }


def exposure(rs: list[dict]) -> tuple[float, float]:
    """(s, RMS of planner / table - 1) with the backward layer collectives priced at share s."""
    import numpy as np

    shares = np.linspace(0.0, 1.5, 151)
    rms = [
        np.sqrt(np.mean([((r["planner_ms"] - (1 - s) * r["backward_ms"]) / r["table_ms"] - 1) ** 2 for r in rs]))
        for s in shares
    ]
    i = int(np.argmin(rms))
    return float(shares[i]), float(rms[i])


def markdown(rs: list[dict]) -> str:
    lines = ["| row | GPU | table ms | planner ms | planner / table |", "|---|---|---|---|---|"]
    for r in rs:
        lines.append(
            f"| {r['config']} {r['strategy']} | {r['target']} | {r['table_ms']:.1f} | {r['planner_ms']:.1f} "
            f"| {r['ratio']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", choices=("auto", "scanned"), default="auto", help="the stack the planner prices")
    ap.add_argument("--clusters", default=str(ROOT / "configs" / "clusters"), help="the cluster files' folder")
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--exposure", action="store_true", help="also fit the backward collectives' exposed share")
    ap.add_argument("--parts", action="store_true", help="also the layers' parts, planner / table")
    args = ap.parse_args(argv)
    rs = rows(args.stack, Path(args.clusters))
    text = markdown(rs)
    if args.parts:
        text += "\n\n| row | GPU | " + " | ".join(f"{k} planner / table ms" for k in rs[0]["table_parts"]) + " |"
        text += "\n|---|---|" + "---|" * len(rs[0]["table_parts"])
        for r in rs:
            cells = " | ".join(f"{r['planner_parts'][k]:.1f} / {v:.1f}" for k, v in r["table_parts"].items())
            text += f"\n| {r['config']} {r['strategy']} | {r['target']} | {cells} |"
    if args.exposure:
        share, rms = exposure(rs)
        at_one = exposure([dict(r, backward_ms=0.0) for r in rs])[1]
        text += (
            f"\n\nbackward exposed share fitted: {share:.2f} (RMS {rms:.3f}; at 1, as priced: {at_one:.3f}); "
            "all-reduces per layer and micro-batch, planner / compiled: "
            + ", ".join(
                f"{r['config']} {r['strategy']} {r['target']} {r['planner_all_reduces']} / {r['table_all_reduces']:.1f}"
                for r in rs
            )
        )
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
