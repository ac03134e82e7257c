"""The residual add and RMSNorm read into the GEMM that consumes the normalised rows.

    z, h = add_norm_matmul(x, residual, scale, w, eps)   # (RMSNorm(x + residual)·scale @ w, x + residual)

Apart, the fused add + norm (kernels/rmsnorm_triton.py) writes h and y = RMSNorm(h)·scale, and the
first-stage GEMM reads y, which the backward keeps for the weight gradient. Here the add writes h and
each row's 1/rms (float32) only; one Pallas kernel each way normalises the tile of h it loads (a
prologue): the forward z = y @ w and the weight gradient yᵀ @ dz. The input gradient dy = dz @ wᵀ is
XLA's GEMM, and the fused add + norm's backward kernel takes it with h's own gradient, as before. y is
rounded to h's dtype per tile as the norm would store it. `add_norm_reference` is the plain jnp
(impl="xla"); on CPU the kernels run under Pallas's interpreter and the add's statistics and the norm's
backward in jnp (the Triton kernels have no interpreter here). Each kernel's name carries its GEMM.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from boost_jax.kernels import platform
from boost_jax.kernels.gated_gemm import MIN_DIM, PARAMS, TILE_K, TILE_M, TILE_N, batched, dot, plgpu, span, spread
from boost_jax.kernels.gated_gemm import tile_size as tile
from boost_jax.kernels.priced import gemm_name
from boost_jax.kernels.rmsnorm import add_rmsnorm, rmsnorm_reference, triton_add_failure

_F32 = jnp.float32


def add_norm_reference(x, residual, scale, w, eps, norm_impl: str = "xla"):
    """(RMSNorm(x + residual)·scale @ w in x's dtype, accumulated in float32, x + residual): the add and
    norm by `add_rmsnorm` (impl `norm_impl`), then XLA's GEMM."""
    y, h = add_rmsnorm(x, residual, scale, eps, impl=norm_impl)
    z = jnp.einsum("...d,dn->...n", y, w.astype(y.dtype), preferred_element_type=_F32)
    return z.astype(y.dtype), h


def _normed(h_ref, inv_ref, s_ref, rows, cols, dtype):
    """The tile y[rows, cols] = h·(1/rms)·scale in float32 math, rounded to `dtype`."""
    inv = plgpu.load(inv_ref.at[rows, pl.ds(0, 1)])
    y = plgpu.load(h_ref.at[rows, cols]).astype(_F32) * inv
    return y * plgpu.load(s_ref.at[cols]).astype(_F32)[None, :]


def _fwd(h_ref, inv_ref, s_ref, w_ref, z_ref, *, m, d, n, tiles):
    """z[tile] = sum over d's tiles of y[rows, k] @ w[k, cols], y normalised as loaded."""
    bm, bn, bk = tiles
    r0, rmask = span(pl.program_id(0), m, bm)
    c0, cmask = span(pl.program_id(1), n, bn)
    rows = pl.ds(r0, bm)

    def step(i, acc):
        k0, kmask = span(i, d, bk)
        y = _normed(h_ref, inv_ref, s_ref, rows, pl.ds(k0, bk), z_ref.dtype)
        y = jnp.where(kmask[None, :], y, 0.0).astype(z_ref.dtype)
        return acc + dot(y, plgpu.load(w_ref.at[pl.ds(k0, bk), pl.ds(c0, bn)]).astype(z_ref.dtype))

    acc = jax.lax.fori_loop(0, pl.cdiv(d, bk), step, jnp.zeros((bm, bn), _F32))
    plgpu.store(z_ref.at[rows, pl.ds(c0, bn)], acc.astype(z_ref.dtype), mask=rmask[:, None] & cmask[None, :])


def _dw(h_ref, inv_ref, s_ref, dz_ref, dw_ref, *, m, d, n, tiles):
    """dw[tile] = sum over row tiles of y[k, ds]ᵀ @ dz[k, cols] (dw's rows: d, its columns: n)."""
    bm, bn, bk = tiles
    f0, fmask = span(pl.program_id(0), d, bm)
    c0, cmask = span(pl.program_id(1), n, bn)

    def step(i, acc):
        k0, kmask = span(i, m, bk)
        ks = pl.ds(k0, bk)
        y = _normed(h_ref, inv_ref, s_ref, ks, pl.ds(f0, bm), dz_ref.dtype)
        y = jnp.where(kmask[:, None], y, 0.0).astype(dz_ref.dtype)
        return acc + dot(y, plgpu.load(dz_ref.at[ks, pl.ds(c0, bn)]), trans_a=True)

    acc = jax.lax.fori_loop(0, pl.cdiv(m, bk), step, jnp.zeros((bm, bn), _F32))
    plgpu.store(dw_ref.at[pl.ds(f0, bm), pl.ds(c0, bn)], acc.astype(dw_ref.dtype), mask=fmask[:, None] & cmask[None, :])


def _kernel(which, interpret, out=None):
    """fwd: (h [..., d], inv [..., 1], scale [d], w [d, n]) -> z [..., n]; dw: (h, inv, scale, dz) -> dw
    [d, n] in dtype `out`. Batched under vmap as kernels/gated_gemm.py's (scale and w: the weights)."""

    def call2d(h, inv, scale, x):
        m, d = h.shape
        scale = scale.reshape(d)  # dw's inputs all come as rows ([1, d] here)
        n = x.shape[-1]
        kw = dict(m=m, d=d, n=n)
        if which == "fwd":
            tiles = (tile(m, TILE_M), tile(n, TILE_N), tile(d, TILE_K))
            grid, shape, gemm, kernel = (m, n), (m, n), (m, n, d), _fwd
        else:
            tiles = (*spread(tile(d, TILE_M), tile(n, TILE_N), d, n), tile(m, TILE_K))
            grid, shape, gemm, kernel = (d, n), (d, n), (d, n, m), _dw
        return pl.pallas_call(
            functools.partial(kernel, tiles=tiles, **kw),
            grid=tuple(pl.cdiv(a, t) for a, t in zip(grid, tiles[:2])),
            out_shape=jax.ShapeDtypeStruct(shape, out or h.dtype),
            compiler_params=PARAMS(num_warps=4, num_stages=2),
            interpret=interpret,
            name=gemm_name(f"norm_gemm_{which}", 1, *gemm),
        )(h, inv, scale, x)

    return batched(call2d, (2, 3) if which == "fwd" else (), "rows" if which == "fwd" else "whole")


def _stats(x, r, scale, eps, interpret):
    """(h = x + r, 1/rms [..., 1] float32): the Triton add kernel, or jnp under the interpreter."""
    if interpret:
        h = x + r
        hf = h.astype(_F32)
        return h, jax.lax.rsqrt(jnp.mean(hf * hf, axis=-1, keepdims=True) + eps)
    from boost_jax.kernels import rmsnorm_triton as T  # lazy: imports triton, the optional gpu extra

    d = x.shape[-1]
    h, inv = T.add_rms_rows(x.reshape(-1, d), r.reshape(-1, d), scale, float(eps), T.default_rows(d))
    return h.reshape(x.shape), inv.reshape(*x.shape[:-1], 1)


def _norm_bwd(h, scale, dy, dh, eps, interpret):
    """(dx, dscale) of y = RMSNorm(h)·scale, h = x + r: the Triton add + norm backward, or jnp's."""
    if interpret:
        dn, dscale = jax.vjp(lambda h, s: rmsnorm_reference(h, s, eps)[0], h, scale)[1](dy)
        return dn + dh, dscale
    from boost_jax.kernels import rmsnorm_triton as T  # lazy: imports triton, the optional gpu extra

    d = h.shape[-1]
    rows = lambda a: a.reshape(-1, d)  # noqa: E731
    dx, dscale = T.add_rmsnorm_bwd_rows(rows(h), scale, rows(dy), rows(dh), float(eps), T.default_rows(d))
    return dx.reshape(h.shape), dscale


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(x, r, scale, w, eps, interpret):
    return _fused_fwd(x, r, scale, w, eps, interpret)[0]


def _fused_fwd(x, r, scale, w, eps, interpret):
    h, inv = _stats(x, r, scale, eps, interpret)
    return (_kernel("fwd", interpret)(h, inv, scale, w), h), (h, inv, scale, w)


def _fused_bwd(eps, interpret, res, cts):
    h, inv, scale, w = res
    dz, dh = (c.astype(h.dtype) for c in cts)
    dy = jnp.einsum("...n,dn->...d", dz, w.astype(h.dtype), preferred_element_type=_F32).astype(h.dtype)
    dw = _kernel("dw", interpret, out=w.dtype)(h, inv, scale, dz)
    dx, dscale = _norm_bwd(h, scale, dy, dh, eps, interpret)
    return dx, dx, dscale.astype(scale.dtype), dw


_fused.defvjp(_fused_fwd, _fused_bwd)


def add_norm_matmul(x, residual, scale, w, eps, *, impl: str = "pallas", norm_impl: str = "xla", interpret=None):
    """(RMSNorm(x + residual)·scale @ w, x + residual), both in x's dtype (x, residual: [..., d]; scale
    [d]; w [d, n] read in its dtype, cast per tile; its gradient in w's dtype, accumulated in float32).
    impl="pallas": the add writes h and 1/rms, the kernels above normalise as they load (interpreted on
    CPU unless `interpret` says otherwise); "xla", a side under 16, or kernels that do not compile here
    (warned once): `add_norm_reference` with the norm's `norm_impl`."""
    if impl not in ("pallas", "xla"):
        raise ValueError(f"add_norm_matmul impl={impl!r}: pallas or xla")
    d = x.shape[-1]
    if residual.shape != x.shape or scale.shape != (d,) or w.ndim != 2 or w.shape[0] != d:
        raise ValueError(f"add_norm_matmul: x {x.shape}, residual {residual.shape}, scale {scale.shape}, w {w.shape}")
    residual = residual.astype(x.dtype)
    rows = x.size // max(d, 1)
    if interpret is None:
        interpret = platform.name() == "cpu"
    if impl == "xla" or min(rows, *w.shape) < MIN_DIM or x.size >= 2**31:
        return add_norm_reference(x, residual, scale, w, eps, norm_impl)
    failure = _lowers(x.dtype, bool(interpret)) or ("" if interpret else triton_add_failure(x.reshape(-1, d), scale))
    if failure:
        return add_norm_reference(x, residual, scale, w, eps, norm_impl)
    return _fused(x, residual, scale, w, float(eps), bool(interpret))


_LOWERS: dict = {}  # (backend, device kind, dtype, interpret) -> "" when the kernels compile, else why not


def _lowers(dtype, interpret) -> str:
    """Compile both kernels once per target and dtype on small odd shapes; the reason when they cannot
    (warned once, and `add_norm_reference` runs)."""
    kind = str(getattr(platform.device(), "device_kind", ""))
    key = (platform.name(), kind, jnp.dtype(dtype).name, interpret)

    def compile_probe():
        if plgpu is None:
            raise ImportError("this jax has no Pallas Triton backend")
        if interpret:  # the interpreter runs jnp: nothing to compile
            return
        h, inv = platform.abstract((40, 48), dtype), platform.abstract((40, 1), _F32)
        s, w, dz = (
            platform.abstract((48,), _F32),
            platform.abstract((48, 24), dtype),
            platform.abstract((40, 24), dtype),
        )

        def step(h, inv, s, w, dz):
            return _kernel("fwd", interpret)(h, inv, s, w), _kernel("dw", interpret, out=w.dtype)(h, inv, s, dz)

        jax.jit(step).lower(h, inv, s, w, dz).compile()

    def warn(reason):
        warnings.warn(
            f"boost_jax add_norm_matmul: the Pallas norm-in-GEMM kernels do not compile here ({reason}); "
            "the add + norm and the GEMM run apart (model.bottleneck_kernel=rope says so without this warning)",
            stacklevel=5,
        )

    return platform.probe_once(_LOWERS, key, compile_probe, warn)
