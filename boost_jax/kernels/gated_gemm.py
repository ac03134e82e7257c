"""Elementwise work read into the GEMM that consumes it, one Pallas kernel each way per GEMM.

    s = gated_matmul(g, u, w, act)            # (act(g)·u) @ w: the MLP's gate product in the down GEMM
    ys = act_matmuls(h, ws, act, rope=None)   # act(h[..., i, :]) @ ws[i]: CoLA's σ in each B GEMM

Apart, the product (or σ) is a kernel of its own (read, write) that the GEMM then reads, and the
backward's GEMM writes dh for another kernel to multiply. Here the forward GEMM computes act(g)·u
per tile of its K loop (a prologue), the input gradient's GEMM applies the product rule / act' to its
tile of dh as it stores it (an epilogue), and the weight gradient recomputes the product per tile.
`rope` also rotates q/k by RoPE in their kernels (a head's halves accumulated apart). Float32
accumulation, results in the inputs' dtype; `gated_reference` / `act_reference` are the plain jnp
(impl="xla"). Tiles start at most at dim - block (never out of bounds, as kernels/gate.py's),
masking what the previous tile covered. Each kernel's name carries its GEMM (kernels/priced.py) for
the step-time table. On CPU: Pallas's interpreter; under vmap: more rows, or one call per element.
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

    PARAMS = getattr(plgpu, "CompilerParams", None) or plgpu.TritonCompilerParams
    dot = getattr(plgpu, "dot", None) or pl.dot
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed jax
    plgpu = PARAMS = dot = None

_F32 = jnp.float32
TILE_M, TILE_N, TILE_K = 128, 128, 64  # the largest tiles (powers of two); a smaller dim takes its own power


def gated_reference(g: jax.Array, u: jax.Array, w: jax.Array, act: str = "none") -> jax.Array:
    """(act(g)·u) @ w in the inputs' dtype, accumulated in float32 (plain jnp: what autodiff differentiates)."""
    h = gate_reference(g, u, act)
    return jnp.einsum("...f,fr->...r", h, w.astype(h.dtype), preferred_element_type=_F32).astype(h.dtype)


def tile_size(dim: int, most: int) -> int:
    return min(most, 1 << (dim.bit_length() - 1))


def span(i, dim, tile):
    """(start, mask): tile i of a dim, started at most at dim - tile; the mask drops what tile i - 1 covered."""
    start = jnp.minimum(i * tile, dim - tile)
    return start, start + jnp.arange(tile) >= i * tile


def _act(g, act):
    """(act(g), act'(g)) in float32."""
    if act == "silu":
        sig = jax.nn.sigmoid(g)
        return g * sig, sig * (1.0 + g * (1.0 - sig))
    return g, 1.0


def _fwd(*refs, m, f, r, tiles, act, gated, col0):
    """s[tile] = sum over F tiles of (act(g)·u)[rows, k] @ w[k, cols] (g's columns from col0; no u: act(g))."""
    g_ref, u_ref, w_ref, s_ref = refs if gated else (refs[0], None, *refs[1:])
    bm, bn, bk = tiles
    r0, rmask = span(pl.program_id(0), m, bm)
    c0, cmask = span(pl.program_id(1), r, bn)

    def step(i, acc):
        k0, kmask = span(i, f, bk)
        rows, ks = pl.ds(r0, bm), pl.ds(k0, bk)
        h = _act(plgpu.load(g_ref.at[rows, pl.ds(col0 + k0, bk)]).astype(_F32), act)[0]
        if gated:
            h = h * plgpu.load(u_ref.at[rows, ks]).astype(_F32)
        h = jnp.where(kmask[None, :], h, 0.0).astype(s_ref.dtype)
        return acc + dot(h, plgpu.load(w_ref.at[ks, pl.ds(c0, bn)]).astype(s_ref.dtype))

    acc = jax.lax.fori_loop(0, pl.cdiv(f, bk), step, jnp.zeros((bm, bn), _F32))
    plgpu.store(s_ref.at[pl.ds(r0, bm), pl.ds(c0, bn)], acc.astype(s_ref.dtype), mask=rmask[:, None] & cmask[None, :])


def _at(at):
    """The (row tile, column tile) a program computes: its grid position unless given."""
    return at or (pl.program_id(0), pl.program_id(1))


