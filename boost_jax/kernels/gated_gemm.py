"""The MLP's gate·up product inside the GEMM that reads it: s = (act(g)·u) @ w, one Pallas kernel each way.

    s = gated_matmul(g, u, w, act="none" | "silu", impl="pallas" | "xla")   # g, u: [..., F], w: [F, R]

A low-rank MLP's down projection starts with the r-wide GEMM (act(g)·u) @ A. Apart, the product is a
kernel of its own (read g, u, write h; kernels/gate.py) and the GEMM reads h; its backward writes
dh = ds @ Aᵀ, a kernel reads dh, g, u and writes dg, du, and A's gradient reads h. Here the forward
GEMM computes act(g)·u per tile of its K loop (a prologue), the input gradient's GEMM writes
dg = dh·u·act'(g) and du = dh·act(g) from its tile of dh (an epilogue), and A's gradient
(act(g)·u)ᵀ @ ds recomputes the product per tile: no [.., F] tensor but g, u, dg, du crosses HBM.
Float32 accumulation, results stored in the inputs' dtype. `gated_reference` is the plain-jnp
computation (impl="xla" runs it). Tiles start at most at dim - block (never out of bounds, as
kernels/gate.py's), masking what the previous tile covered. Each kernel's name carries its GEMM
(kernels/priced.py) so the step-time table prices it as one. On CPU the kernels run in Pallas's
interpreter; under vmap the batch is more rows (forward, input gradient) or one call per element.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.experimental import pallas as pl

from boost_jax.kernels import platform
from boost_jax.kernels.gate import ACTS, gate_reference
from boost_jax.kernels.priced import gemm_name

try:  # Pallas's Triton backend (deprecated in jax 0.11; kernels/rmsnorm.py says why it is pinned)
    from jax.experimental.pallas import triton as plgpu

    _PARAMS = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    _dot = getattr(plgpu, "dot", None) or pl.dot
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed jax
    plgpu = _PARAMS = _dot = None

_F32 = jnp.float32
TILE_M, TILE_N, TILE_K = 128, 128, 64  # the largest tiles (powers of two); a smaller dim takes its own power


def gated_reference(g: jax.Array, u: jax.Array, w: jax.Array, act: str = "none") -> jax.Array:
    """(act(g)·u) @ w in the inputs' dtype, accumulated in float32 (plain jnp: what autodiff differentiates)."""
    h = gate_reference(g, u, act)
    return jnp.einsum("...f,fr->...r", h, w.astype(h.dtype), preferred_element_type=_F32).astype(h.dtype)


def _tile(dim: int, most: int) -> int:
    return min(most, 1 << (dim.bit_length() - 1))


def _span(i, dim, tile):
    """(start, mask): tile i of a dim, started at most at dim - tile; the mask drops what tile i - 1 covered."""
    start = jnp.minimum(i * tile, dim - tile)
    return start, start + jnp.arange(tile) >= i * tile


def _act(g, act):
    """(act(g), act'(g)) in float32."""
    if act == "silu":
        sig = jax.nn.sigmoid(g)
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    return g, 1.0


def _fwd(g_ref, u_ref, w_ref, s_ref, *, m, f, r, tiles, act):
    """s[tile] = sum over F tiles of (act(g)·u)[rows, k] @ w[k, cols]."""
    bm, bn, bk = tiles
    r0, rmask = _span(pl.program_id(0), m, bm)
    c0, cmask = _span(pl.program_id(1), r, bn)

    def step(i, acc):
        k0, kmask = _span(i, f, bk)
        rows, ks = pl.ds(r0, bm), pl.ds(k0, bk)
        g = plgpu.load(g_ref.at[rows, ks]).astype(_F32)
        u = plgpu.load(u_ref.at[rows, ks]).astype(_F32)
        h = jnp.where(kmask[None, :], _act(g, act)[0] * u, 0.0).astype(w_ref.dtype)
        w = plgpu.load(w_ref.at[ks, pl.ds(c0, bn)])
        return acc + _dot(h, w)

    acc = jax.lax.fori_loop(0, pl.cdiv(f, bk), step, jnp.zeros((bm, bn), _F32))
    plgpu.store(s_ref.at[pl.ds(r0, bm), pl.ds(c0, bn)], acc.astype(s_ref.dtype), mask=rmask[:, None] & cmask[None, :])


