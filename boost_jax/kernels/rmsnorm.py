"""RMSNorm that also returns the per-row sum of squares (for online RMSNorm under tensor parallelism).

For x: [..., d], scale: [d]:
    s = Σ_d x²            (float32, shape [...])
    y = x · rsqrt(s/d + eps) · scale   (cast back to x.dtype)

Under TP each device holds a slice of d: it needs its local s (to all-reduce) and its locally
normalised rows, so the kernel emits both from one pass over x. `impl` is "pallas" (Pallas kernels
through the Triton backend on GPU, the interpreter on CPU), "triton" (the same kernels in Triton
through jax-triton, kernels/rmsnorm_triton.py, NVIDIA GPUs only) or "xla" (plain jnp); which one a
model uses is kernels/norm_choice.py's choice. A kernel that cannot run falls back to XLA loudly: a
warning (once per process), an absl log line, and `kernels_used()` (in metrics.jsonl) names what ran
and why. Block strategy and the JAX versions the Pallas backend supports: the comments below.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from absl import logging
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental import pallas as pl

from boost_jax.errors import install_hint
from boost_jax.kernels import platform

# JAX versions: every `pallas_call` here passes the Triton backend's `CompilerParams` explicitly, which
# pins the Triton lowering (JAX >= 0.10 otherwise defaults Pallas on GPU to Mosaic GPU,
# `jax_pallas_use_mosaic_gpu`). JAX 0.11 deprecates that backend ("to keep using Triton, switch to the
# official Triton bindings and jax_triton", the Pallas changelog for 0.11.0): it still lowers there, and
# should `jax.experimental.pallas.triton` disappear, `impl="pallas"` falls back loudly as above while
# `impl="triton"` keeps running natively. The renamed `TritonCompilerParams` (before jax 0.7) is accepted.
try:  # Pallas's Triton backend (deprecated in jax 0.11): without it, impl="pallas" falls back loudly
    from jax.experimental.pallas import triton as plgpu

    _CompilerParams = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    _NO_PALLAS_TRITON = ""
except (ImportError, AttributeError) as e:  # pragma: no cover - depends on the installed jax
    plgpu = _CompilerParams = None
    _NO_PALLAS_TRITON = f"{type(e).__name__}: {e}"

_F32 = jnp.float32
IMPLS = ("xla", "pallas", "triton")
_LOWERS: dict = {}  # (impl, backend, dtypes, d, block_rows) -> failure reason ("" when it runs), probed once
_WARNED = False  # the fallback warning is emitted at most once per process
_USED: dict = {}  # (backend, dtype, d) -> the implementation that ran, for `kernels_used()`


def kernels_used() -> dict:
    """{"rmsnorm": what the norms traced since the last call ran}: "xla", "pallas", "pallas
    (interpreted)", "triton", "xla (pallas did not lower: ...)" or "xla (triton unavailable: ...)",
    distinct outcomes joined by "; ". The trainer records it after tracing its steps."""
    used = "; ".join(sorted(set(_USED.values()))) or "none traced"
    _USED.clear()
    return {"rmsnorm": used}


def rmsnorm_reference(x, scale, eps):
    """Plain-jnp RMSNorm: returns (y [..., d] in x.dtype, s [...] float32)."""
    xf = x.astype(_F32)
    # Tagged so low-rank remat keeps the statistics: recomputing them may need an all-reduce.
    s = checkpoint_name(jnp.sum(xf * xf, axis=-1), "norm_stats")
    y = xf * lax.rsqrt(s / x.shape[-1] + eps)[..., None] * scale.astype(_F32)
    return y.astype(x.dtype), s


# ----------------------------------------------------------------------------------------- kernels
#
# Block strategy: rows are flattened to
# [R, d]; a forward program owns `block_rows` rows and the whole row width, read as power-of-two
# column pieces (Triton needs power-of-two block shapes; d = 3200 is 2048 + 1024 + 128 lanes, not
# 4096). The backward runs a fixed grid of at most 128 programs, each looping over its row blocks
# and accumulating its partial dscale in registers, so the partials are [programs, d] float32
# whatever R is. Masked lanes read as 0 and are not stored; no padded copy of x is materialised.
#
# Refs are whole arrays; a program addresses its rows and columns with static-width slices:
# - columns: d is covered by power-of-two pieces (its binary digits down to _MIN_PIECE, then one
#   _MIN_PIECE-wide piece ending at d whose already-covered columns are masked), so any width runs
#   with at most _MIN_PIECE-1 redundant lanes and no padding to the next power of two;
# - rows: a block of `br` rows starts at min(i*br, n_rows-br) (never out of bounds) and rows before
#   i*br (the previous block's) are masked, so the last, partial block needs no padded input.

_MIN_PIECE = 16
_MAX_PROGRAMS = 128  # the backward's fixed grid: scale partials are [programs, d], not [row blocks, d]


def _pieces(d):
    """Static (start, width, tail) column pieces covering [0, d); `tail` pieces mask columns < start+width-rest."""
    out, start = [], 0
    for bit in reversed(range(d.bit_length())):
        w = 1 << bit
        if d & w and (w >= _MIN_PIECE or d < _MIN_PIECE):
            out.append((start, w, 0))
            start += w
    if start < d:  # a remainder narrower than _MIN_PIECE: one overlapping piece
        out.append((d - _MIN_PIECE, _MIN_PIECE, d - start))
    return tuple(out)


def _rows(block, br, n_rows):
    first = block * br
    row0 = jnp.minimum(first, n_rows - br)
    rows = row0 + jnp.arange(br)
    return row0, (rows >= first) & (rows < n_rows)


def _cols(width, tail):
    return jnp.arange(width) >= width - tail if tail else None


def _load(ref, row0, br, piece, rmask):
    c0, w, tail = piece
    cmask = _cols(w, tail)
    mask = rmask[:, None] if cmask is None else rmask[:, None] & cmask[None, :]
    return plgpu.load(ref.at[pl.ds(row0, br), pl.ds(c0, w)], mask=mask, other=0.0).astype(_F32)


def _store(ref, row0, br, piece, rmask, value):
    c0, w, tail = piece
    cmask = _cols(w, tail)
    mask = rmask[:, None] if cmask is None else rmask[:, None] & cmask[None, :]
    plgpu.store(ref.at[pl.ds(row0, br), pl.ds(c0, w)], value.astype(ref.dtype), mask=mask)


def _load_scale(w_ref, piece):
    c0, w, tail = piece
    v = plgpu.load(w_ref.at[pl.ds(c0, w)]).astype(_F32)
    return v if not tail else jnp.where(_cols(w, tail), v, 0.0)


def _fwd_kernel(x_ref, w_ref, y_ref, s_ref, *, n_rows, d, eps, br):
    pieces = _pieces(d)
    row0, rmask = _rows(pl.program_id(0), br, n_rows)
    # Masked lanes read 0: they add nothing to Σx²; real NaNs are never masked.
    xs = [_load(x_ref, row0, br, p, rmask) for p in pieces]
    s = sum(jnp.sum(x * x, axis=1) for x in xs)
    r = lax.rsqrt(s / d + eps)
    for p, x in zip(pieces, xs):
        _store(y_ref, row0, br, p, rmask, x * r[:, None] * _load_scale(w_ref, p)[None, :])
    plgpu.store(s_ref.at[pl.ds(row0, br)], s, mask=rmask)


def _bwd_kernel(x_ref, w_ref, dy_ref, ds_ref, dx_ref, dw_ref, *, n_rows, d, eps, br, programs, steps):
    pieces = _pieces(d)
    pid = pl.program_id(0)
    ws = [_load_scale(w_ref, p) for p in pieces]

    def block(k, acc):
        row0, rmask = _rows(pid + k * programs, br, n_rows)  # blocks past the end mask every row
        xs = [_load(x_ref, row0, br, p, rmask) for p in pieces]
        dys = [_load(dy_ref, row0, br, p, rmask) for p in pieces]
        ds = plgpu.load(ds_ref.at[pl.ds(row0, br)], mask=rmask, other=0.0).astype(_F32)
        # Recompute s (x is loaded anyway); r=0 on masked rows keeps them out of dscale even when
        # eps=0 would make rsqrt(0)=inf.
        r = jnp.where(rmask, lax.rsqrt(sum(jnp.sum(x * x, axis=1) for x in xs) / d + eps), 0.0)
        # y = x·r·w, r = (s/d+eps)^-1/2, ∂r/∂x = -r³x/d;  s contributes 2·x·ds.
        c = sum(jnp.sum(dy * w[None, :] * x, axis=1) for x, dy, w in zip(xs, dys, ws)) * (r * r * r) / d
        for p, x, dy, w in zip(pieces, xs, dys, ws):
            _store(dx_ref, row0, br, p, rmask, dy * w[None, :] * r[:, None] - x * c[:, None] + 2.0 * x * ds[:, None])
        return tuple(a + jnp.sum(dy * x * r[:, None], axis=0) for a, x, dy in zip(acc, xs, dys))

    acc = lax.fori_loop(0, steps, block, tuple(jnp.zeros((w,), _F32) for _, w, _ in pieces))
    for (c0, w, tail), a in zip(pieces, acc):  # this program's partial dscale, one row of [programs, d]
        cmask = _cols(w, tail)
        plgpu.store(dw_ref.at[pid, pl.ds(c0, w)], a, mask=cmask)


# ------------------------------------------------------------------------------------ pallas calls


def _params(br, d):
    # Block elements live in registers under Triton: more warps for wider blocks.
    return _CompilerParams(num_warps=4 if br * d <= 8192 else 8, num_stages=1)


def _fwd_call(x2, scale, eps, br, interpret):
    n_rows, d = x2.shape
    kernel = functools.partial(_fwd_kernel, n_rows=n_rows, d=d, eps=eps, br=br)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(n_rows, br),),
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((n_rows,), _F32)],
        compiler_params=_params(br, d),
        interpret=interpret,
        name="rmsnorm_fwd",
    )(x2, scale)


def _bwd_call(x2, scale, dy, ds, eps, br, interpret):
    n_rows, d = x2.shape
    n_blocks = pl.cdiv(n_rows, br)
    programs = min(n_blocks, _MAX_PROGRAMS)
    kernel = functools.partial(
        _bwd_kernel, n_rows=n_rows, d=d, eps=eps, br=br, programs=programs, steps=pl.cdiv(n_blocks, programs)
    )
    dx, dw_part = pl.pallas_call(
        kernel,
        grid=(programs,),
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((programs, d), _F32)],
        compiler_params=_params(br, d),
        interpret=interpret,
        name="rmsnorm_bwd",
    )(x2, scale, dy, ds)
    # Cross-program reduction of dscale outside the kernel (no atomics needed).
    return dx, jnp.sum(dw_part, axis=0).astype(scale.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _rmsnorm_pallas(x2, scale, eps, br, interpret):
    return tuple(_fwd_call(x2, scale, eps, br, interpret))


def _vjp_fwd(x2, scale, eps, br, interpret):
    return tuple(_fwd_call(x2, scale, eps, br, interpret)), (x2, scale)


def _vjp_bwd(eps, br, interpret, res, cts):
    x2, scale = res
    dy, ds = cts
    return _bwd_call(x2, scale, dy.astype(x2.dtype), ds.astype(_F32), eps, br, interpret)


_rmsnorm_pallas.defvjp(_vjp_fwd, _vjp_bwd)


# ------------------------------------------------------------------------------------- public API


def _default_block_rows(d):
    # ~8K elements per block (32 KiB of f32), at most 16 rows.
    return min(max(1, 8192 // pl.next_power_of_2(d)), 16)


def _probe(impl, x2, scale, br, compile_probe, why) -> str:
    """Run `compile_probe` once per (impl, backend, dtypes, d, block_rows): "" when the kernel
    compiles, else the reason, logged and (once per process) warned with `why(reason)`."""
    backend = platform.name()
    kind = str(getattr(platform.device(), "device_kind", ""))  # probed per target GPU model
    key = (impl, backend, kind, jnp.dtype(x2.dtype), jnp.dtype(scale.dtype), x2.shape[1], br)

    def on_failure(reason):
        global _WARNED
        message = why(backend, reason)
        logging.warning(message)
        if not _WARNED:
            _WARNED = True
            warnings.warn(message, stacklevel=6)

    return platform.probe_once(_LOWERS, key, compile_probe, on_failure)


def _one_block(x2, scale, br):
    """A one-block input on the target device (kernels/platform.py), so the probe compiles for it."""
    return (
        platform.abstract((br, x2.shape[1]), x2.dtype),
        platform.abstract(scale.shape, scale.dtype),
        platform.abstract((br, x2.shape[1]), x2.dtype),
        platform.abstract((br,), _F32),
    )


def _pallas_lowers(x2, scale, br):
    """Compile both Pallas kernels once per (backend, dtypes, d, block_rows) on a one-block input."""

    def compile_probe():
        if _NO_PALLAS_TRITON:
            raise ImportError(f"this jax has no Pallas Triton backend ({_NO_PALLAS_TRITON})")

        def probe(x, w, dy, ds):
            return _fwd_call(x, w, 1e-6, br, False), _bwd_call(x, w, dy, ds, 1e-6, br, False)

        jax.jit(probe).lower(*_one_block(x2, scale, br)).compile()  # on the target devices (_one_block)

    return _probe(
        "pallas",
        x2,
        scale,
        br,
        compile_probe,
        lambda backend, reason: (
            f"boost_jax rmsnorm: Pallas kernel does not lower on backend {backend!r} ({reason}); falling back "
            "to the XLA implementation (kernels.rmsnorm=triton runs the same kernel through jax-triton)."
        ),
    )


def _triton_compile_probe(x2, scale, block_rows, calls):
    """A probe compiling `calls(T, rows, x, w, dy, ds)` (T: the Triton module) on one block of rows."""

    def compile_probe():
        if not platform.is_nvidia():
            raise RuntimeError("needs an NVIDIA GPU")
        from boost_jax.kernels import rmsnorm_triton as T  # lazy: imports triton, the optional gpu extra

        rows = block_rows or T.default_rows(x2.shape[1])
        probe = functools.partial(calls, T, rows)
        jax.jit(probe).lower(*_one_block(x2, scale, rows)).compile()  # on the target devices (_one_block)

    return compile_probe


def _triton_runs(x2, scale, block_rows):
    """Compile both Triton kernels once per (backend, dtypes, d, block_rows); the reason when they cannot."""

    def calls(T, rows, x, w, dy, ds):
        return T.fwd_call(x, w, 1e-6, rows), T.bwd_call(x, w, dy, ds, 1e-6, rows)

    return _probe(
        "triton",
        x2,
        scale,
        block_rows,
        _triton_compile_probe(x2, scale, block_rows, calls),
        lambda backend, reason: (
            f"boost_jax rmsnorm: kernels.rmsnorm=triton cannot run on backend {backend!r} ({reason}); falling back "
            "to the XLA implementation. It needs an NVIDIA GPU with triton and jax-triton "
            f"({install_hint('gpu')}); elsewhere set kernels.rmsnorm=pallas or xla."
        ),
    )


def _triton_add_runs(x2, scale, block_rows):
    """`_triton_runs` for the fused residual add + norm kernels."""

    def calls(T, rows, x, w, dy, ds):
        del ds
        stats = T.add_rms_call(x, dy, w, 1e-6, rows)  # the statistics-only forward (kernels/norm_gemm.py)
        return T.add_fwd_call(x, dy, w, 1e-6, rows), T.add_bwd_call(x, w, dy, dy, 1e-6, rows), stats

    return _probe(
        "triton add",
        x2,
        scale,
        block_rows,
        _triton_compile_probe(x2, scale, block_rows, calls),
        lambda backend, reason: (
            f"boost_jax rmsnorm: the fused residual add + norm (kernels.residual_norm) cannot run on backend "
            f"{backend!r} ({reason}); falling back to XLA's add and norm. It needs an NVIDIA GPU with triton and "
            f"jax-triton ({install_hint('gpu')}); elsewhere set kernels.residual_norm=separate."
        ),
    )


def triton_add_failure(x2, scale, block_rows=None) -> str:
    """ "" when the fused add + norm's Triton kernels run here ([R, d] rows x2), else why not (warned once)."""
    return _triton_add_runs(x2, scale, block_rows)