def _dx(*refs, m, f, r, tiles, act, gated, col0, at=None):
    """dh[tile] = ds[rows] @ w[cols]ᵀ over R; then dg = dh·u·act'(g), du = dh·act(g) on the tile (no u:
    dg = dh·act'(g), stored at g's columns where `at` places the tile in a group's, `_group_dx`)."""
    g_ref, u_ref, w_ref, ds_ref, dg_ref, du_ref = refs if gated else (refs[0], None, *refs[1:], None)
    bm, bn, bk = tiles
    r0, rmask = span(_at(at)[0], m, bm)
    c0, cmask = span(_at(at)[1], f, bn)
    rows, cols = pl.ds(r0, bm), pl.ds(c0, bn)

    def step(i, acc):
        k0, kmask = span(i, r, bk)
        ks = pl.ds(k0, bk)
        ds = plgpu.load(ds_ref.at[rows, ks])
        ds = jnp.where(kmask[None, :], ds, jnp.zeros_like(ds))
        return acc + dot(ds, plgpu.load(w_ref.at[cols, ks]).astype(ds.dtype), trans_b=True)

    dh = jax.lax.fori_loop(0, pl.cdiv(r, bk), step, jnp.zeros((bm, bn), _F32))
    a, da = _act(plgpu.load(g_ref.at[rows, pl.ds(col0 + c0, bn)]).astype(_F32), act)
    mask = rmask[:, None] & cmask[None, :]
    if gated:
        u = plgpu.load(u_ref.at[rows, cols]).astype(_F32)
        plgpu.store(du_ref.at[rows, cols], (dh * a).astype(du_ref.dtype), mask=mask)
        dh = dh * u
    out = pl.ds(col0 + c0, bn) if at else cols
    plgpu.store(dg_ref.at[rows, out], (dh * da).astype(dg_ref.dtype), mask=mask)


def _dw(*refs, m, f, r, tiles, act, gated, col0):
    """dw[tile] = sum over row tiles of (act(g)·u)[k, rows]ᵀ @ ds[k, cols] (rows of dw: F, columns: R)."""
    g_ref, u_ref, ds_ref, dw_ref = refs if gated else (refs[0], None, *refs[1:])
    bm, bn, bk = tiles
    f0, fmask = span(pl.program_id(0), f, bm)
    c0, cmask = span(pl.program_id(1), r, bn)
    fs, cols = pl.ds(f0, bm), pl.ds(c0, bn)

    def step(i, acc):
        k0, kmask = span(i, m, bk)
        ks = pl.ds(k0, bk)
        h = _act(plgpu.load(g_ref.at[ks, pl.ds(col0 + f0, bm)]).astype(_F32), act)[0]
        if gated:
            h = h * plgpu.load(u_ref.at[ks, fs]).astype(_F32)
        h = jnp.where(kmask[:, None], h, 0.0).astype(ds_ref.dtype)
        return acc + dot(h, plgpu.load(ds_ref.at[ks, cols]), trans_a=True)

    acc = jax.lax.fori_loop(0, pl.cdiv(m, bk), step, jnp.zeros((bm, bn), _F32))
    plgpu.store(dw_ref.at[fs, cols], acc.astype(dw_ref.dtype), mask=fmask[:, None] & cmask[None, :])


def _cos_sin(cs_ref, rows, half):
    """RoPE's cos and sin [rows, half] (float32) from the [M, 2·half] table (cos | sin) XLA computed."""
    return plgpu.load(cs_ref.at[rows, pl.ds(0, half)]), plgpu.load(cs_ref.at[rows, pl.ds(half, half)])