def _dx(g_ref, u_ref, w_ref, ds_ref, dg_ref, du_ref, *, m, f, r, tiles, act):
    """dh[tile] = ds[rows] @ w[cols]ᵀ over R; then dg = dh·u·act'(g), du = dh·act(g) on the tile."""
    bm, bn, bk = tiles
    r0, rmask = _span(pl.program_id(0), m, bm)
    c0, cmask = _span(pl.program_id(1), f, bn)
    rows, cols = pl.ds(r0, bm), pl.ds(c0, bn)

    def step(i, acc):
        k0, kmask = _span(i, r, bk)
        ks = pl.ds(k0, bk)
        ds = plgpu.load(ds_ref.at[rows, ks])
        ds = jnp.where(kmask[None, :], ds, jnp.zeros_like(ds))
        return acc + _dot(ds, plgpu.load(w_ref.at[cols, ks]), trans_b=True)

    dh = jax.lax.fori_loop(0, pl.cdiv(r, bk), step, jnp.zeros((bm, bn), _F32))
    g = plgpu.load(g_ref.at[rows, cols]).astype(_F32)
    u = plgpu.load(u_ref.at[rows, cols]).astype(_F32)
    a, da = _act(g, act)
    mask = rmask[:, None] & cmask[None, :]
    plgpu.store(dg_ref.at[rows, cols], (dh * u * da).astype(dg_ref.dtype), mask=mask)
    plgpu.store(du_ref.at[rows, cols], (dh * a).astype(du_ref.dtype), mask=mask)


def _dw(g_ref, u_ref, ds_ref, dw_ref, *, m, f, r, tiles, act):
    """dw[tile] = sum over row tiles of (act(g)·u)[k, rows]ᵀ @ ds[k, cols] (rows of dw: F, columns: R)."""
    bm, bn, bk = tiles
    f0, fmask = _span(pl.program_id(0), f, bm)
    c0, cmask = _span(pl.program_id(1), r, bn)
    fs, cols = pl.ds(f0, bm), pl.ds(c0, bn)

    def step(i, acc):
        k0, kmask = _span(i, m, bk)
        ks = pl.ds(k0, bk)
        g = plgpu.load(g_ref.at[ks, fs]).astype(_F32)
        u = plgpu.load(u_ref.at[ks, fs]).astype(_F32)
        h = jnp.where(kmask[:, None], _act(g, act)[0] * u, 0.0).astype(ds_ref.dtype)
        return acc + _dot(h, plgpu.load(ds_ref.at[ks, cols]), trans_a=True)

    acc = jax.lax.fori_loop(0, pl.cdiv(m, bk), step, jnp.zeros((bm, bn), _F32))
    plgpu.store(dw_ref.at[fs, cols], acc.astype(dw_ref.dtype), mask=fmask[:, None] & cmask[None, :])


def _launch(kernel, base, grid_dims, tiles, gemm, inputs, outs, *, m, f, r, act, interpret):
    """One pallas_call of `kernel` on 2-D inputs; its name carries its GEMM (batch 1, m, n, k)."""
    return pl.pallas_call(
        functools.partial(kernel, m=m, f=f, r=r, tiles=tiles, act=act),
        grid=tuple(pl.cdiv(d, t) for d, t in zip(grid_dims, tiles[:2])),
        out_shape=outs,
        compiler_params=_PARAMS(num_warps=4, num_stages=2),
        interpret=interpret,
        name=gemm_name(base, 1, *gemm),
    )(*inputs)


def _kernels(which, act, interpret):
    """The call `which` (fwd: (g, u, w) -> s; dx: (g, u, w, ds) -> (dg, du); dw: (g, u, ds) -> dw) on
    [M, F] activations, batched under vmap (rows folded where w is shared, else one call per element)."""

    def call2d(*xs):
        g = xs[0]
        (m, f), r = g.shape, xs[-1].shape[-1]
        kw = dict(m=m, f=f, r=r, act=act, interpret=interpret)
        like = lambda *shape: jax.ShapeDtypeStruct(shape, g.dtype)  # noqa: E731
        if which == "fwd":
            tiles = (_tile(m, TILE_M), _tile(r, TILE_N), _tile(f, TILE_K))
            return _launch(_fwd, "gated_gemm_fwd", (m, r), tiles, (m, r, f), xs, like(m, r), **kw)
        if which == "dx":
            tiles = (_tile(m, TILE_M), _tile(f, TILE_N), _tile(r, TILE_K))
            return tuple(_launch(_dx, "gated_gemm_dx", (m, f), tiles, (m, f, r), xs, [like(m, f)] * 2, **kw))
        tiles = (_tile(f, TILE_M), _tile(r, TILE_N), _tile(m, TILE_K))
        return _launch(_dw, "gated_gemm_dw", (f, r), tiles, (f, r, m), xs, like(f, r), **kw)

    weight = 2 if which != "dw" else None  # the position of w (dw's inputs are all activations)
    n_out = 2 if which == "dx" else 1

    @custom_vmap
    def call(*xs):
        lead = xs[0].shape[:-1]
        out = call2d(*(x if i == weight else x.reshape(-1, x.shape[-1]) for i, x in enumerate(xs)))
        if which == "dw":
            return out
        return tuple(o.reshape(*lead, -1) for o in out) if n_out == 2 else out.reshape(*lead, -1)

    @call.def_vmap
    def rule(size, in_batched, *xs):
        rows = weight is not None and not in_batched[weight]  # w shared: the batch is more rows, one call
        xs = [
            x if b or (rows and i == weight) else jnp.broadcast_to(x, (size, *x.shape))
            for i, (x, b) in enumerate(zip(xs, in_batched))
        ]
        out = call(*xs) if rows else jax.lax.map(lambda ys: call(*ys), tuple(xs))
        return out, (True, True) if n_out == 2 else True

    return call


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gated(g, u, w, act, interpret):
    return _kernels("fwd", act, interpret)(g, u, w.astype(g.dtype))


