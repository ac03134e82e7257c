"""RMSNorm that also returns the per-row sum of squares (for online RMSNorm under tensor parallelism).

For x: [..., d], scale: [d]:
    s = Σ_d x²            (float32, shape [...])
    y = x · rsqrt(s/d + eps) · scale   (cast back to x.dtype)

Under TP each device holds a slice of d: it needs its local s (to all-reduce) and its locally
normalised rows, so the kernel emits both from one pass over x.

`impl="pallas"` runs Pallas kernels (forward and backward, via `jax.custom_vjp`) lowered through
the Triton backend on GPU and the interpreter on CPU. Block strategy: rows are flattened to
[R, d]; a grid step owns `block_rows` rows and the whole row width, padded *inside the block* to a
power of two (Triton needs power-of-two block sizes). Out-of-range rows/columns are masked at
load (read as 0) and at store, so no padded copy of x is ever materialised.
"""
from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.pallas import triton as plgpu

_F32 = jnp.float32
_LOWERS: dict = {}  # (backend, dtypes, d, block_rows) -> bool, probed once per key
_WARNED = False  # the fallback warning is emitted at most once per process


def rmsnorm_reference(x, scale, eps):
    """Plain-jnp RMSNorm: returns (y [..., d] in x.dtype, s [...] float32)."""
    xf = x.astype(_F32)
    # Tagged so low-rank remat keeps the statistics: recomputing them may need an all-reduce.
    s = checkpoint_name(jnp.sum(xf * xf, axis=-1), "norm_stats")
    y = xf * lax.rsqrt(s / x.shape[-1] + eps)[..., None] * scale.astype(_F32)
    return y.astype(x.dtype), s


# ----------------------------------------------------------------------------------------- kernels

def _masks(n_rows, d, br, dp):
    rows = pl.program_id(0) * br + jnp.arange(br)
    rmask = rows < n_rows
    cmask = jnp.arange(dp) < d
    return rmask, cmask, rmask[:, None] & cmask[None, :]


def _fwd_kernel(x_ref, w_ref, y_ref, s_ref, *, n_rows, d, eps):
    br, dp = x_ref.shape
    rmask, cmask, mask = _masks(n_rows, d, br, dp)
    # other=0: padding lanes add nothing to Σx²; real NaNs are never masked.
    x = plgpu.load(x_ref, mask=mask, other=0.0).astype(_F32)
    w = plgpu.load(w_ref, mask=cmask, other=0.0).astype(_F32)
    s = jnp.sum(x * x, axis=1)
    r = lax.rsqrt(s / d + eps)  # true d, not the padded block width
    plgpu.store(y_ref, (x * r[:, None] * w[None, :]).astype(y_ref.dtype), mask=mask)
    plgpu.store(s_ref, s, mask=rmask)


def _bwd_kernel(x_ref, w_ref, dy_ref, ds_ref, dx_ref, dw_ref, *, n_rows, d, eps):
    br, dp = x_ref.shape
    rmask, cmask, mask = _masks(n_rows, d, br, dp)
    x = plgpu.load(x_ref, mask=mask, other=0.0).astype(_F32)
    w = plgpu.load(w_ref, mask=cmask, other=0.0).astype(_F32)
    dy = plgpu.load(dy_ref, mask=mask, other=0.0).astype(_F32)
    ds = plgpu.load(ds_ref, mask=rmask, other=0.0).astype(_F32)
    # Recompute s (x is loaded anyway); r=0 on out-of-range rows keeps them out of dscale even
    # when eps=0 would make rsqrt(0)=inf.
    r = jnp.where(rmask, lax.rsqrt(jnp.sum(x * x, axis=1) / d + eps), 0.0)
    g = dy * w[None, :]
    # y = x·r·w, r = (s/d+eps)^-1/2, ∂r/∂x = -r³x/d;  s contributes 2·x·ds.
    c = jnp.sum(g * x, axis=1) * (r * r * r) / d
    dx = g * r[:, None] - x * c[:, None] + 2.0 * x * ds[:, None]
    plgpu.store(dx_ref, dx.astype(dx_ref.dtype), mask=mask)
    dw_ref[...] = jnp.sum(dy * x * r[:, None], axis=0)  # this block's partial dscale


# ------------------------------------------------------------------------------------ pallas calls

