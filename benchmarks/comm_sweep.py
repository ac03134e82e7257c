"""Tensor-parallel traffic of BTP, vanilla low-rank TP and Megatron across model and tensor sizes.

    python benchmarks/comm_sweep.py [--sizes 1b,7b,13b] [--tensor 2,4,8] [--batch 4] [--seq 4096]

Runs `boost_jax.tools.comm_report.report` (no memory analysis) for configs/cola_<size>.py on mesh
1,1,<tensor>; the megatron column is the full-rank llama_<size> twin. Writes comm.json, comm.md
and comm.png (needs matplotlib: `pip install -e .[bench]`) next to this file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from boost_jax.tools.devices import emulate_cpu_devices  # imports no jax: XLA_FLAGS can still be set

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30


def sweep(sizes, tensors, strategies, batch, seq) -> list[dict]:
    from boost_jax.tools.comm_report.command import report

    rows = []
    for size in sizes:
        for tp in tensors:
            start = time.perf_counter()
            rep = report(ROOT / "configs" / f"cola_{size}.py", (1, 1, tp), strategies, batch, seq, memory=False)
            print(f"{size} tensor={tp}: {time.perf_counter() - start:.0f} s", flush=True)
            for name, c in rep["strategies"].items():
                fwd, bwd = c["per_layer_forward"].get("tensor", {}), c["per_layer_backward"].get("tensor", {})
                rows.append(
                    {
                        "size": size,
                        "tensor": tp,
                        "strategy": name,
                        "config": c["config"],
                        "linear": c["linear"],
                        "d_model": rep["d_model"],
                        "rank": rep["rank"],
                        "n_layers": rep["n_layers"],
                        "fwd_elements_per_token": fwd.get("elements_per_token", 0.0),
                        "fwd_collectives": fwd.get("count", 0),
                        "fwd_r": c["per_layer_forward_units"]["r"],
                        "fwd_d": c["per_layer_forward_units"]["d"],
                        "fwd_gib": fwd.get("bytes", 0) / GIB,
                        "fwd_bwd_gib": (fwd.get("bytes", 0) + bwd.get("bytes", 0)) / GIB,
                        "step_tensor_gib": c["step_by_axis"].get("tensor", {}).get("bytes", 0) / GIB,
                        "compile_s": sum(c["compile_s"].values()),
                    }
                )
    return rows


def markdown(rows, args, seconds: float) -> str:
    lines = [
        "# Tensor-parallel communication per layer: BTP vs vanilla low-rank TP vs Megatron",
        "",
        (
            f"Measured with `boost_jax.tools.comm_report` (`benchmarks/comm_sweep.py`, {seconds / 60:.0f} min on a "
            f"2-core CPU): each model is lowered and compiled for {args.tensor_list} emulated CPU devices (mesh "
            f"data=1, fsdp=1, tensor=p) from abstract shapes, batch {args.batch} x seq {args.seq}, bfloat16; the "
            "collectives are read from the optimized HLO of the forward loss, forward+backward and train step, "
            "each lowered at 1 and 2 layers with the layer scan unrolled (per layer = difference), scaled to L. "
            "Numbers are tensor-axis payloads per device: elements x 2 bytes (bf16; XLA:CPU carries bf16 "
            "all-reduces as f32, so the HLO's bytes are not used). An all-reduce's payload does not depend on p; "
            "a ring all-reduce puts 2(p-1)/p times it on each device's links. The megatron rows are the full-rank "
            "(llama_*) twins; BTP and vanilla run the CoLA (r = d/4) models."
        ),
        "",
        (
            "| model | p | strategy | fwd elements/token/layer | in r / in d | fwd collectives/layer "
            "| fwd GiB/layer | fwd+bwd GiB/layer | train step GiB (L layers) |"
        ),
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['tensor']} | {r['strategy']} | {r['fwd_elements_per_token']:.0f} "
            f"| {r['fwd_r']:.2f} r / {r['fwd_d']:.2f} d | {r['fwd_collectives']} | {r['fwd_gib']:.3f} "
            f"| {r['fwd_bwd_gib']:.3f} | {r['step_tensor_gib']:.2f} |"
        )
    lines += ["", "![per-layer forward GiB vs tensor size](comm.png)", ""]
    return "\n".join(lines)


def plot(rows, path: Path, batch: int, seq: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"btp": "tab:green", "vanilla": "tab:red", "megatron": "tab:blue"}
    markers = ["o", "s", "^", "D", "v"]
    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for size, strategy in dict.fromkeys((r["size"], r["strategy"]) for r in rows):
        pts = [r for r in rows if r["size"] == size and r["strategy"] == strategy]
        ax.plot(
            [r["tensor"] for r in pts],
            [r["fwd_gib"] for r in pts],
            color=colors.get(strategy.split(":")[0]),
            marker=markers[sizes.index(size) % len(markers)],
            linestyle="-" if strategy.startswith("btp") else "--",
            label=f"{strategy} ({pts[0]['config']})",
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["tensor"] for r in rows}), [str(t) for t in sorted({r["tensor"] for r in rows})])
    ax.set_xlabel("tensor-parallel size p")
    ax.set_ylabel("forward payload per layer per device (GiB)")
    ax.set_title(f"TP traffic per layer, forward, batch {batch} x seq {seq}, bf16")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.15))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1b,7b,13b", help="comma list of zoo sizes (configs/cola_<size>.py)")
    ap.add_argument("--tensor", default="2,4,8", help="comma list of tensor-parallel sizes")
    ap.add_argument("--strategy", default="btp,vanilla,megatron", help="as comm_report's --strategy")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent), help="folder for comm.{json,md,png}")
    ap.add_argument("--from-json", help="re-render comm.md and comm.png from a saved comm.json")
    args = ap.parse_args(argv)
    sizes = args.sizes.split(",")
    tensors = [int(t) for t in args.tensor.split(",")]
    args.tensor_list = "/".join(map(str, tensors))
    emulate_cpu_devices(max(tensors))
    out = Path(args.out)
    if args.from_json:  # redraw the table and plot without compiling again
        saved = json.loads(Path(args.from_json).read_text())
        rows, seconds, args.batch, args.seq = saved["rows"], saved["seconds"], saved["batch"], saved["seq"]
        args.tensor_list = "/".join(map(str, sorted({r["tensor"] for r in rows})))
    else:
        start = time.perf_counter()
        rows = sweep(sizes, tensors, args.strategy, args.batch, args.seq)
        seconds = time.perf_counter() - start
        (out / "comm.json").write_text(
            json.dumps(
                {"batch": args.batch, "seq": args.seq, "dtype": "bfloat16", "seconds": seconds, "rows": rows}, indent=1
            )
        )
    text = markdown(rows, args, seconds)
    (out / "comm.md").write_text(text)
    print(text)
    try:
        plot(rows, out / "comm.png", args.batch, args.seq)
    except ImportError:
        print("matplotlib missing (pip install -e .[bench]): comm.png not written", file=sys.stderr)


if __name__ == "__main__":
    main()
