"""Tallies of a program's collectives, {"kind@axes": {count, elements, bytes}} (tools/comm_report/):
counted as executed, combined (per layer = 2 layers - 1 layer), summed by traffic class."""

from __future__ import annotations

import re

FIELDS = ("count", "elements", "bytes")  # of a tally entry


def _key(c) -> str:
    return f"{c.kind}@{'+'.join(c.axes) or 'none'}"


def itemsize(dtype: str) -> float:
    """Bytes per element of an HLO dtype name (f32, bf16, pred, s8, f8e4m3fn, ...)."""
    if dtype == "pred":
        return 1
    bits = re.search(r"\d+", dtype)
    return int(bits.group(0)) / 8 if bits else 0


def bytes_per_element(collectives) -> dict:
    """{kind@axes: bytes per element} over these collectives, each at its own dtype."""
    acc: dict = {}
    for c in collectives:
        e, b = acc.get(_key(c), (0, 0.0))
        acc[_key(c)] = (e + c.elements, b + c.elements * itemsize(c.dtype))
    return {k: b / e for k, (e, b) in acc.items() if e}


def tally_collectives(collectives, per_element: dict | None = None) -> dict:
    """{kind@axes: count, elements, bytes} as executed: a collective inside loops counts once per trip
    (`Collective.trips`, e.g. the chunked loss's scan over vocab-parallel chunks); bytes at
    `per_element[kind@axes]` (from the partitioned program), else at the collective's own dtype."""
    out: dict = {}
    for c in collectives:
        if c.trips is None:
            raise RuntimeError(
                f"a {c.kind} over {'+'.join(c.axes) or 'no axis'} ({c.op_name or c.computation}) "
                "runs inside a loop without a known trip count: its traffic cannot be counted"
            )
        slot = out.setdefault(_key(c), {"count": 0, "elements": 0, "bytes": 0.0})
        slot["count"] += c.trips
        slot["elements"] += c.elements * c.trips
        slot["bytes"] += c.elements * c.trips * (per_element or {}).get(_key(c), itemsize(c.dtype))
    return out


def combine(a: dict, b: dict, wa: int = 1, wb: int = 1) -> dict:
    """wa*a + wb*b, entries that cancel dropped."""
    out = {}
    for k in sorted(set(a) | set(b)):
        slot = {f: wa * a.get(k, {}).get(f, 0) + wb * b.get(k, {}).get(f, 0) for f in FIELDS}
        if slot["count"] or slot["elements"]:
            out[k] = slot
    return out


def axis_group(key: str) -> str:
    """'tensor' (activations), 'grid' (the spatial-temporal groups' permutes on the fsdp x tensor
    grid: activations and compute-dtype weight blocks), 'context' (the attention's K/V exchange over
    the sequence split) or 'data_fsdp' (gradients, parameters; anything else touching data/fsdp/context)."""
    kind, axes = key.split("@")
    axes = set(axes.split("+"))
    if axes == {"context"} and kind != "all-reduce":  # the attention's exchange over the sequence split
        return "context"
    if kind == "collective-permute" and "fsdp" in axes and not {"data", "pipeline"} & axes:
        return "grid"
    return "data_fsdp" if {"data", "fsdp", "context"} & axes else "tensor"  # context: gradients, like data


def sum_by(tally: dict, group) -> dict:
    out: dict = {}
    for k, v in tally.items():
        slot = out.setdefault(group(k), {f: 0 for f in v})
        for f, x in v.items():
            slot[f] += x
    return out