def _rope_fwd(g_ref, w_ref, cs_ref, s_ref, *, m, f, r, tiles, act, col0, **_):
    """One head's output columns (program 1: the head), its halves x1, x2 accumulated apart over the
    K loop, stored rotated: x1·cos - x2·sin, x2·cos + x1·sin (RoPE's rotate-half)."""
    bm, half, bk = tiles
    r0, rmask = span(pl.program_id(0), m, bm)
    c1 = pl.program_id(1) * 2 * half
    rows = pl.ds(r0, bm)

    def step(i, acc):
        k0, kmask = span(i, f, bk)
        ks = pl.ds(k0, bk)
        h = _act(plgpu.load(g_ref.at[rows, pl.ds(col0 + k0, bk)]).astype(_F32), act)[0]
        h = jnp.where(kmask[None, :], h, 0.0).astype(s_ref.dtype)
        w1 = plgpu.load(w_ref.at[ks, pl.ds(c1, half)]).astype(s_ref.dtype)
        w2 = plgpu.load(w_ref.at[ks, pl.ds(c1 + half, half)]).astype(s_ref.dtype)
        return acc[0] + dot(h, w1), acc[1] + dot(h, w2)

    zero = jnp.zeros((bm, half), _F32)
    x1, x2 = jax.lax.fori_loop(0, pl.cdiv(f, bk), step, (zero, zero))
    cos, sin = _cos_sin(cs_ref, rows, half)
    mask = rmask[:, None] & (jnp.arange(half) >= 0)[None, :]
    plgpu.store(s_ref.at[rows, pl.ds(c1, half)], (x1 * cos - x2 * sin).astype(s_ref.dtype), mask=mask)
    plgpu.store(s_ref.at[rows, pl.ds(c1 + half, half)], (x2 * cos + x1 * sin).astype(s_ref.dtype), mask=mask)


def _unrotated(ds_ref, rows, c1, half, cos, sin):
    """The gradient before RoPE of one head's columns: (dy1·cos + dy2·sin, dy2·cos - dy1·sin)."""
    dy1 = plgpu.load(ds_ref.at[rows, pl.ds(c1, half)]).astype(_F32)
    dy2 = plgpu.load(ds_ref.at[rows, pl.ds(c1 + half, half)]).astype(_F32)
    return dy1 * cos + dy2 * sin, dy2 * cos - dy1 * sin


