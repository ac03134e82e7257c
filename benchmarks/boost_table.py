"""BOOST's table re-priced: full-rank (llama_* with `parallel.strategy=megatron`), vanilla low-rank TP (cola_*
`vanilla`) and BTP (cola_* `btp`) for the paper's 3B TP 2, 7B TP 4 and 13B TP 4 x PP 2 rows (seq 4096, 4
micro-batches of one row, the `auto` defaults; remat none, and 13B at remat full too), each priced by the
step-time table of its compiled program and by the planner, beside BOOST's measured iteration times (A100),
with BTP's speedups.

    python benchmarks/boost_table.py [--target a100_40gb|h100] [--out DIR] [--cluster FILE]

Each row's table is the `tools.aot --profile` record of its program, written by `command(...)`: 7B's in
benchmarks/tp7b/ (benchmarks/tp7b.py's), 3B's and 13B's in benchmarks/boost_table/ (13B: pipeline 2 x
tensor 4, parallel.microbatches=4 under the default gpipe schedule, no accumulation). The planner prices
the strategy's plan (strategy_tables.uniform_plan) on the target's cluster file with the stack the program
ran. Writes OUT/boost_table.md and .json (h100: boost_table_h100.*; OUT: benchmarks/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from boost_jax.planner import Layer, Mesh, Options, load_cluster, plan_for
from boost_jax.planner.ops.strategy_tables import uniform_plan
from boost_jax.tools.devices import load_config

ROOT = Path(__file__).resolve().parents[1]
TARGET = "a100_40gb"  # the paper's GPU (its nodes: a100_4x); h100 rows too, without paper numbers
CLUSTERS = {"a100_40gb": "a100_4x", "h100": "h100_8x"}
CLUSTER_DIR = ROOT / "configs" / "clusters"
# (size, tensor, pipeline, remat.policy): the paper's rows, remat none as BOOST runs 7B; 13B's remat-none steps
# do not fit 40 GB (their compiled peak is shown), so 13B is priced with remat full too
SHAPES = [("3b", 2, 1, "none"), ("7b", 4, 1, "none"), ("13b", 4, 2, "none"), ("13b", 4, 2, "full")]
# (config family, parallel.strategy, the paper's name)
STRATEGIES = [("llama", "megatron", "full-rank"), ("cola", "vanilla", "vanilla"), ("cola", "btp", "BTP")]
# BOOST's README: end-to-end iteration, 7B on 4 A100s, TP 4 (reference/boost.md); no other row is measured
PAPER_MS = {("7b", "megatron"): 1060.0, ("7b", "vanilla"): 1640.0, ("7b", "btp"): 720.0}
PAPER_HEADLINE = "1.46-1.91x over full-rank, 1.87-2.27x over vanilla low-rank (3D parallelism)"
SEQ, MICRO = 4096, 4
# all-reduce elements per token per layer, forward + backward, reference/boost.md: Megatron 2d + 2d, BTP 7r + 7r,
# vanilla 2 (5d + 2I); a record's own count must lie within BOUNDS of its strategy's (the strategy check)
BOUNDS = (0.7, 1.75)


def volume(strategy: str, d: int, inner: int, rank: int) -> float:
    """The tensor all-reduce elements per token per layer (forward + backward) of a strategy."""
    return {"megatron": 4 * d, "btp": 14 * rank, "vanilla": 2 * (5 * d + 2 * inner)}[strategy]


def gemm_params(cfg) -> float:
    """The parameters the step multiplies by (every projection, the LM head; not the embedding lookup)."""
    m = cfg.model
    d, inner, r = m.d_model, m.d_ff, m.rank
    kv = d * m.n_kv_heads // m.n_heads
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, inner), (d, inner), (inner, d)]
    if m.linear == "dense":
        per_layer = sum(a * b for a, b in shapes)
    elif m.linear == "cola":
        per_layer = sum(r * (a + b) for a, b in shapes)
    else:
        raise ValueError(f"{m.linear}: BOOST's table prices dense and cola models")
    return m.n_layers * per_layer + d * m.vocab_size


def path_of(config: str, strategy: str, remat: str = "none", target: str = TARGET) -> Path:
    folder = "tp7b" if "_7b" in config else "boost_table"
    tail = "" if remat == "none" else f"_remat_{remat}"
    return ROOT / "benchmarks" / folder / f"{config}_{strategy}{tail}_{target}.json"


def command(config: str, strategy: str, tensor: int, pipeline: int, remat: str = "none", target: str = TARGET) -> str:
    """The tools.aot command that records a row's table (into path_of)."""
    devices = tensor * pipeline
    mesh = f"1,1,{tensor}" if pipeline == 1 else f"{pipeline},1,1,{tensor}"
    batches = (
        f"--config.train.grad_accum={MICRO}"
        if pipeline == 1
        else f"--config.train.grad_accum=1 --config.parallel.microbatches={MICRO}"
    )
    return (
        f"python -m boost_jax.tools.aot --target {target} --devices {devices} --config configs/{config}.py "
        f"--mesh {mesh} --train-only --profile --config.parallel.strategy={strategy} "
        f"--config.train.seq_len={SEQ} --config.train.global_batch={MICRO} {batches} "
        f"--config.remat.policy={remat} --config.model.max_seq_len={SEQ} "
        f"--json {path_of(config, strategy, remat, target).relative_to(ROOT)}"
    )