def add_rmsnorm_reference(x, residual, scale, eps):
    """Plain jnp: (y = RMSNorm(h) [..., d] in x.dtype, h = x + residual in x.dtype)."""
    h = x + residual.astype(x.dtype)
    return rmsnorm_reference(h, scale, eps)[0], h


def add_rmsnorm(x, residual, scale, eps, *, impl="triton", block_rows=None):
    """The residual add and the norm that reads it: (y = RMSNorm(x + residual)·scale, h = x + residual),
    both in x.dtype. impl="triton" runs them as one kernel each way (rmsnorm_triton.py
    `add_rmsnorm_rows`), falling back to XLA loudly where it cannot; any other impl adds with XLA and
    runs `rmsnorm` with that impl on the sum."""
    *lead, d = x.shape
    if impl != "triton" or x.size == 0:
        h = x + residual.astype(x.dtype)
        return rmsnorm(h, scale, eps, impl=impl, block_rows=block_rows)[0], h
    if scale.shape != (d,):
        raise ValueError(f"scale shape {scale.shape} != ({d},)")
    x2, r2 = x.reshape(-1, d), residual.astype(x.dtype).reshape(-1, d)
    used_key = ("triton add", platform.name(), jnp.dtype(x.dtype).name, d)
    failure = _triton_add_runs(x2, scale, block_rows)
    _USED[used_key] = f"xla (triton unavailable: {failure})" if failure else "triton"
    if failure:
        return add_rmsnorm_reference(x, residual, scale, eps)
    from boost_jax.kernels import rmsnorm_triton as T  # lazy: imports triton, the optional gpu extra

    y, h = T.add_rmsnorm_rows(x2, r2, scale, float(eps), block_rows or T.default_rows(d))
    return y.reshape(x.shape), h.reshape(x.shape)


