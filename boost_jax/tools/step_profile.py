"""Where a GPU step's time goes, read from its compiled program: every kernel of the optimized HLO,
priced on a target GPU's numbers and grouped into categories.

    python -m boost_jax.tools.aot --target h100 --devices 1 --config cola_1b --profile \\
        --config.train.seq_len=256 --config.train.global_batch=32 --config.remat.policy=lowrank

A kernel is what the GPU launches: a fusion, a GEMM (a Triton GEMM fusion, a cuBLAS or cuDNN call),
cuDNN attention, a Pallas/Triton kernel, a copy, a collective. Each instruction of a computation the
GPU executes (the entry, while bodies and conditions, conditional branches, async computations) is
one kernel, run as many times per step as its loops' trip counts say (tools/hlo_comm.py reads them;
a loop whose count the program hides, the accumulation loop, runs `accumulation` times; each branch
of a conditional counts as if it ran, and each loop iteration reads its predicate back as one more
launch). Bitcasts,
tuples, parameters, constants and the `-done` halves of async pairs launch nothing. Each kernel
carries:

* FLOPs: a dot's 2 x output x contraction (GEMM), cuDNN attention's two (forward) or five (backward)
  batched GEMMs, halved under a causal mask;
* bytes: what it reads and writes in HBM: each operand once and each output, except that a
  dynamic-update-slice writes its update slice in place (its buffer is neither read nor rewritten)
  and a dynamic-slice or slice of an operand reads the slice, not the operand;
* for a collective, the bytes it moves over the target's links (hlo_comm's payload rules).

`price` gives each kernel a time on a `Target` (HBM bandwidth, dense bf16 peak, NVLink and network
bandwidth and latency) under `Costs` fitted to measured steps (benchmarks/step_profile_fit.py): a
GEMM runs at max(FLOPs / (peak x efficiency of its shape class), bytes / bandwidth), attention at a
fixed efficiency, everything else at HBM bandwidth, a collective at its ring's bandwidth and latency,
and every kernel launch costs `launch_s` (the "launch" category). A deviceless compile has no GEMM
autotuner, so its GEMMs are Triton fusions with default tiles where the GPU would pick cuBLAS or
better tiles per shape: a GEMM is priced by its shape (`gemm_class`), never by the backend named.
A collective counts in the step at its exposed part: an asynchronous one (a start/done pair of the
scheduled program) overlaps the compute XLA scheduled between its start and its done, up to its own
time, each kernel's time handed to one collective only; the rest, and every synchronous collective,
is exposed (tools/step_overlap.py). `no_overlap_step_s` adds them in full, the bound without overlap.
The roofline beside each category and the step: each kernel at the GPU's dense bf16 peak or its
datasheet HBM bandwidth, whichever binds (`roofline_time`), the collectives at the link bandwidth
times their exposed share.

`categorize(kernel)` puts a kernel in one of CATEGORIES by what runs (GEMM, attention, collective,
copy) and, for the rest, by the project source line the kernel came from (the HLO's stack frames:
kernels/rmsnorm.py -> norm, model/loss.py -> loss, the train step's update in runtime/step.py or
optax -> optimizer); data movement alone (transposes, slices, updates in place, copies) is
copies/layout, any other fusion elementwise. `measured(events, hlo_text)` groups the kernels of a
jax.profiler trace of the same program (`trace_events`) by the same function, so a measured step and
its prediction sit side by side (`side_by_side`).

Nothing here imports jax at module level.
"""

from __future__ import annotations

import json
from dataclasses import asdict

from boost_jax.tools.hlo_shapes import shape_bytes, shape_dims  # noqa: F401 - re-exported
from boost_jax.tools.hlo_sources import Frame, stack_frames  # noqa: F401 - re-exported
from boost_jax.tools.step_categories import CATEGORIES, MOVES, categorize  # noqa: F401 - re-exported
from boost_jax.tools.step_kernels import (  # noqa: F401 - re-exported
    COLLECTIVE_OPS,
    FREE,
    Kernel,
    kernels,
    remat_clone,
)
from boost_jax.tools.step_pricing import (  # noqa: F401 - re-exported
    COPY_SHARE,
    COSTS_FILE,
    DEFAULT_COSTS,
    GEMM_CLASSES,
    LARGE_DIM,
    TARGETS,
    Costs,
    Target,
    costs,
    gemm_class,
    kernel_time,
    price,
    profile,
    summary,
)
from boost_jax.tools.step_traces import measured, module_name, trace_events  # noqa: F401 - re-exported


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
