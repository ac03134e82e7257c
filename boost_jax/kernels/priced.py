"""How a Pallas/Triton kernel tells the step-time table its FLOPs: its name carries its GEMM shape.

    pl.pallas_call(..., name=gemm_name("gated_gemm_fwd", 1, m, n, k))   # "gated_gemm_fwd__gemm_1x{m}x{n}x{k}"

A custom call's bytes are read from its operands and outputs, but nothing in the HLO says what it
computes. tools/step_profile/kernels.py reads `gemm_shape` back from the call's kernel name: such a
call is a GEMM of 2·batch·m·n·k FLOPs, priced like an XLA GEMM of that shape (its efficiency class,
max(FLOPs / (peak x efficiency), bytes / bandwidth)), elementwise work inside it (a prologue or an
epilogue) counted by its bytes only. Only the matmul a kernel's plain-jnp reference computes is named.
"""

from __future__ import annotations

import re

TAG = "__gemm_"
_SHAPE = re.compile(rf"{TAG}(\d+)x(\d+)x(\d+)x(\d+)$")


def gemm_name(base: str, batch: int, m: int, n: int, k: int) -> str:
    """A kernel name that carries its GEMM (batch, m, n, k): `base__gemm_BxMxNxK` (only characters
    MLIR keeps in a function name)."""
    return f"{base}{TAG}{int(batch)}x{int(m)}x{int(n)}x{int(k)}"


def gemm_shape(name: str) -> tuple[int, int, int, int] | None:
    """(batch, m, n, k) a kernel name carries (`gemm_name`), or None."""
    found = _SHAPE.search(name or "")
    return tuple(int(x) for x in found.groups()) if found else None