def rmsnorm(x, scale, eps, *, impl="pallas", block_rows=None, interpret=None):
    """RMSNorm over the last axis; returns (y [..., d] in x.dtype, s = Σx² [...] in float32).

    impl: "pallas" | "triton" | "xla". eps, block_rows and interpret are static. block_rows must be
    a power of two (Triton). interpret=None: the Pallas interpreter on CPU, compiled (Triton)
    elsewhere; the "triton" impl has no interpreter and ignores it.
    """
    used_key = (impl, platform.name(), jnp.dtype(x.dtype).name, x.shape[-1])
    if impl == "xla":
        _USED[used_key] = "xla"
        return rmsnorm_reference(x, scale, eps)
    if impl not in IMPLS:
        raise ValueError(f"unknown rmsnorm impl {impl!r}; kernels.rmsnorm is one of {IMPLS}")
    *lead, d = x.shape
    if scale.shape != (d,):
        raise ValueError(f"scale shape {scale.shape} != ({d},)")
    x2 = x.reshape(-1, d)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return rmsnorm_reference(x, scale, eps)
    if block_rows is not None and block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two, got {block_rows}")
    if impl == "triton":
        failure = _triton_runs(x2, scale, block_rows)
        _USED[used_key] = f"xla (triton unavailable: {failure})" if failure else "triton"
        if failure:
            return rmsnorm_reference(x, scale, eps)
        from boost_jax.kernels import rmsnorm_triton as T  # lazy: imports triton, the optional gpu extra

        y, s = T.rmsnorm_rows(x2, scale, float(eps), block_rows or T.default_rows(d))
        return y.reshape(x.shape), s.reshape(lead)
    br = block_rows or _default_block_rows(d)
    br = min(br, 1 << (n_rows.bit_length() - 1))  # a block never starts before row 0
    if interpret is None:
        interpret = platform.name() == "cpu"
    interpret = bool(interpret)
    # The interpreter needs no probe, unless this jax lacks the Pallas Triton primitives altogether.
    failure = _pallas_lowers(x2, scale, br) if not interpret or _NO_PALLAS_TRITON else ""
    _USED[used_key] = (
        f"xla (pallas did not lower: {failure})" if failure else "pallas (interpreted)" if interpret else "pallas"
    )
    if failure:
        return rmsnorm_reference(x, scale, eps)
    y, s = _rmsnorm_pallas(x2, scale, float(eps), br, interpret)
    return y.reshape(x.shape), s.reshape(lead)
