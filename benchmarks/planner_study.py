"""Where PrimePar's spatial-temporal (st) plans win or lose against BTP / Megatron, per the planner.

    python benchmarks/planner_study.py [--json benchmarks/planner_study.json] [--seq 256 --batch 512]
    python benchmarks/planner_study.py --smoke   # one search, cola_7b on 8 x h100_8x: checks the command

For cola_7b and llama_7b on 16 and 64 GPUs of the a100_4x and h100_8x clusters, one search each
(the config's recipe, batch 512 x seq 256 unless given; attention auto, i.e. cuDNN's fused kernel in
bf16), and four plans per search:
  best      the fastest plan that fits;
  baseline  the fastest plan the trainer runs with its default partition (btp for CoLA, megatron
            for the dense LLaMA) in every group;
  st        the fastest plan with at least one st group;
  base@st   the baseline strategy's partition (the st plan's strategy, sequence parallelism and
            residual layout, every group the strategy's own) on the st plan's mesh, accumulation,
            remat and pipeline schedule (GPipe or circular, V, M, stage remat), so that
            st's own effect is isolated: compute (GEMMs, attention, elementwise; st's permutes hide
            under its GEMMs), exposed tensor-axis traffic, and memory (st keeps no gathered weights).
Prints a Markdown table per search and writes every number to JSON. Predictions of the cost model
(boost_jax/planner), not measurements: see benchmarks/planner.md for what is fitted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ("cola_7b", "llama_7b")
CLUSTERS = ("a100_4x", "h100_8x")
DEVICES = (16, 64)


def schedule_name(p) -> str:
    """The pipeline schedule as the tables show it: "-" unpipelined, "gpipe M8", "circular V2 M4",
    "+stage" appended under remat.pipeline=stage."""
    if p.mesh.pipeline == 1:
        return "-"
    name = f"circular V{p.repeats}" if p.schedule == "circular" else p.schedule
    return f"{name} M{p.microbatches}" + (" +stage" if p.stage_remat == "stage" else "")


def describe(p, layers: int) -> dict:
    m, lc = p.memory, p.layer_cost
    return {
        "mesh": str(p.mesh),
        "schedule": schedule_name(p),
        "pipeline_schedule": p.schedule,
        "repeats": p.repeats,
        "microbatches": p.microbatches,
        "stage_remat": p.stage_remat,
        "layer": str(p.layer),
        "remat": p.remat,
        "grad_accum": p.grad_accum,
        "runnable": p.runnable,
        "step_s": p.step_s,
        "mfu": p.mfu,
        "layer_compute_ms": 1e3 * lc.compute,
        "layer_tp_comm_ms": 1e3 * lc.comm,
        "layer_recompute_ms": 1e3 * lc.recompute,
        "layers_ms": 1e3 * layers * lc.total * p.grad_accum,
        "exposed_dp_ms": 1e3 * p.exposed_dp_s * p.grad_accum,
        "link_gb": {k: v / 1e9 for k, v in p.link_bytes.items()},
        "memory_gb": m["total"] / 1e9,
        "states_gb": m["states"] / 1e9,
        "kept_gb": (m["weights"] + m["gathered"] + m["activations"]) / 1e9,
        "transient_gb": m["transient"] / 1e9,
    }


def study(config: str, cluster_name: str, devices: int, batch: int | None, seq: int | None) -> dict:
    from boost_jax.config import load_config_file
    from boost_jax.planner import Layer, Options, load_cluster, plan_for, search
    from boost_jax.planner.ops.operators import Block
    from boost_jax.planner.ops.strategy_tables import uniform_plan
    from boost_jax.planner.search import model_flops_per_token

    cfg = load_config_file(ROOT / f"configs/{config}.py")
    cluster = load_cluster(ROOT / f"configs/clusters/{cluster_name}.py")
    batch, seq = batch or int(cfg.train.global_batch), seq or int(cfg.train.seq_len)
    cfg.model.max_seq_len = max(int(cfg.model.max_seq_len), seq)
    opts = Options(batch=batch, seq=seq, top=10**6)
    fpt = model_flops_per_token(cfg, seq)
    res = search(cfg, cluster, devices, opts, flops_per_token=fpt)
    block = Block.from_config(cfg)
    base = "btp" if block.factored else "megatron"
    layers = block.layers
    with_st = [p for p in res.plans if "st" in p.layer.choices]
    picks = {
        "best": res.plans[0] if res.plans else None,
        "baseline": next(
            (p for p in res.plans if set(p.layer.choices) <= {base, "none"} and p.runnable == "yes"), None
        ),
        "st": next((p for p in with_st if p.runnable == "yes"), None),
    }
    if with_st and picks["st"] is not None and with_st[0].step_s < 0.99 * picks["st"].step_s:
        picks["st (not runnable)"] = with_st[0]  # only when it is more than 1% faster
    st = picks["st"]
    groups = []
    if st is not None:
        uniform = Layer(*uniform_plan(st.strategy, st.sequence_parallel))  # same strategy and residual
        pipelined = st.mesh.pipeline > 1
        picks["base@st"] = plan_for(
            cfg,
            cluster,
            st.mesh,
            st.grad_accum,
            st.remat,
            uniform,
            opts,
            fpt,
            st.microbatches if pipelined else 0,
            schedule=st.schedule,
            repeats=st.repeats,
            stage_remat=st.stage_remat,
        )
        groups = group_breakdown(block, cluster, st, base, seq, opts)
    out = {
        "config": config,
        "cluster": cluster_name,
        "devices": devices,
        "batch": batch,
        "seq": seq,
        "considered": res.considered,
        "over_memory": res.rejected_memory,
        "usable_hbm_gb": cluster.usable_hbm / 1e9,
        "st_plans_fitting": len(with_st),
        "plans": {k: describe(p, layers) if p is not None else None for k, p in picks.items()},
        "st_groups": groups,
    }
    return out


def group_breakdown(block, cluster, plan, base: str, seq: int, opts) -> list[dict]:
    """Each st group of `plan` next to the baseline's choice for it on the same micro-batch and
    mesh, forward + backward on one device, with the redistribution into and out of the group from
    the plan's neighbouring layouts: GEMM time, the communication left exposed (st: permutes the GEMM
    steps do not hide, and edge collectives; the baseline: its tensor-axis collectives)."""
    from boost_jax.config import PROJECTION_GROUPS
    from boost_jax.planner.ops.edges import edge
    from boost_jax.planner.ops.operators import Ctx
    from boost_jax.planner.ops.projections import group_choices, group_op, partial_input_grad
    from boost_jax.planner.pricing import cost as C
    from boost_jax.planner.pricing.plans import Cost

    kind = C.attention_kind(opts.attention, block, seq, opts.act_bytes)
    ctx = Ctx(block, plan.mesh.tensor, plan.tokens, seq, True, kind, opts.act_bytes)
    layer = plan.layer
    around = {
        "qkv": (layer.residual, layer.attention),
        "o": (layer.attention, layer.residual),
        "mlp_in": (layer.residual, layer.act),
        "mlp_out": (layer.act, layer.residual),
    }
    out = []
    for group, choice in zip(PROJECTION_GROUPS, layer.choices):
        if choice != "st":
            continue
        din, douts = block.projections(group)
        row = {"group": group}
        for name, c in (("st", "st"), ("base", base)):
            _, lin, lout, split = next(x for x in group_choices(ctx, group) if x[0] == c)
            src, dst = around[group]
            ops = [
                group_op(ctx, group, split),
                edge(ctx, src, lin, din, partial_input_grad(block, split)),
                edge(ctx, lout, dst, sum(douts) if group in ("qkv", "mlp_in") else block.d),
            ]
            cost = sum((C.price(op, cluster, act_bytes=opts.act_bytes) for op in ops), Cost())
            gemm = sum(3 * s.n * C.gemm_seconds(s.m, s.k / s.n, s.out / s.n, cluster) for s in ops[0].st) + 3 * sum(
                C.gemm_seconds(g.m, g.k, g.n, cluster) for g in ops[0].gemms
            )
            elementwise = sum(
                cluster.elementwise_passes * op.acts * opts.act_bytes / cluster.hbm_bandwidth for op in ops
            )
            row[f"{name}_gemm_ms"] = 1e3 * gemm
            row[f"{name}_exposed_comm_ms"] = 1e3 * (cost.total - gemm - elementwise)
            row[f"{name}_moved_mb"] = sum(c.elements for op in ops for c in op.all_colls()) * opts.act_bytes / 1e6
        out.append(row)
    return out


def markdown(s: dict) -> str:
    head = (
        f"**{s['config']} on {s['devices']} x {s['cluster']}** (batch {s['batch']} x seq {s['seq']}; "
        f"{s['considered']} plans priced, {s['over_memory']} over {s['usable_hbm_gb']:.0f} GB, "
        f"{s['st_plans_fitting']} distinct st partitionings fit)\n\n"
        "| plan | mesh p x d x f x t | schedule | residual: qkv / o / mlp_in / mlp_out | remat x accum | step s "
        "| MFU | layer compute / TP comm ms | exposed data/fsdp ms | link GB intra / inter | GB/GPU (states / "
        "kept / transient) | trainer |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for name, p in s["plans"].items():
        if p is None:
            lines.append(f"| {name} | - | - | none fits | | | | | | | | |")
            continue
        parts = p["layer"].split("|")
        choices = parts[0].replace("res", "").strip() + ": " + parts[1].strip().replace("/", " / ")
        lines.append(
            f"| {name} | {p['mesh']} | {p['schedule']} | {choices} | {p['remat']} x {p['grad_accum']} | {p['step_s']:.3f} "  # noqa: E501
            f"| {100 * p['mfu']:.1f}% | {p['layer_compute_ms']:.2f} / {p['layer_tp_comm_ms']:.2f} "
            f"| {p['exposed_dp_ms']:.1f} | {p['link_gb']['intra']:.1f} / {p['link_gb']['inter']:.1f} "
            f"| {p['memory_gb']:.1f} ({p['states_gb']:.1f} / {p['kept_gb']:.1f} / {p['transient_gb']:.1f}) "
            f"| {p['runnable']} |"
        )
    if s["st_groups"]:
        lines.append(
            "\nst groups of the `st` plan against the baseline's choice, one micro-batch fwd + bwd per device:"
        )
        for g in s["st_groups"]:
            lines.append(
                f"- {g['group']} (with the redistributions into and out of it): st GEMMs "
                f"{g['st_gemm_ms']:.2f} ms + exposed communication {g['st_exposed_comm_ms']:.2f} ms "
                f"({g['st_moved_mb']:.0f} MB sent); baseline GEMMs {g['base_gemm_ms']:.2f} ms + "
                f"{g['base_exposed_comm_ms']:.2f} ms ({g['base_moved_mb']:.0f} MB)"
            )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=str(ROOT / "benchmarks/planner_study.json"))
    ap.add_argument("--batch", type=int, default=0, help="global batch (default: the config's)")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the config's)")
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one search, cola_7b on 8 GPUs of h100_8x (checks the command; JSON to the temp directory unless --json)",
    )
    args = ap.parse_args(argv)
    if args.smoke and args.json == ap.get_default("json"):
        args.json = str(Path(tempfile.gettempdir()) / "planner_study_smoke.json")
    sys.path.insert(0, str(ROOT))
    results = []
    for config in CONFIGS[:1] if args.smoke else CONFIGS:
        for cluster in ("h100_8x",) if args.smoke else CLUSTERS:
            for devices in (8,) if args.smoke else DEVICES:
                s = study(config, cluster, devices, args.batch or None, args.seq or None)
                results.append(s)
                print(markdown(s) + "\n", flush=True)
    Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
