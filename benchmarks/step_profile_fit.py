"""Fit the step-time table's constants (boost_jax/tools/step_profile/) to measured GPU steps, and
show every measured row beside its prediction, fitted rows and held-out rows apart.

    python benchmarks/step_profile_fit.py [--measured benchmarks/h100_measured.json] [--target h100]
        [--recompile] [--check] [--json benchmarks/step_profile_fit.json] [--md benchmarks/step_profile_fit.md]

Each measured row (config, seq, batch, overrides, step_ms, fit: true|false) names a train step on one
GPU; its program is the one the GPU compiles (`runtime.build.build` on a deviceless `--target` GPU,
random tokens: data.batching=stream, no accumulation), read from benchmarks/hlo/NAME.hlo.gz, or
compiled and cached there when missing or with --recompile (needs the aot extra, 20-60 s each on
two cores). The constants (GEMM efficiency per shape class, cuDNN attention efficiency, the cost of
a kernel launch) are fitted on the rows marked `fit` (least squares of log(predicted / measured))
and written to boost_jax/tools/targets/step_costs.json (unless --check, which only prices with the
constants there); every row is then priced, its ratio printed with F (fitted) or H (held out), and
the orders the measured file lists (a variant slower than another) checked.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from boost_jax.tools.step_profile import categories as step_categories  # noqa: E402
from boost_jax.tools.step_profile import command as step_command  # noqa: E402
from boost_jax.tools.step_profile import kernels as step_kernels  # noqa: E402
from boost_jax.tools.step_profile import pricing as step_pricing  # noqa: E402

HLO_DIR = HERE / "hlo"
MEASURED = HERE / "h100_measured.json"
TOLERANCE = 0.15
# Two measured steps closer than this are a tie for the orders' check (one measurement each).
TIE = 0.02
# Fitted constants: the GEMM classes' efficiencies, then the launch cost in microseconds. Not
# fitted: cuDNN attention's efficiency curve, efficiency x keys / (keys + half_keys)
# (tools/step_profile/pricing.py attention_time), through two measured kernels on one H100: 0.407 of peak at
# 4096 keys (benchmarks/gpu_bench.json attention part: fwd+bwd at [1, 4096, 32, 128], 402 TFLOP/s) and
# 0.131 at 256 keys (the cuDNN kernels of cola_1b auto's trace at 256 x 32,
# benchmarks/gpu_profile/cola_1b_auto.*: 5.56 ms per step for its 0.722 TFLOP, 48 calls at
# [32, 32, 256, 256] x 64); and the share of XLA's rematerialized clones priced, 0
# (tools/step_profile/kernels.py remat_clone; the table shows each row's ratio with them priced in full too).
ATTENTION_MEASURED = ((4096, 402.3e12 / 989e12), (256, 0.7216e12 / 5.564e-3 / 989e12))


def attention_curve(measured=ATTENTION_MEASURED) -> tuple[float, float]:
    """(efficiency, half_keys) through two (keys, measured fraction of peak) points."""
    (k1, e1), (k2, e2) = measured
    half = (e2 - e1) / (e1 / k1 - e2 / k2)
    return e1 * (k1 + half) / k1, half


ATTENTION_EFFICIENCY, ATTENTION_HALF_KEYS = attention_curve()
REMAT_CLONE_SHARE = 0.0
BOUNDS = {"large": (0.2, 1.0), "medium": (0.1, 1.0), "batched": (0.1, 1.0)}
LAUNCH_US = (0.0, 30.0)


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def row_config(row: dict):
    """The config of a measured row: one device, random tokens, the row's seq, batch and overrides."""
    from boost_jax.config import load_config_file
    from boost_jax.validate import validate

    cfg = load_config_file(str(ROOT / "configs" / f"{row['config']}.py"))
    cfg.model.max_seq_len = max(cfg.model.max_seq_len, row["seq"])
    cfg.train.update(seq_len=row["seq"], global_batch=row["batch"], grad_accum=1)
    cfg.parallel.update(data=1, fsdp=1, tensor=1, num_devices=1)
    cfg.data.source = "embedded"
    cfg.data.batching = "stream"
    for key, value in row.get("overrides", {}).items():
        section, name = key.split(".")
        cfg[section][name] = value
    validate(cfg)
    return cfg