def check(
    rec: dict,
    cfg,
    config: str,
    strategy: str,
    tensor: int,
    pipeline: int,
    where: str,
    remat: str = "none",
    target: str = TARGET,
) -> None:
    """ValueError unless `rec` is the program the row names: target, config, mesh, remat policy, a profile, the
    step's tokens (its GEMM FLOPs per device from 0.9 x to 1.1 x 6 x GEMM parameters x tokens / devices, 8 x
    under remat full, x (M + S - 1) / M pipelined, plus unfused attention's up to 1.1 x) and its strategy (the
    all-reduce volume per token per layer within BOUNDS of the strategy's, x 1.5 under remat full, x the ticks)."""
    mesh = {"pipeline": pipeline, "data": 1, "fsdp": 1, "context": 1, "tensor": tensor}
    got = (rec.get("target"), rec.get("config"), rec.get("mesh"), rec.get("resolved", {}).get("remat.policy"))
    redo = f"rerun `{command(config, strategy, tensor, pipeline, remat, target)}`"
    if got != (target, f"configs/{config}.py", mesh, remat) or "profile" not in rec:
        raise ValueError(
            f"{where}: not the {config} {target} TP {tensor} x PP {pipeline} remat-{remat} step with --profile; {redo}"
        )
    m = cfg.model
    # a pipelined step runs M + S - 1 ticks of every stage for M micro-batches (gpipe: the bubble's ticks compute too)
    ticks = (MICRO + pipeline - 1) / MICRO
    base = (8 if remat == "full" else 6) * gemm_params(cfg) * MICRO * SEQ * ticks / (tensor * pipeline)
    # unfused attention's q·kᵀ and p·v (forward and backward, every head on every rank under vanilla) are GEMMs too
    attn = 12 * SEQ * SEQ * m.d_model * m.n_layers * MICRO / (pipeline * (1 if strategy == "vanilla" else tensor))
    by = rec["profile"]["flops_by_category"]
    attn = 0.0 if by.get("attention") else attn
    flops = by["gemm"]
    if not 0.9 * base <= flops <= 1.1 * (base + attn):
        raise ValueError(f"{where}: {flops:.3e} GEMM FLOPs per device, not {MICRO} x {SEQ} tokens' {base:.3e}; {redo}")
    elements = rec["train"]["collectives"].get("all-reduce", {}).get("elements", 0)
    redone = 1.5 if remat == "full" else 1.0  # remat full re-runs the forward's all-reduces (half the volume)
    expect = volume(strategy, m.d_model, m.d_ff, m.rank) * redone * ticks
    share = elements / (MICRO * SEQ * m.n_layers / pipeline) / expect
    if not BOUNDS[0] <= share <= BOUNDS[1]:
        raise ValueError(f"{where}: all-reduce volume {share:.2f}x what {strategy} sends, not its program; {redo}")


def record(config: str, strategy: str, tensor: int, pipeline: int, remat: str = "none", target: str = TARGET) -> dict:
    """The recorded table of one row, checked to be the program the row names (ValueError otherwise)."""
    path = path_of(config, strategy, remat, target)
    redo = command(config, strategy, tensor, pipeline, remat, target)
    if not path.exists():
        raise ValueError(f"{path}: missing; record it with `{redo}`")
    rec = json.loads(path.read_text())
    check(rec, model_config(config), config, strategy, tensor, pipeline, str(path.relative_to(ROOT)), remat, target)
    return rec


def model_config(config: str):
    cfg = load_config(str(ROOT / "configs" / f"{config}.py"))
    cfg.model.max_seq_len = SEQ
    return cfg


def planner_ms(config: str, strategy: str, tensor: int, pipeline: int, remat: str, unrolled: bool, cluster) -> float:
    """The planner's step (ms) of the row's plan: the strategy's uniform layer, the remat policy, the stack the
    program ran (`unrolled`); pipelined: MICRO micro-batches per pass, gpipe, no accumulation."""
    plan = plan_for(
        model_config(config),
        cluster,
        Mesh(1, 1, tensor, pipeline),
        MICRO if pipeline == 1 else 1,
        remat,
        Layer(*uniform_plan(strategy)),
        Options(batch=MICRO, seq=SEQ, check_memory=False),
        microbatches=MICRO if pipeline > 1 else 0,
        unrolled=unrolled,
    )
    return plan.step_s * 1e3