def _rope_dx(g_ref, w_ref, ds_ref, cs_ref, dg_ref, *, m, f, r, tiles, act, col0, at=None, **_):
    """dh[tile] = (the unrotated ds)[rows] @ w[cols]ᵀ, a head (both halves) per K step; dg = dh·act'(g)
    (stored as `_dx` stores it)."""
    bm, bn, half = tiles
    r0, rmask = span(_at(at)[0], m, bm)
    c0, cmask = span(_at(at)[1], f, bn)
    rows, cols = pl.ds(r0, bm), pl.ds(c0, bn)
    cos, sin = _cos_sin(cs_ref, rows, half)

    def step(j, acc):
        d1, d2 = _unrotated(ds_ref, rows, j * 2 * half, half, cos, sin)
        w1 = plgpu.load(w_ref.at[cols, pl.ds(j * 2 * half, half)]).astype(dg_ref.dtype)
        w2 = plgpu.load(w_ref.at[cols, pl.ds(j * 2 * half + half, half)]).astype(dg_ref.dtype)
        acc = acc + dot(d1.astype(dg_ref.dtype), w1, trans_b=True)
        return acc + dot(d2.astype(dg_ref.dtype), w2, trans_b=True)

    dh = jax.lax.fori_loop(0, r // (2 * half), step, jnp.zeros((bm, bn), _F32))
    da = _act(plgpu.load(g_ref.at[rows, pl.ds(col0 + c0, bn)]).astype(_F32), act)[1]
    out = pl.ds(col0 + c0, bn) if at else cols
    plgpu.store(dg_ref.at[rows, out], (dh * da).astype(dg_ref.dtype), mask=rmask[:, None] & cmask[None, :])


def _rope_dw(g_ref, ds_ref, cs_ref, dw_ref, *, m, f, r, tiles, act, col0, **_):
    """dw[:, one head's columns] = sum over row tiles of act(g)[k, rows]ᵀ @ (the unrotated ds)[k, head]."""
    bm, half, bk = tiles
    f0, fmask = span(pl.program_id(0), f, bm)
    c1 = pl.program_id(1) * 2 * half

    def step(i, acc):
        k0, kmask = span(i, m, bk)
        ks = pl.ds(k0, bk)
        a = _act(plgpu.load(g_ref.at[ks, pl.ds(col0 + f0, bm)]).astype(_F32), act)[0]
        a = jnp.where(kmask[:, None], a, 0.0).astype(ds_ref.dtype)
        cos, sin = _cos_sin(cs_ref, ks, half)
        d1, d2 = _unrotated(ds_ref, ks, c1, half, cos, sin)
        d1, d2 = d1.astype(ds_ref.dtype), d2.astype(ds_ref.dtype)
        return acc[0] + dot(a, d1, trans_a=True), acc[1] + dot(a, d2, trans_a=True)

    zero = jnp.zeros((bm, half), _F32)
    acc1, acc2 = jax.lax.fori_loop(0, pl.cdiv(m, bk), step, (zero, zero))
    mask = fmask[:, None] & (jnp.arange(half) >= 0)[None, :]
    plgpu.store(dw_ref.at[pl.ds(f0, bm), pl.ds(c1, half)], acc1.astype(dw_ref.dtype), mask=mask)
    plgpu.store(dw_ref.at[pl.ds(f0, bm), pl.ds(c1 + half, half)], acc2.astype(dw_ref.dtype), mask=mask)


def _rope_call(which, xs, kw, like, base, out):
    """The RoPE variant of `which` (see `_kernels`): a head (both halves) per output column tile, or per
    K step of the input gradient."""
    m, f, r = kw["m"], kw["f"], kw["r"]
    half = xs[-1].shape[-1] // 2
    if which == "fwd":
        tiles = (tile_size(m, TILE_M), half, tile_size(f, TILE_K))
        return _launch(_rope_fwd, f"{base}_fwd", (m, r // 2), tiles, (m, r, f), xs, like(m, r), **kw)
    if which == "dx":
        tiles = (tile_size(m, TILE_M), tile_size(f, TILE_N), half)
        return tuple(_launch(_rope_dx, f"{base}_dx", (m, f), tiles, (m, f, r), xs, [like(m, f)], **kw))
    tiles = (tile_size(f, TILE_M), half, tile_size(m, TILE_K))
    dw = jax.ShapeDtypeStruct((f, r), out or xs[0].dtype)
    return _launch(_rope_dw, f"{base}_dw", (f, r // 2), tiles, (f, r, m), xs, dw, **kw)


SMS = 132  # an H100's multiprocessors: a weight gradient's grid of fewer tiles leaves some idle


def spread(bm, bn, f, r):
    """Output tiles of a weight gradient ([F, R]: few tiles, a long K loop over the rows) halved, the
    larger first and not under 64, until the grid fills the GPU's multiprocessors."""
    while -(-f // bm) * -(-r // bn) < SMS and max(bm, bn) > 64:
        bm, bn = (bm // 2, bn) if bm >= bn else (bm, bn // 2)
    return bm, bn


def _launch(kernel, base, grid_dims, tiles, gemm, inputs, outs, *, interpret, **kw):
    """One pallas_call of `kernel` on 2-D inputs; its name carries its GEMM (batch 1, m, n, k)."""
    return pl.pallas_call(
        functools.partial(kernel, tiles=tiles, **kw),
        grid=tuple(pl.cdiv(d, t) for d, t in zip(grid_dims, tiles[:2])),
        out_shape=outs,
        compiler_params=PARAMS(num_warps=4, num_stages=2),
        interpret=interpret,
        name=gemm_name(base, 1, *gemm),
    )(*inputs)


def _kernels(which, act, interpret, gated=True, col0=0, width=None, out=None, rope=False):
    """The call `which` on [M, F] activations (fwd: (g, u, w) -> s; dx: (g, u, w, ds) -> (dg, du); dw:
    (g, u, ds) -> dw in dtype `out`; without u where not `gated`, dx then -> dg). g's columns col0 ..
    col0 + width are read (width: F, default g's); w in any float dtype (cast per tile). Batched under
    vmap: rows folded where w is shared, else one call per element. `rope` (not `gated`): a last input,
    RoPE's [M, head_dim] table (cos | sin), rotates each head of the output (`_rope_*`)."""
    base = "gated_gemm" if gated else f"{act}_rope_gemm" if rope else f"{act}_gemm"

    def call2d(*xs):
        g = xs[0]
        m, f, r = g.shape[0], width or g.shape[1], xs[-2 if rope else -1].shape[-1]
        kw = dict(m=m, f=f, r=r, act=act, interpret=interpret, gated=gated, col0=col0)
        like = lambda *shape: jax.ShapeDtypeStruct(shape, g.dtype)  # noqa: E731
        if rope:
            return _rope_call(which, xs, kw, like, base, out)
        if which == "fwd":
            tiles = (tile_size(m, TILE_M), tile_size(r, TILE_N), tile_size(f, TILE_K))
            return _launch(_fwd, f"{base}_fwd", (m, r), tiles, (m, r, f), xs, like(m, r), **kw)
        if which == "dx":
            outs = [like(m, f)] * (2 if gated else 1)
            tiles = (tile_size(m, TILE_M), tile_size(f, TILE_N), tile_size(r, TILE_K))
            return tuple(_launch(_dx, f"{base}_dx", (m, f), tiles, (m, f, r), xs, outs, **kw))
        tiles = (*spread(tile_size(f, TILE_M), tile_size(r, TILE_N), f, r), tile_size(m, TILE_K))
        dw = jax.ShapeDtypeStruct((f, r), out or g.dtype)
        return _launch(_dw, f"{base}_dw", (f, r), tiles, (f, r, m), xs, dw, **kw)

    weight = (2 if gated else 1) if which != "dw" else None  # the position of w (dw's inputs: activations)
    return batched(call2d, () if weight is None else (weight,), {"fwd": "rows", "dx": "tuple"}.get(which, "whole"))


def batched(call2d, weights, out):
    """call2d on 2-D inputs, the weights (at positions `weights`) as they are and the others' leading
    dims folded into rows; the output: "rows" one [M, n] laid back to those dims, "tuple" several, "whole"
    as it comes (a weight gradient). Under vmap: more rows where no weight is batched (one call), else
    one call per element."""

    @custom_vmap
    def call(*xs):
        lead = xs[0].shape[:-1]
        got = call2d(*(x if i in weights else x.reshape(-1, x.shape[-1]) for i, x in enumerate(xs)))
        if out == "whole":
            return got
        return tuple(o.reshape(*lead, -1) for o in got) if out == "tuple" else got.reshape(*lead, -1)

    @call.def_vmap
    def rule(size, in_batched, *xs):
        rows = bool(weights) and not any(in_batched[i] for i in weights)  # w shared: one call, more rows
        xs = [
            x if b or (rows and i in weights) else jnp.broadcast_to(x, (size, *x.shape))
            for i, (x, b) in enumerate(zip(xs, in_batched))
        ]
        got = call(*xs) if rows else jax.lax.map(lambda ys: call(*ys), tuple(xs))
        return got, (True,) * len(got) if out == "tuple" else True

    return call


def _group_dx(*refs, m, f, widths, roped, half, tiles, act):
    """A group's input gradient in one kernel (refs: h [M, G·f], then each member's w and dy, RoPE's
    table where a member is rotated, dh [M, G·f]): program (i, j) computes column tile j of dh, in
    member j // (f's tiles): `_dx`, or `_rope_dx` where that member is rotated, on its w and dy,
    stored at its columns. No stack of G outputs after."""
    g_ref, dg_ref, cs = refs[0], refs[-1], refs[1 + 2 * len(widths) : -1]
    per, row, col = pl.cdiv(f, tiles[1]), pl.program_id(0), pl.program_id(1)  # (read outside the branches)
    for i, (d, rot) in enumerate(zip(widths, roped)):
        w_ref, ds_ref = refs[1 + 2 * i], refs[2 + 2 * i]
        kw = dict(m=m, f=f, r=d, act=act, col0=i * f)

        @pl.when(col // per == i)
        def _(w_ref=w_ref, ds_ref=ds_ref, d=d, rot=rot, kw=kw, i=i):
            at = (row, col - i * per)
            if rot:
                _rope_dx(g_ref, w_ref, ds_ref, cs[0], dg_ref, tiles=(*tiles, half), at=at, **kw)
            else:
                _dx(g_ref, w_ref, ds_ref, dg_ref, tiles=(*tiles, tile_size(d, TILE_K)), gated=False, at=at, **kw)


def _group_dx_call(act, interpret, roped):
    """(h [..., G·f], w_0, dy_0, w_1, dy_1, ..., [table]) -> dh [..., G·f]: `_group_dx`, named for its
    FLOPs as one GEMM (m, G·f, K) where the members' K agree, else (m, f, the sum of their K)."""
    n = len(roped)

    def call2d(g, *rest):
        m, f = g.shape[0], g.shape[1] // n
        widths = tuple(w.shape[1] for w in rest[0 : 2 * n : 2])
        half = rest[-1].shape[-1] // 2 if any(roped) else 0
        tiles = (tile_size(m, TILE_M), tile_size(f, TILE_N))
        gemm = (m, n * f, widths[0]) if len(set(widths)) == 1 else (m, f, sum(widths))
        base = f"{act}{'_rope' if any(roped) else ''}_group_gemm_dx"
        kernel = functools.partial(_group_dx, m=m, f=f, widths=widths, roped=roped, half=half, tiles=tiles, act=act)
        return pl.pallas_call(
            kernel,
            grid=(pl.cdiv(m, tiles[0]), n * pl.cdiv(f, tiles[1])),
            out_shape=jax.ShapeDtypeStruct(g.shape, g.dtype),
            compiler_params=PARAMS(num_warps=4, num_stages=2),
            interpret=interpret,
            name=gemm_name(base, 1, *gemm),
        )(g, *rest)

    return batched(call2d, tuple(range(1, 2 * n, 2)), "rows")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gated(g, u, w, act, interpret):
    return _kernels("fwd", act, interpret)(g, u, w)


def _vjp_fwd(g, u, w, act, interpret):
    return _gated(g, u, w, act, interpret), (g, u, w)


def _vjp_bwd(act, interpret, res, ds):
    g, u, w = res
    ds = ds.astype(g.dtype)
    dg, du = _kernels("dx", act, interpret)(g, u, w, ds)
    dw = _kernels("dw", act, interpret, out=w.dtype)(g, u, ds)
    return dg, du, dw


_gated.defvjp(_vjp_fwd, _vjp_bwd)

MIN_DIM = 16  # Triton's dot takes no block under 16 on a side


def gated_matmul(g: jax.Array, u: jax.Array, w: jax.Array, act: str = "none", *, impl: str = "pallas", interpret=None):
    """(act(g)·u) @ w (g, u: [..., F] of one shape and dtype; w: [F, R], read in its dtype and cast per
    tile to g's; its gradient in w's dtype, accumulated in float32). impl="pallas":
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


def rope_table(positions: jax.Array, theta: float, head_dim: int) -> jax.Array:
    """RoPE's [..., head_dim] float32 table (cos | sin of positions x theta^(-i/half)), as
    model/attention/rotary.py computes them."""
    half = head_dim // 2
    freqs = theta ** (-jnp.arange(half, dtype=_F32) / half)
    angles = positions.astype(_F32)[..., None] * freqs
    return jnp.concatenate([jnp.cos(angles), jnp.sin(angles)], axis=-1)


def rotate(y: jax.Array, cs: jax.Array) -> jax.Array:
    """Rotate-half RoPE of y [..., heads·D] by the table cs [..., D] (float32 math, y's dtype)."""
    half = cs.shape[-1] // 2
    x = y.reshape(*y.shape[:-1], -1, 2 * half).astype(_F32)
    cos, sin = cs[..., None, :half], cs[..., None, half:]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(y.shape).astype(y.dtype)


def act_reference(h: jax.Array, ws, act: str = "silu", rope=None) -> tuple:
    """(act(h[..., i, :]) @ ws[i] for each i) in h's dtype, accumulated in float32, member i rotated by
    RoPE where rope = (table, flags) flags it (plain jnp)."""
    a = gate_reference(h, jnp.ones((), h.dtype), act)
    ys = [
        jnp.einsum("...r,rd->...d", a[..., i, :], w.astype(h.dtype), preferred_element_type=_F32).astype(h.dtype)
        for i, w in enumerate(ws)
    ]
    return tuple(rotate(y, rope[0]) if rope and rope[1][i] else y for i, y in enumerate(ys))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _act_stages(h, ws, cs, act, interpret, roped):
    flat, r = h.reshape(*h.shape[:-2], -1), h.shape[-1]
    return tuple(
        _kernels("fwd", act, interpret, gated=False, col0=i * r, width=r, rope=roped[i])(
            flat, w, *((cs,) if roped[i] else ())
        )
        for i, w in enumerate(ws)
    )


def _act_fwd(h, ws, cs, act, interpret, roped):
    return _act_stages(h, ws, cs, act, interpret, roped), (h, ws, cs)


def _act_bwd(act, interpret, roped, res, dys):
    h, ws, cs = res
    flat, r = h.reshape(*h.shape[:-2], -1), h.shape[-1]
    dys = tuple(dy.astype(h.dtype) for dy in dys)
    dh, dws = [], []
    for i, (w, dy) in enumerate(zip(ws, dys)):
        kw = dict(gated=False, col0=i * r, width=r, rope=roped[i])
        table = (cs,) if roped[i] else ()
        if len(ws) == 1:
            dh.append(_kernels("dx", act, interpret, **kw)(flat, w, dy, *table)[0])
        dws.append(_kernels("dw", act, interpret, out=w.dtype, **kw)(flat, dy, *table))
    if len(ws) > 1:  # one kernel writes every member's columns
        pairs = [x for w, dy in zip(ws, dys) for x in (w, dy)]
        dh = [_group_dx_call(act, interpret, roped)(flat, *pairs, *((cs,) if any(roped) else ()))]
    return dh[0].reshape(h.shape), tuple(dws), None if cs is None else jnp.zeros_like(cs)


_act_stages.defvjp(_act_fwd, _act_bwd)


def act_matmuls(h: jax.Array, ws, act: str = "silu", *, rope=None, impl: str = "pallas", interpret=None) -> tuple:
    """act(h[..., i, :]) @ ws[i] for each i (h: [..., G, r], the G first-stage outputs of a group before σ;
    ws: G second-stage weights [r, d_i], read in their dtype and cast per tile to h's): each one kernel
    each way with σ read into the GEMM (a prologue forward, σ' an epilogue of the input gradient's
    GEMM). rope = (table, flags): member i's output rotated by RoPE (`rope_table`: [..., head_dim]) in
    its kernel where flags[i] (each head's halves accumulated apart; the backward unrotates dy as it
    reads it), where a half head is a power of two of at least 16 (else by XLA after). impl="xla", a
    side under 16, or kernels that do not compile here: `act_reference`."""
    ws = tuple(ws)
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r}; one of {ACTS}")
    if impl not in ("pallas", "xla"):
        raise ValueError(f"act_matmuls impl={impl!r}: pallas or xla")
    if len(ws) != h.shape[-2] or any(w.ndim != 2 or w.shape[0] != h.shape[-1] for w in ws):
        raise ValueError(f"act_matmuls: h {h.shape} and weights {[w.shape for w in ws]} do not fit")
    rows = h.size // max(h.shape[-1] * h.shape[-2], 1)
    small = min(rows, h.shape[-1], *(w.shape[1] for w in ws)) < MIN_DIM or h.size >= 2**31
    if interpret is None:
        interpret = platform.name() == "cpu"
    if impl == "xla" or small or _lowers(h.dtype, act, bool(interpret)):
        return act_reference(h, ws, act, rope)
    cs, flags = rope if rope else (None, (False,) * len(ws))
    half = cs.shape[-1] // 2 if cs is not None else 0
    fits = half >= MIN_DIM and half & (half - 1) == 0
    roped = tuple(bool(f) and fits and w.shape[1] % (2 * half) == 0 for f, w in zip(flags, ws))
    ys = _act_stages(h, ws, cs if any(roped) else None, act, bool(interpret), roped)
    return tuple(rotate(y, cs) if f and not k else y for y, f, k in zip(ys, flags, roped))


_LOWERS: dict = {}  # (backend, device kind, dtype, act, interpret) -> "" when the kernels compile, else why not


def _lowers(dtype, act, interpret) -> str:
    """Compile every kernel once per target, dtype and activation on small odd shapes (the gated three,
    σ's three, with and without RoPE); the reason when they cannot (warned once, and the plain-jnp computations run)."""
    kind = str(getattr(platform.device(), "device_kind", ""))
    key = (platform.name(), kind, jnp.dtype(dtype).name, act, interpret)

    def compile_probe():
        if plgpu is None:
            raise ImportError("this jax has no Pallas Triton backend")
        x, w = platform.abstract((40, 48), dtype), platform.abstract((48, 24), dtype)
        h, v = platform.abstract((40, 2, 24), dtype), platform.abstract((24, 32), dtype)
        cs = platform.abstract((40, 32), _F32)  # one 32-wide head of RoPE in the first member

        def step(g, u, w, h, v, cs):
            s, back = jax.vjp(lambda g, u, w: _gated(g, u, w, act, interpret), g, u, w)
            ys, back2 = jax.vjp(lambda h, ws: _act_stages(h, ws, cs, act, interpret, (True, False)), h, (v, v))
            return back(s), back2(ys)

        jax.jit(step).lower(x, x, w, h, v, cs).compile()

    def warn(reason):
        warnings.warn(
            f"boost_jax gated_matmul: the Pallas gate-in-GEMM kernels do not compile here ({reason}); "
            "the product and its GEMM run on XLA (model.gate_kernel=pallas or xla says so without this warning)",
            stacklevel=5,
        )

    return platform.probe_once(_LOWERS, key, compile_probe, warn)