def compile_row(row: dict, target: str) -> str:
    """The row's train step compiled for one deviceless `target` GPU under the GPU's memory budget
    (tools/aot.py budget_config: the program the GPU runs): its optimized HLO text."""
    from boost_jax.runtime.build import build
    from boost_jax.tools import aot

    built = build(row_config(row), aot.devices(target, 1, gpu_budget=True))
    return built.lower_train().compile().as_text()


def hlo_text(row: dict, target: str, recompile: bool = False) -> str:
    path = HLO_DIR / f"{slug(row['name'])}.hlo.gz"
    if recompile or not path.is_file():
        t0 = time.perf_counter()
        text = compile_row(row, target)
        HLO_DIR.mkdir(exist_ok=True)
        with gzip.open(path, "wt") as f:
            f.write(_portable(text))
        print(f"  compiled {row['name']} in {time.perf_counter() - t0:.0f} s -> {path.relative_to(ROOT)}", flush=True)
    with gzip.open(path, "rt") as f:
        return f.read()


def _portable(text: str) -> str:
    """Source paths from the package down (the checkout's location is not part of the program)."""
    return re.sub(r'"[^"\n]*?/(boost_jax/[^"\n]*)"', r'"\1"', text)


def costs_of(x, fitted_on=(), share: float = REMAT_CLONE_SHARE) -> step_pricing.Costs:
    n = len(step_pricing.GEMM_CLASSES)
    eff = dict(zip(step_pricing.GEMM_CLASSES, (float(v) for v in x[:n])))
    return step_pricing.Costs(
        eff,
        ATTENTION_EFFICIENCY,
        float(x[n]) * 1e-6,
        share,
        attention_half_keys=ATTENTION_HALF_KEYS,
        fitted_on=tuple(fitted_on),
        note="fitted by benchmarks/step_profile_fit.py",
    )


def predict(programs: dict, target: str, c: step_pricing.Costs) -> dict:
    return {name: step_pricing.price(ks, target, c) for name, ks in programs.items()}


def fit(programs: dict, rows: list[dict], target: str) -> step_pricing.Costs:
    """Least squares of log(predicted / measured) over the fitted rows."""
    import numpy as np
    from scipy.optimize import minimize

    fitted = [r for r in rows if r.get("fit")]
    lo = [BOUNDS[c][0] for c in step_pricing.GEMM_CLASSES] + [LAUNCH_US[0]]
    hi = [BOUNDS[c][1] for c in step_pricing.GEMM_CLASSES] + [LAUNCH_US[1]]

    def loss(x):
        c = costs_of(np.clip(x, lo, hi))
        return sum(
            math.log(step_pricing.price(programs[r["name"]], target, c)["predicted_step_s"] * 1e3 / r["step_ms"]) ** 2
            for r in fitted
        )

    best = None
    for start in ([0.7, 0.5, 0.5, 5.0], [0.9, 0.7, 0.7, 2.0], [0.5, 0.4, 0.3, 8.0]):
        res = minimize(
            loss,
            np.array(start),
            method="Nelder-Mead",
            options={"xatol": 1e-4, "fatol": 1e-8, "maxiter": 4000, "maxfev": 4000},
        )
        if best is None or res.fun < best.fun:
            best = res
    return costs_of(np.clip(best.x, lo, hi), [r["name"] for r in fitted])


def table(rows: list[dict], predicted: dict) -> list[dict]:
    out = []
    for r in rows:
        p = predicted[r["name"]]
        ms = p["predicted_step_s"] * 1e3
        clones = p["remat_clones"]
        with_clones = ms + (1 - p["remat_clone_share"]) * clones["time_s"] * 1e3
        out.append(
            {
                "name": r["name"],
                "set": "fitted" if r.get("fit") else "held out",
                "measured_ms": r["step_ms"],
                "predicted_ms": ms,
                "ratio": ms / r["step_ms"],
                "launches": p["launches"],
                "time_by_category_ms": {k: v * 1e3 for k, v in p["time_by_category"].items()},
                "remat_clones": clones["kernels"],
                "ratio_with_clones": with_clones / r["step_ms"],
                "source": r.get("source", ""),
            }
        )
    return out


def orders(spec: list, predicted: dict, measured: dict) -> list[dict]:
    """Each listed order, kept when the prediction orders the two rows as measured; where the measured
    steps differ by less than TIE (one run each: within a GPU's run-to-run noise), the order is a tie,
    kept when the prediction also puts them within TIE of each other."""
    out = []
    for a, op, b, what in spec:
        pa, pb = predicted[a]["predicted_step_s"], predicted[b]["predicted_step_s"]
        tie = abs(measured[a] / measured[b] - 1) < TIE
        out.append(
            {
                "slower": a,
                "faster": b,
                "what": what,
                "measured_ms": [measured[a], measured[b]],
                "predicted_ms": [pa * 1e3, pb * 1e3],
                "tie": tie,
                "kept": abs(pa / pb - 1) < TIE if tie else (pa > pb if op == ">" else pa < pb),
            }
        )
    return out