def rows(target: str = TARGET, cluster=None) -> list[dict]:
    """One dict per row: size, tensor, pipeline, config, strategy, name, table_ms, planner_ms, paper_ms (None
    where BOOST measured none: every row but its GPU's 7B), peak_gb and fits (the compiled step's memory on the
    GPU). `cluster`: a cluster file or a loaded Cluster (None: the target's, CLUSTERS)."""
    cluster = CLUSTER_DIR / f"{CLUSTERS[target]}.py" if cluster is None else cluster
    if isinstance(cluster, (str, Path)):
        cluster = load_cluster(Path(cluster))
    out = []
    for size, tensor, pipeline, remat in SHAPES:
        for family, strategy, name in STRATEGIES:
            config = f"{family}_{size}"
            rec = record(config, strategy, tensor, pipeline, remat, target)
            out.append(
                dict(
                    size=size,
                    tensor=tensor,
                    pipeline=pipeline,
                    remat=remat,
                    config=config,
                    strategy=strategy,
                    name=name,
                    table_ms=rec["profile"]["predicted_step_s"] * 1e3,
                    planner_ms=planner_ms(
                        config, strategy, tensor, pipeline, remat, bool(rec["resolved"]["model.scan_unroll"]), cluster
                    ),
                    paper_ms=PAPER_MS.get((size, strategy)) if (remat, target) == ("none", TARGET) else None,
                    peak_gb=int(rec["train"]["peak_bytes"]) / 1e9,
                    fits=bool(rec["train"]["fits"]),
                )
            )
    return out


def speedups(rs: list[dict]) -> list[dict]:
    """Per model: BTP's speedup over full-rank and over vanilla, by the table, the planner and the paper (None
    where the paper measured none)."""
    out = []
    for size, tensor, pipeline, remat in SHAPES:
        by = {r["strategy"]: r for r in rs if (r["size"], r["remat"]) == (size, remat)}
        entry = dict(size=size, tensor=tensor, pipeline=pipeline, remat=remat)
        for source in ("table", "planner", "paper"):
            btp = by["btp"][f"{source}_ms"]
            for base in ("megatron", "vanilla"):
                ms = by[base][f"{source}_ms"]
                entry[f"{source}_vs_{base}"] = ms / btp if ms and btp else None
        out.append(entry)
    return out


def _ms(v) -> str:
    return "n/a" if v is None else f"{v:.1f}"


def _x(v) -> str:
    return "n/a" if v is None else f"{v:.2f}x"


def markdown(rs: list[dict], ups: list[dict], target: str = TARGET) -> str:
    lines = [
        f"| model | TP x PP | remat | strategy | table ms | planner ms | planner / table | paper ms "
        f"| compiled peak GB (fits {target}) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        lines.append(
            f"| {r['size'].upper()} ({r['config']}) | {r['tensor']} x {r['pipeline']} | {r['remat']} "
            f"| {r['name']} ({r['strategy']}) | {_ms(r['table_ms'])} | {_ms(r['planner_ms'])} "
            f"| {r['planner_ms'] / r['table_ms']:.3f} | {_ms(r['paper_ms'])} "
            f"| {r['peak_gb']:.1f} ({'yes' if r['fits'] else 'no'}) |"
        )
    lines += [
        "",
        "| model | TP x PP | remat | BTP vs full-rank: table / planner / paper "
        "| BTP vs vanilla: table / planner / paper |",
        "|---|---|---|---|---|",
    ]
    for u in ups:
        cells = [
            " / ".join(_x(u[f"{s}_vs_{b}"]) for s in ("table", "planner", "paper")) for b in ("megatron", "vanilla")
        ]
        lines.append(
            f"| {u['size'].upper()} | {u['tensor']} x {u['pipeline']} | {u['remat']} | {cells[0]} | {cells[1]} |"
        )
    lines += ["", f"Paper headline (BOOST): {PAPER_HEADLINE}."]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", choices=sorted(CLUSTERS), default=TARGET, help="the GPU the rows are compiled for")
    ap.add_argument("--out", default=str(ROOT / "benchmarks"), help="folder for boost_table[_TARGET].md and .json")
    ap.add_argument("--cluster", help="the cluster file the planner prices (default: the target's, CLUSTERS)")
    args = ap.parse_args(argv)
    try:
        rs = rows(args.target, args.cluster)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ups = speedups(rs)
    text = markdown(rs, ups, args.target)
    print(text)
    name = "boost_table" if args.target == TARGET else f"boost_table_{args.target}"
    out = Path(args.out)
    (out / f"{name}.md").write_text(text + "\n")
    saved = {"target": args.target, "rows": rs, "speedups": ups}
    (out / f"{name}.json").write_text(json.dumps(saved, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
