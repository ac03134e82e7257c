"""Sizes and element types of HLO shapes as an optimized program prints them (`bf16[8,128]{1,0}`,
tuples of them): what tools/step_profile/ prices a kernel's bytes by."""

from __future__ import annotations

import math
import re

DTYPE_BYTES = {
    "pred": 1,
    "s4": 0.5,
    "u4": 0.5,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "c64": 8,
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_DIMS = re.compile(r"\d+")


def shape_bytes(shape: str) -> float:
    """Bytes of an HLO shape (tuples summed; tokens and unknown types 0)."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        n = math.prod(int(d) for d in _DIMS.findall(dims.replace("<=", "")))
        total += n * DTYPE_BYTES.get(dtype, 0)
    return total


def shape_dims(shape: str) -> list[int]:
    m = _ARRAY.search(shape)
    return [int(d) for d in _DIMS.findall(m.group(2))] if m else []


def shape_dtype(shape: str) -> str:
    m = _ARRAY.search(shape)
    return m.group(1) if m else ""


def tuple_members(shape: str) -> list[str]:
    """The top-level members of a tuple shape (the shape itself when it is an array)."""
    s = shape.strip()
    if not s.startswith("("):
        return [s]
    inner, depth, start, out = s[1:-1], 0, 0, []
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(inner[start:i])
            start = i + 1
    out.append(inner[start:])
    return [re.sub(r"/\*.*?\*/", "", m).strip() for m in out if m.strip()]