def markdown(result: dict) -> str:
    c = result["costs"]
    cats = [k for k in step_categories.CATEGORIES]
    lines = [
        f"# Step-time table vs measured {result['device']} steps",
        "",
        f"`{result['command']}`",
        "",
        "Fitted constants: GEMM efficiency "
        + ", ".join(f"{k} {v:.3f}" for k, v in c["gemm_efficiency"].items())
        + f", launch {c['launch_s'] * 1e6:.2f} µs; not fitted: attention {c['attention_efficiency']:.3f} x keys / "
        f"(keys + {c.get('attention_half_keys', 0.0):.0f}) (two measured cuDNN kernels) plus its backward's side "
        f"passes, XLA's rematerialized clones priced at {c['remat_clone_share']:.0%}.",
        "",
        "Milliseconds per step; the categories are the predicted table; `clones`: XLA's rematerialized "
        "clones in the deviceless program, and the ratio were they priced in full.",
        "",
        "| row | set | measured ms | predicted ms | ratio | " + " | ".join(cats) + " | clones | ratio with clones |",
        "|---|---|---|---|---|" + "---|" * len(cats) + "---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['name']} | {r['set']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | "
            f"{r['ratio']:.3f} | "
            + " | ".join(f"{r['time_by_category_ms'][k]:.1f}" for k in cats)
            + f" | {r['remat_clones']} | {r['ratio_with_clones']:.3f} |"
        )
    lines += ["", "| order | measured ms | predicted ms | kept |", "|---|---|---|---|"]
    for o in result["orders"]:
        lines.append(
            f"| {o['what']}: {o['slower']} > {o['faster']} | {o['measured_ms'][0]:.1f} > "
            f"{o['measured_ms'][1]:.1f} | {o['predicted_ms'][0]:.1f} > {o['predicted_ms'][1]:.1f} | "
            f"{('tie within ' + format(TIE, '.0%') + ': ') if o['tie'] else ''}{'yes' if o['kept'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", default=str(MEASURED), help="JSON of measured rows (default %(default)s)")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--recompile", action="store_true", help="compile every row again (else benchmarks/hlo/)")
    ap.add_argument("--check", action="store_true", help="price with the constants in step_costs.json, fit nothing")
    ap.add_argument("--json", help="write the table here")
    ap.add_argument("--md", help="write the table as markdown here")
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.measured).read_text())
    rows = spec["rows"]
    programs = {}
    for r in rows:
        programs[r["name"]] = step_kernels.kernels(hlo_text(r, args.target, args.recompile))
    if args.check:
        c = step_pricing.costs(args.target)
    else:
        c = fit(programs, rows, args.target)
        table_ = json.loads(step_pricing.COSTS_FILE.read_text()) if step_pricing.COSTS_FILE.is_file() else {}
        table_[args.target] = {
            **step_command.costs_dict(c),
            "fitted_on": list(c.fitted_on),
            "measured": str(Path(args.measured).resolve().relative_to(ROOT))
            if Path(args.measured).resolve().is_relative_to(ROOT)
            else args.measured,
        }
        step_pricing.COSTS_FILE.write_text(json.dumps(table_, indent=1) + "\n")
    predicted = predict(programs, args.target, c)
    measured = {r["name"]: r["step_ms"] for r in rows}
    result = {
        "device": spec.get("device", args.target),
        "target": args.target,
        "command": "python benchmarks/step_profile_fit.py" + (" --check" if args.check else ""),
        "costs": step_command.costs_dict(c),
        "rows": table(rows, predicted),
        "orders": orders(spec.get("orders", []), predicted, measured),
        "tolerance": TOLERANCE,
    }
    result["within_tolerance"] = all(abs(r["ratio"] - 1) <= TOLERANCE for r in result["rows"])
    result["orders_kept"] = all(o["kept"] for o in result["orders"])
    text = markdown(result)
    print(text)
    print(f"every row within {TOLERANCE:.0%}: {result['within_tolerance']}; orders kept: {result['orders_kept']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text(text)
    return result


if __name__ == "__main__":
    main()
