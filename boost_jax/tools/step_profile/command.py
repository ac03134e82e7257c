"""The step-time table's command and text: `to_text` (a profile's table), `side_by_side` (predicted
beside measured), `main` (`python -m boost_jax.tools.step_profile --hlo --events`). The rules are in
this package's docstring. Nothing here imports jax at module level."""

from __future__ import annotations

import json
from dataclasses import asdict

from boost_jax.tools.step_profile.categories import CATEGORIES
from boost_jax.tools.step_profile.pricing import TARGETS, Costs, profile
from boost_jax.tools.step_profile.traces import measured


def to_text(p: dict, title: str = "") -> str:
    """The table of one profile: per category, time, share, kernels per step, TFLOP, GB moved and the
    roofline (each kernel at the GPU's peak FLOP/s or HBM bandwidth); the collectives priced and exposed."""
    step = p["predicted_step_s"]
    roof = p.get("roofline_by_category", {})
    lines = [
        f"{title}predicted step {step * 1e3:.1f} ms on {p['target']} ({p['launches']} kernel launches)",
        f"  {'category':<14} {'ms':>8} {'share':>6} {'kernels':>8} {'TFLOP':>8} {'GB':>8} {'roofline':>9}",
    ]
    for cat in CATEGORIES:
        t = p["time_by_category"][cat]
        lines.append(
            f"  {cat:<14} {t * 1e3:8.2f} {t / step if step else 0:6.1%} {p['kernels_per_step'][cat]:8d} "
            f"{p['flops_by_category'][cat] / 1e12:8.2f} {p['bytes_by_category'][cat] / 1e9:8.2f} "
            f"{roof.get(cat, 0.0) * 1e3:9.2f}"
        )
    if "roofline_step_s" in p:
        r = p["roofline_step_s"]
        lines.append(
            f"  {'step':<14} {step * 1e3:8.2f} {'':>6} {'':>8} {'':>8} {'':>8} {r * 1e3:9.2f}"
            f"  (predicted / roofline {step / r if r else 0:.2f})"
        )
    coll = p.get("collectives", {})
    if coll.get("priced_s"):
        lines.append(
            f"  collectives priced {coll['priced_s'] * 1e3:.2f} ms, overlapped with compute "
            f"{coll['overlapped_s'] * 1e3:.2f}, exposed {coll['exposed_s'] * 1e3:.2f}; the step without "
            f"overlap {p['no_overlap_step_s'] * 1e3:.1f} ms"
        )
        for row in coll["by_kernel"][:5]:
            lines.append(
                f"    {row['exposed_s'] * 1e3:7.2f} of {row['priced_s'] * 1e3:7.2f} ms exposed  {row['kind']} "
                f"{row['name']} x{row['count']} {'async' if row['async'] else 'sync'}"
                + (f"  [{row['source']}]" if row["source"] else "")
            )
    clones = p.get("remat_clones", {})
    if clones.get("kernels"):
        lines.append(
            f"  XLA's rematerialized clones: {clones['kernels']} kernels, {clones['launches']} launches, "
            f"{clones['time_s'] * 1e3:.1f} ms if run; priced at {p.get('remat_clone_share', 0):.0%} "
            "(step_profile.remat_clone)"
        )
    lines.append("  top kernels:")
    for k in p["top_kernels"][:10]:
        shape = "x".join(str(d) for d in k["gemm"][:4]) if k["gemm"] else ""
        lines.append(
            f"    {k['time_s'] * 1e3:7.2f} ms  {k['category']:<13} {k['name']} x{k['count']}"
            + (f" (gemm b,m,n,k {shape})" if shape else "")
            + (f"  [{k['source']}]" if k["source"] else "")
        )
    return "\n".join(lines)


def side_by_side(predicted: dict, measured_: dict) -> str:
    """Predicted and measured seconds per category, one row each."""
    lines = [f"  {'category':<14} {'predicted ms':>13} {'measured ms':>12}"]
    for cat in CATEGORIES:
        lines.append(
            f"  {cat:<14} {predicted['time_by_category'][cat] * 1e3:13.2f} "
            f"{measured_['time_by_category'][cat] * 1e3:12.2f}"
        )
    lines.append(f"  {'step':<14} {predicted['predicted_step_s'] * 1e3:13.2f} {measured_['step_s'] * 1e3:12.2f}")
    return "\n".join(lines)


def costs_dict(c: Costs) -> dict:
    return asdict(c)


def _read(path: str) -> str:
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return f.read()


def main(argv=None) -> dict:
    """`python -m boost_jax.tools.step_profile --hlo PROGRAM.hlo[.gz] [--events EVENTS.json] [--target h100]`:
    the predicted table of a compiled program's text; with a trace's events of the same program
    (benchmarks/step_profile_trace.py writes both), the measured table beside it."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m boost_jax.tools.step_profile", description=main.__doc__.split("\n")[0])
    ap.add_argument("--hlo", required=True, help="the optimized HLO text of the program (.gz allowed)")
    ap.add_argument("--events", help="a trace's kernels (JSON: steps, step_s, events) of the same program")
    ap.add_argument("--target", default="h100", help=f"one of {', '.join(TARGETS)}")
    ap.add_argument("--accumulation", type=int, default=1, help="trip count of a loop whose count XLA hides")
    args = ap.parse_args(argv)
    try:
        if args.target not in TARGETS:
            raise ValueError(f"--target: unknown GPU {args.target!r}; one of {', '.join(TARGETS)}")
        text = _read(args.hlo)
        pred = profile(text, args.target, args.accumulation)
        out = {"predicted": pred}
        print(to_text(pred))
        if args.events:
            got = measured(json.loads(_read(args.events)), text, args.accumulation)
            out["measured"] = got
            print(side_by_side(pred, got))
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return out


if __name__ == "__main__":
    main()
