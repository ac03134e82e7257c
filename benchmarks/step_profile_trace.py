"""On a GPU: the step-time table of a real train step, measured by jax.profiler, beside the table
boost_jax/tools/step_profile/ predicts from the same compiled program.

    python benchmarks/step_profile_trace.py --out DIR [--rows "cola_1b lowrank 256,llama_1b 256"]
        [--measured benchmarks/h100_measured.json] [--steps 3] [--warmup 2]

Each row of the measured-rows file (benchmarks/h100_measured.json; `--rows` picks some by name) is
built as benchmarks/step_profile_fit.py builds it (one device, random tokens, the row's seq, batch
and overrides) on the first local device, compiled once, run `--warmup` times, timed over `--steps`
steps, then traced over `--steps` steps. DIR gets per row: NAME.hlo.gz (the program as this GPU
compiled it, autotuned GEMMs and all), NAME.events.json (the trace's kernels, one row per kernel,
hlo_op and module: {"steps", "step_s", "events": [{"name", "hlo_op", "hlo_module", "duration_us",
"count"}]}, step_profile.trace_events), NAME.trace/ (the raw trace) and one summary.json: per row the
measured step, the predicted and the measured table by category (step_profile.measured), printed
side by side. On a CPU it runs too (the host's events), which is how tests/test_step_profile.py
checks it; its times then say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from step_profile_fit import MEASURED, row_config, slug  # noqa: E402


def trace_row(row: dict, out: Path, steps: int, warmup: int, size: dict | None = None) -> dict:
    """Compile, time and trace one row's step on the first local device; write its HLO, events and trace."""
    import jax
    from step_time import build, timed_steps

    from boost_jax.tools.step_profile import command as step_command
    from boost_jax.tools.step_profile import pricing as step_pricing
    from boost_jax.tools.step_profile import traces as step_traces

    size = dict(size or {})
    row = {**row, "seq": size.pop("seq", row["seq"]), "batch": size.pop("batch", row["batch"])}
    cfg = row_config(row)
    if size:  # smaller widths (a CPU check of this script)
        cfg.model.update(size)
    step, state, tokens = build(cfg, jax.devices()[:1])
    compiled = step.lower(state, tokens).compile()
    state, _, step_s = timed_steps(compiled, state, tokens, warmup, steps)
    found = trace_compiled(compiled, state, tokens, out, slug(row["name"]), steps, step_s)
    text = compiled.as_text()
    predicted = step_pricing.profile(text, "h100")
    got = step_traces.measured(found["events"], text)
    print(f"{row['name']}: measured step {step_s * 1e3:.1f} ms ({len(found['events']['events'])} kernels traced)")
    print(step_command.side_by_side(predicted, got))
    return {
        "name": row["name"],
        "step_s": step_s,
        "device_kind": jax.devices()[0].device_kind,
        "predicted": {k: predicted[k] for k in ("predicted_step_s", "time_by_category", "launches")},
        "measured": got,
    }


def trace_compiled(compiled, state, tokens, out: Path, name: str, steps: int, step_s: float) -> dict:
    """Trace `steps` steps of a compiled train step (already warm) with jax.profiler and write, under
    out: NAME.hlo.gz (the program as this device compiled it), NAME.events.json (its kernels,
    step_profile.trace_events) and NAME.trace/ (the raw trace). `step_s`: the untraced step time
    measured before. Returns {"state": the state after, "events": the events file's contents}; the
    one place the project traces a step (gpu_bench.py --profile calls it too)."""
    import jax

    from boost_jax.tools.step_profile import traces as step_traces

    out.mkdir(parents=True, exist_ok=True)
    text = compiled.as_text()
    with gzip.open(out / f"{name}.hlo.gz", "wt") as f:
        f.write(text)
    trace_dir = out / f"{name}.trace"
    jax.profiler.start_trace(str(trace_dir))
    for _ in range(steps):
        state, metrics = compiled(state, tokens)
    jax.block_until_ready(metrics)
    jax.profiler.stop_trace()
    xspace = sorted(glob.glob(str(trace_dir / "**" / "*.xplane.pb"), recursive=True))[-1]
    module = step_traces.module_name(text)
    events = {
        "steps": steps,
        "step_s": step_s,
        "hlo_module": module,
        "events": step_traces.trace_events(xspace, module),
    }
    (out / f"{name}.events.json").write_text(json.dumps(events, indent=1) + "\n")
    return {"state": state, "events": events}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for the HLO, events, traces and summary.json")
    ap.add_argument("--measured", default=str(MEASURED))
    ap.add_argument("--rows", help="comma-separated row names (default: every row)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--size", help=argparse.SUPPRESS)  # JSON of model widths (and seq, batch): a CPU check
    args = ap.parse_args(argv)
    rows = json.loads(Path(args.measured).read_text())["rows"]
    if args.rows:
        wanted = [r.strip() for r in args.rows.split(",")]
        unknown = sorted(set(wanted) - {r["name"] for r in rows})
        if unknown:
            ap.error(f"--rows: unknown {unknown}; the rows of {args.measured} are {[r['name'] for r in rows]}")
        rows = [r for r in rows if r["name"] in wanted]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"rows": []}
    for r in rows:
        summary["rows"].append(trace_row(r, out, args.steps, args.warmup, json.loads(args.size) if args.size else None))
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    main()
