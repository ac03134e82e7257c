"""Tensor-train linear: d_in -> d_out as `model.tt_cores` 3-D cores, run by half-reconstruction.

d_in is factorised into h = tt_cores/2 input modes (most equal factors, descending) and d_out into h
output modes (ascending). The first half of the cores G_1..G_h, shapes (r_{k-1}, m_k, r_k) with
r_0 = 1 and r_h = r_mid = `model.rank`, multiplies out to M1 [d_in, r_mid] (m_1 the most significant
digit of the input index); the second half H_1..H_h, shapes (s_{k-1}, o_k, s_k) with s_0 = r_mid and
s_h = 1, multiplies out to M2 [r_mid, d_out] (o_h, the LAST core's mode, the most significant digit of
the output index). The layer is then two GEMMs through the r_mid bottleneck, x·M1 then σ then ·M2,
with σ = `model.tt_activation` (none | silu).

Inner ranks, how parallel plans split the halves, and the init: `TensorTrain`.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.config import Field
from boost_jax.model.kinds.base import LinearKind
from boost_jax.parallel.rules import gathered


@functools.lru_cache(maxsize=None)
def balanced_factors(n: int, k: int) -> tuple[int, ...]:
    """The k integer factors of n (product n) with the smallest largest factor, in descending order."""
    if k == 1:
        return (n,)
    for f in range(1, n + 1):  # the smallest feasible largest factor: f^k >= n and the rest fits under f
        if n % f == 0 and f**k >= n:
            rest = balanced_factors(n // f, k - 1)
            if rest[0] <= f:
                return (f,) + rest
    raise AssertionError("unreachable: (n, 1, ..., 1) always fits")


def tt_shapes(m, d_in: int, d_out: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """Core shapes of the input half and of the output half."""
    h, r_mid = int(m.tt_cores) // 2, int(m.rank)
    inner = int(m.tt_inner_rank) or r_mid
    ins = balanced_factors(d_in, h)  # descending
    outs = tuple(reversed(balanced_factors(d_out, h)))  # ascending
    ranks = [1] + [min(inner, math.prod(ins[:k]), math.prod(ins[k:]) * r_mid) for k in range(1, h)] + [r_mid]
    first = [(ranks[k], ins[k], ranks[k + 1]) for k in range(h)]
    ranks = [r_mid] + [min(inner, r_mid * math.prod(outs[:k]), math.prod(outs[k:])) for k in range(1, h)] + [1]
    second = [(ranks[k], outs[k], ranks[k + 1]) for k in range(h)]
    return first, second


class TensorTrain(LinearKind):
    """Inner ranks: every rank between two cores of a half is min(`model.tt_inner_rank` (0: r_mid), the TT
    bound), the TT bound being the smaller of the sizes on either side of that bond (so no core is wider
    than the matrix it can represent).

    Parallel plans see only M1 and M2. The first core's mode carries the input's logical axis and the
    last core's mode the output's, so BTP splits them over `tensor`: M1's rows and M2's columns come out
    split in contiguous blocks (row-parallel first GEMM whose r_mid-wide partial product is all-reduced,
    column-parallel second GEMM), exactly like a CoLA layer. A mode the tensor size does not divide stays
    replicated and the reconstructed matrix is sliced locally. Middle cores are tiny and replicated.

    Init: each core N(0, 1)·(r_left·r_right)^(-1/4)·s^(1/cores) with s² = 1/(d_in + d_out): every bond
    index is summed over in the product, so the reconstructed d_in x d_out weight has entry variance s²,
    the dense layer's.
    """

    family = "tt"
    fields = {
        "tt_cores": Field(
            4,
            "tt: tensor-train cores per projection (even; half on each side of the r_mid bottleneck), see kinds/tt.py",
        ),
        "tt_inner_rank": Field(
            0, "tt: the rank between cores of a half (0: model.rank; always capped by the TT bound, see kinds/tt.py)"
        ),
        "tt_activation": Field("none", "tt: the bottleneck activation, none | silu"),
    }

    def __init__(self, m, d_in, d_out, *, axes, group, rngs, param_dtype):
        super().__init__(m, d_in, d_out, axes=axes, group=group, rngs=rngs, param_dtype=param_dtype)
        first, second = tt_shapes(m, d_in, d_out)
        self.h = len(first)
        self.silu = m.tt_activation == "silu"
        n_cores = 2 * self.h
        scale = (d_in + d_out) ** (-0.5 / n_cores)
        for k, shape in enumerate(first):
            names = (
                None if k == 0 else "tt_rank",
                axes[0] if k == 0 else None,
                "rank" if k == self.h - 1 else "tt_rank",
            )
            std = (shape[0] * shape[2]) ** -0.25 * scale
            setattr(
                self,
                f"in_{k}",
                nnx.Param(std * jax.random.normal(rngs.params(), shape, param_dtype), axes=names, compute_only=True),
            )
        for k, shape in enumerate(second):
            last = k == self.h - 1
            names = ("rank" if k == 0 else "tt_rank", axes[1] if last else None, None if last else "tt_rank")
            std = (shape[0] * shape[2]) ** -0.25 * scale
            setattr(
                self,
                f"out_{k}",
                nnx.Param(std * jax.random.normal(rngs.params(), shape, param_dtype), axes=names, compute_only=True),
            )

    @classmethod
    def n_params(cls, m, d_in, d_out):
        first, second = tt_shapes(m, d_in, d_out)
        return sum(math.prod(s) for s in first + second)

    @classmethod
    def weight_flops(cls, m, d_in, d_out):
        first, second = tt_shapes(m, d_in, d_out)
        flops, rows = 0, first[0][1]
        for left, mode, right in first[1:]:  # [rows, left] x [left, mode*right]
            flops += 2 * rows * left * mode * right
            rows *= mode
        cols = second[-1][1]
        for left, mode, right in reversed(second[:-1]):  # [left*mode, right] x [right, cols]
            flops += 2 * left * mode * right * cols
            cols *= mode
        return flops

    @classmethod
    def split_widths(cls, m, d_in, d_out):
        first, second = tt_shapes(m, d_in, d_out)  # M1's rows (m_1, .., m_k) and M2's columns (o_k, .., o_1)
        return tuple(mode for _, mode, _ in first[1:]) + tuple(mode for _, mode, _ in second[:-1])

    @classmethod
    def nonlinear(cls, m):
        return m.tt_activation == "silu"

    @classmethod
    def validate(cls, m, widths):
        if int(m.tt_cores) < 2 or int(m.tt_cores) % 2:
            return f"model.tt_cores: {m.tt_cores} must be even and >= 2 (half the cores per side of the bottleneck)"
        if int(m.tt_inner_rank) < 0:
            return f"model.tt_inner_rank: {m.tt_inner_rank} must be >= 0 (0: the middle rank, model.rank)"
        if m.tt_activation not in ("none", "silu"):
            return f"model.tt_activation: {m.tt_activation!r} is not one of ('none', 'silu')"
        return super().validate(m, widths)

    def _core(self, name, use):
        p = getattr(self, name)
        return use(p[...], tuple(p.get_metadata()["axes"]))

    def first_weight(self, use=gathered):
        w = self._core("in_0", use)[0]  # [m_1, r_1]
        for k in range(1, self.h):
            core = self._core(f"in_{k}", use)
            w = jnp.einsum("ia,ajb->ijb", w, core).reshape(-1, core.shape[-1])
        return w  # [d_in, r_mid]

    def second_weight(self, use=gathered):
        w = self._core(f"out_{self.h - 1}", use)[..., 0]  # [s, o_h]
        for k in range(self.h - 2, -1, -1):
            core = self._core(f"out_{k}", use)
            w = jnp.einsum("aib,bj->aji", core, w).reshape(core.shape[0], -1)
        return w  # [r_mid, d_out]

    def bottleneck(self, h):
        return jax.nn.silu(h) if self.silu else h
