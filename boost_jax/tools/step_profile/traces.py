"""A measured step beside its prediction: the kernels of a jax.profiler trace, grouped into the
categories tools/step_profile/ prices (`measured`). Nothing here imports jax at module level."""

from __future__ import annotations

import re

from boost_jax.tools.step_profile.categories import CATEGORIES
from boost_jax.tools.step_profile.kernels import Kernel, kernels


def trace_events(xspace_path: str, module: str | None = None) -> list[dict]:
    """The GPU kernels of a jax.profiler trace (`*.xplane.pb`), one row per (kernel, hlo_op, hlo_module):
    {"name", "hlo_op", "hlo_module", "duration_us" (summed), "count"}. Kernels come from the device
    planes (`/device:GPU:N`); a trace with none (a CPU run) gives the host's events that name an
    hlo_op. `module`: keep only this hlo_module (and events that name none)."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(str(xspace_path))
    planes = [p for p in data.planes if p.name.startswith("/device:")]
    derived = {
        "XLA Modules",
        "XLA Ops",
        "Steps",
        "Framework Name Scope",
        "Framework Ops",
        "Source code",
        "XLA TraceMe",
        "Launch Stats",
        "TensorFlow Name Scope",
        "TensorFlow Ops",
    }
    rows: dict[tuple, dict] = {}

    def add(ev, stats):
        mod = str(stats.get("hlo_module", ""))
        if module and mod and not mod.startswith(module):
            return
        key = (ev.name, str(stats.get("hlo_op", "")), mod)
        row = rows.setdefault(
            key, {"name": key[0], "hlo_op": key[1], "hlo_module": key[2], "duration_us": 0.0, "count": 0}
        )
        row["duration_us"] += ev.duration_ns / 1e3
        row["count"] += 1

    for p in planes:
        for line in p.lines:
            if line.name in derived:
                continue
            for ev in line.events:
                add(ev, dict(ev.stats))
    if not planes:
        for p in data.planes:
            for line in p.lines:
                for ev in line.events:
                    stats = dict(ev.stats)
                    if "hlo_op" in stats:
                        add(ev, stats)
    return sorted(rows.values(), key=lambda r: -r["duration_us"])


def module_name(hlo_text: str) -> str:
    """The HLO module's name (what a trace's events call hlo_module)."""
    m = re.match(r"HloModule\s+([\w.\-]+)", hlo_text)
    return m.group(1) if m else ""


def _event_category(row: dict, by_name: dict[str, Kernel]) -> str:
    k = by_name.get(row.get("hlo_op", ""))
    if k is not None:
        return k.category
    name = row.get("name", "").lower()
    if "nccl" in name:
        return "collectives"
    if any(w in name for w in ("fmha", "flash", "attention", "cudnn")):
        return "attention"
    if any(w in name for w in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "sm80", "matmul", "cublas")):
        return "gemm"
    if "memcpy" in name or "memset" in name:
        return "copies/layout"
    return "elementwise"


_UNITS = {"duration_us": 1.0, "duration_ns": 1e-3, "duration_ms": 1e3, "duration_s": 1e6}


def _event_row(i: int, r: dict) -> dict:
    """One event row with its kernel `name` (or `kernel`) and `duration_us` (or _ns, _ms, _s: the time
    summed over its `count` occurrences in the trace)."""
    unit = next((k for k in _UNITS if k in r), None)
    if unit is None:
        raise ValueError(
            f"events[{i}]: no duration_us (or duration_ns / _ms / _s: the time summed over its "
            f"count occurrences); got keys {sorted(r)}"
        )
    return {**r, "name": r.get("name", r.get("kernel", "")), "duration_us": float(r[unit]) * _UNITS[unit]}


def measured(events: dict | list, hlo_text: str, accumulation: int = 1) -> dict:
    """The category table of a measured trace: `events` is {"steps": N, "step_s": wall seconds per
    step (optional), "events": [{"name", "hlo_op", "hlo_module", "duration_us", "count"}]} (or the
    bare list, one step; `kernel` for `name` and duration_ns / _ms / _s are read too), `hlo_text` the same program's
    optimized HLO (as the GPU compiled it). Each
    event takes the category of the HLO instruction it names (`categorize`); one that names none, by
    its kernel name. Seconds per step; `launch` is the step's wall time the kernels leave idle
    (launches, host work, syncs) when `step_s` is given."""
    if isinstance(events, list):
        events = {"steps": 1, "events": events}
    steps = float(events.get("steps", 1)) or 1.0
    rows = [_event_row(i, r) for i, r in enumerate(events.get("events", []))]
    ks = kernels(hlo_text, accumulation)
    by_name = {k.name: k for k in ks}
    by = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel: dict[str, float] = {}
    launches_ = 0
    for r in rows:
        cat = _event_category(r, by_name)
        secs = r["duration_us"] / 1e6 / steps
        by[cat] += secs
        per_kernel[r.get("hlo_op") or r.get("name", "?")] = (
            per_kernel.get(r.get("hlo_op") or r.get("name", "?"), 0) + secs
        )
        launches_ += r.get("count", 0)
    busy = sum(by.values())
    out = {
        "busy_s": busy,
        "time_by_category": by,
        "launches": launches_ / steps,
        "top_kernels": [
            {
                "name": n,
                "time_s": s,
                "category": by_name[n].category if n in by_name else _event_category({"name": n}, by_name),
            }
            for n, s in sorted(per_kernel.items(), key=lambda x: -x[1])[:15]
        ],
    }
    if events.get("step_s"):
        out["measured_step_s"] = float(events["step_s"])
        by["launch"] += max(float(events["step_s"]) - busy, 0.0)
    out["step_s"] = sum(by.values())
    return out