def _vjp_fwd(g, u, w, act, interpret):
    return _gated(g, u, w, act, interpret), (g, u, w)


def _vjp_bwd(act, interpret, res, ds):
    g, u, w = res
    ds = ds.astype(g.dtype)
    dg, du = _kernels("dx", act, interpret)(g, u, w.astype(g.dtype), ds)
    dw = _kernels("dw", act, interpret)(g, u, ds)
    return dg, du, dw.astype(w.dtype)


_gated.defvjp(_vjp_fwd, _vjp_bwd)

MIN_DIM = 16  # Triton's dot takes no block under 16 on a side


def gated_matmul(g: jax.Array, u: jax.Array, w: jax.Array, act: str = "none", *, impl: str = "pallas", interpret=None):
    """(act(g)·u) @ w (g, u: [..., F] of one shape and dtype; w: [F, R], cast to g's dtype). impl="pallas":
    the kernels above (interpreted on CPU unless `interpret` says otherwise); "xla": `gated_reference`,
    which also runs where a side is under 16 or the kernels do not compile here (warned once)."""
    if act not in ACTS:
        raise ValueError(f"unknown gate activation {act!r}; one of {ACTS}")
    if impl == "xla":
        return gated_reference(g, u, w, act)
    if impl != "pallas":
        raise ValueError(f"gated_matmul impl={impl!r}: pallas or xla")
    if g.shape != u.shape or g.dtype != u.dtype or w.ndim != 2 or w.shape[0] != g.shape[-1]:
        raise ValueError(f"gated_matmul: g {g.shape} {g.dtype}, u {u.shape} {u.dtype}, w {w.shape} do not fit")
    rows = g.size // max(g.shape[-1], 1)
    if min(rows, *w.shape) < MIN_DIM or g.size >= 2**31:
        return gated_reference(g, u, w, act)
    if interpret is None:
        interpret = platform.name() == "cpu"
    if _lowers(g.dtype, act, bool(interpret)):
        return gated_reference(g, u, w, act)
    return _gated(g, u, w, act, bool(interpret))


_LOWERS: dict = {}  # (backend, device kind, dtype, act, interpret) -> "" when the kernels compile, else why not


def _lowers(dtype, act, interpret) -> str:
    """Compile the three kernels once per target, dtype and activation on small odd shapes; the reason
    when they cannot (warned once, and the plain-jnp computation runs)."""
    kind = str(getattr(platform.device(), "device_kind", ""))
    key = (platform.name(), kind, jnp.dtype(dtype).name, act, interpret)
    if key not in _LOWERS:
        try:
            if plgpu is None:
                raise ImportError("this jax has no Pallas Triton backend")
            x, w = platform.abstract((40, 48), dtype), platform.abstract((48, 24), dtype)

            def step(g, u, w):
                s, back = jax.vjp(lambda g, u, w: _gated(g, u, w, act, interpret), g, u, w)
                return back(s)

            jax.jit(step).lower(x, x, w).compile()
            _LOWERS[key] = ""
        except Exception as e:  # noqa: BLE001 - any import/lowering/compile failure means "use XLA"
            _LOWERS[key] = f"{type(e).__name__}: {str(e)[:300]}".replace("\n", " ")
            warnings.warn(
                f"boost_jax gated_matmul: the Pallas gate-in-GEMM kernels do not compile here ({_LOWERS[key]}); "
                "the product and its GEMM run on XLA (model.gate_kernel=pallas or xla says so without this warning)",
                stacklevel=3,
            )
    return _LOWERS[key]