def _common(x2, br):
    n_rows, d = x2.shape
    dp = pl.next_power_of_2(d)
    nb = pl.cdiv(n_rows, br)
    # Block elements live in registers under Triton: more warps for wider blocks.
    params = plgpu.CompilerParams(num_warps=4 if br * dp <= 8192 else 8, num_stages=1)
    row_spec = pl.BlockSpec((br, dp), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((br,), lambda i: (i,))
    w_spec = pl.BlockSpec((dp,), lambda i: (0,))
    return n_rows, d, dp, nb, params, row_spec, vec_spec, w_spec


def _fwd_call(x2, scale, eps, br, interpret):
    n_rows, d, dp, nb, params, row_spec, vec_spec, w_spec = _common(x2, br)
    kernel = functools.partial(_fwd_kernel, n_rows=n_rows, d=d, eps=eps)
    return pl.pallas_call(
        kernel, grid=(nb,), in_specs=[row_spec, w_spec], out_specs=[row_spec, vec_spec],
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((n_rows,), _F32)],
        compiler_params=params, interpret=interpret, name="rmsnorm_fwd",
    )(x2, scale)


def _bwd_call(x2, scale, dy, ds, eps, br, interpret):
    n_rows, d, dp, nb, params, row_spec, vec_spec, w_spec = _common(x2, br)
    kernel = functools.partial(_bwd_kernel, n_rows=n_rows, d=d, eps=eps)
    dx, dw_part = pl.pallas_call(
        kernel, grid=(nb,), in_specs=[row_spec, w_spec, row_spec, vec_spec],
        out_specs=[row_spec, pl.BlockSpec((None, dp), lambda i: (i, 0))],
        out_shape=[jax.ShapeDtypeStruct(x2.shape, x2.dtype), jax.ShapeDtypeStruct((nb, dp), _F32)],
        compiler_params=params, interpret=interpret, name="rmsnorm_bwd",
    )(x2, scale, dy, ds)
    # Cross-block reduction of dscale outside the kernel (no atomics needed).
    return dx, jnp.sum(dw_part, axis=0)[:d].astype(scale.dtype)


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

def _default_block_rows(n_rows, dp):
    # ~8K elements per block (32 KiB of f32), at most 16 rows, no more rows than exist.
    return min(max(1, 8192 // dp), 16, pl.next_power_of_2(max(n_rows, 1)))


def _pallas_lowers(x2, scale, br):
    """Compile both kernels once per (backend, dtypes, d, block_rows) on a one-block input."""
    global _WARNED
    backend = jax.default_backend()
    key = (backend, jnp.dtype(x2.dtype), jnp.dtype(scale.dtype), x2.shape[1], br)
    if key not in _LOWERS:
        xs = jax.ShapeDtypeStruct((br, x2.shape[1]), x2.dtype)
        ws = jax.ShapeDtypeStruct(scale.shape, scale.dtype)
        ss = jax.ShapeDtypeStruct((br,), _F32)

        def probe(x, w, dy, ds):
            return _fwd_call(x, w, 1e-6, br, False), _bwd_call(x, w, dy, ds, 1e-6, br, False)

        try:
            jax.jit(probe).lower(xs, ws, xs, ss).compile()
            _LOWERS[key] = True
        except Exception as e:  # noqa: BLE001 - any lowering/compile failure means "use XLA"
            _LOWERS[key] = False
            if not _WARNED:
                _WARNED = True
                warnings.warn(f"boost_jax rmsnorm: Pallas kernel does not lower on backend "
                              f"{backend!r} ({type(e).__name__}: {str(e)[:300]}); "
                              f"falling back to the XLA implementation.", stacklevel=3)
    return _LOWERS[key]


def rmsnorm(x, scale, eps, *, impl="pallas", block_rows=None, interpret=None):
    """RMSNorm over the last axis; returns (y [..., d] in x.dtype, s = Σx² [...] in float32).

    eps, block_rows and interpret are static. block_rows must be a power of two (Triton).
    interpret=None: Pallas interpreter on CPU, compiled (Triton) elsewhere.
    """
    if impl == "xla":
        return rmsnorm_reference(x, scale, eps)
    if impl != "pallas":
        raise ValueError(f"unknown rmsnorm impl {impl!r}")
    *lead, d = x.shape
    if scale.shape != (d,):
        raise ValueError(f"scale shape {scale.shape} != ({d},)")
    x2 = x.reshape(-1, d)
    n_rows = x2.shape[0]
    if n_rows == 0:
        return rmsnorm_reference(x, scale, eps)
    br = block_rows or _default_block_rows(n_rows, pl.next_power_of_2(d))
    if br & (br - 1):
        raise ValueError(f"block_rows must be a power of two, got {br}")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    interpret = bool(interpret)
    if not interpret and not _pallas_lowers(x2, scale, br):
        return rmsnorm_reference(x, scale, eps)
    y, s = _rmsnorm_pallas(x2, scale, float(eps), br, interpret)
    return y.reshape(x.shape), s.reshape(lead)
