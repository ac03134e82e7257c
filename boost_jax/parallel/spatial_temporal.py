"""PrimePar's spatial-temporal partition P(n x n): a linear layer O = I @ W on an n x n device grid
(two mesh axes of equal size) that communicates only point-to-point (Cannon's algorithm), with a
matching backward.

`st_matmul` runs it on operands in the skewed layouts (its docstring: the grid, the layouts and the
forward, dI and dW schedules); `skew_input` / `skew_weight` and their inverses convert global
arrays, `skew_sharded` / `unskew_sharded` / `skew_weight_sharded` convert already-sharded ones with
one collective-permute; `project_sharded` runs a model projection this way (the placement's
`SpatialTemporal`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from boost_jax.parallel.rules import spec_for

AxisNames = str | tuple[str, ...] | None


# ---------------------------------------------------------------- global block permutations


def _permute_blocks(x: jax.Array, n: int, src_row, src_col) -> jax.Array:
    """out<r, c> = x<src_row(r, c), src_col(r, c)> over the last two dims cut into n x n blocks."""
    *lead, m, k = x.shape
    if m % n or k % n:
        raise ValueError(f"last two dims {(m, k)} must be divisible by n={n}")
    b = jnp.reshape(x, (*lead, n, m // n, n, k // n))
    b = jnp.moveaxis(b, (-4, -2), (0, 1))  # [n, n, *lead, mb, kb]
    r = jnp.arange(n)[:, None]
    c = jnp.arange(n)[None, :]
    b = b[src_row(r, c) % n, src_col(r, c) % n]
    return jnp.reshape(jnp.moveaxis(b, (0, 1), (-4, -2)), x.shape)


def skew_input(x: jax.Array, n: int) -> jax.Array:
    """Plain I[..., M, N] -> skewed: block (r, c) becomes I<r, r + c>."""
    return _permute_blocks(x, n, lambda r, c: r + 0 * c, lambda r, c: r + c)


def unskew_input(xs: jax.Array, n: int) -> jax.Array:
    """Inverse of skew_input: I<r, j> = Is<r, j - r>."""
    return _permute_blocks(xs, n, lambda r, j: r + 0 * j, lambda r, j: j - r)


def skew_weight(w: jax.Array, n: int) -> jax.Array:
    """Plain W[N, K] -> skewed: block (r, c) becomes W<r + c, c>."""
    return _permute_blocks(w, n, lambda r, c: r + c, lambda r, c: c + 0 * r)


def unskew_weight(ws: jax.Array, n: int) -> jax.Array:
    """Inverse of skew_weight: W<j, c> = Ws<j - c, c>."""
    return _permute_blocks(ws, n, lambda j, c: j - c, lambda j, c: c + 0 * j)


# ---------------------------------------------------------------- shard_map plumbing


def _grid(mesh: Mesh, row_axis: str, col_axis: str) -> int:
    n = mesh.shape[row_axis]
    if mesh.shape[col_axis] != n:
        raise ValueError(f"grid must be square: {row_axis}={n}, {col_axis}={mesh.shape[col_axis]}")
    return n


def _x_spec(ndim: int, row_axis: str, col_axis: str, batch_axes: AxisNames, row_dim: int = -2) -> P:
    if row_dim == 0:  # rows split the first (batch) dim, inside the batch axes
        if ndim < 2:
            raise ValueError(f"activation needs >= 2 dims, got {ndim}")
        batch = () if batch_axes is None else (batch_axes,) if isinstance(batch_axes, str) else batch_axes
        return P((*batch, row_axis) if batch else row_axis, *[None] * (ndim - 2), col_axis)
    if row_dim != -2:
        raise ValueError(f"row_dim must be -2 (the M dim) or 0 (the batch dim), got {row_dim}")
    if ndim < 2 or (batch_axes is not None and ndim < 3):
        raise ValueError(f"activation needs >= {2 if batch_axes is None else 3} dims, got {ndim}")
    lead = [batch_axes] + [None] * (ndim - 3) if ndim >= 3 else []
    return P(*lead, row_axis, col_axis)


def _shift(x: jax.Array, axes: tuple[str, str], n: int, dr: int, dc: int) -> jax.Array:
    """Device (r, c) receives x from (r + dr, c + dc) on the grid (one collective-permute)."""
    if len(set(axes)) != 2:
        raise ValueError(axes)
    if dr == 0:  # single-axis rings keep the replica groups small
        return jax.lax.ppermute(x, axes[1], [((c + dc) % n, c) for c in range(n)])
    if dc == 0:
        return jax.lax.ppermute(x, axes[0], [((r + dr) % n, r) for r in range(n)])
    # Over the axis tuple, device (r, c) has linear index r * n + c.
    return jax.lax.ppermute(
        x, axes, [(((r + dr) % n) * n + (c + dc) % n, r * n + c) for r in range(n) for c in range(n)]
    )


def _acc_dtype(*xs: jax.Array):
    # Sum the n partial products in at least f32 (bf16 partial sums would lose bits each step).
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def _fwd_local(i, w, *, axes, n):
    acc_t = _acc_dtype(i, w)
    acc = jnp.einsum("...mn,nk->...mk", i, w, preferred_element_type=acc_t)
    for _ in range(n - 1):
        i, w = _shift(i, axes, n, 0, 1), _shift(w, axes, n, 1, 0)
        acc = acc + jnp.einsum("...mn,nk->...mk", i, w, preferred_element_type=acc_t)
    return acc.astype(jnp.result_type(i, w))


def _bwd_local(i, w, do, *, axes, n, batch_axes):
    # dI<r, r+c> = sum_k dO<r, k> W<r+c, k>^T
    acc_t = _acc_dtype(do, w)
    g, wk = do, w
    di = jnp.einsum("...mk,nk->...mn", g, wk, preferred_element_type=acc_t)
    for _ in range(n - 1):
        g, wk = _shift(g, axes, n, 0, 1), _shift(wk, axes, n, -1, 1)
        di = di + jnp.einsum("...mk,nk->...mn", g, wk, preferred_element_type=acc_t)
    # dW<r+c, c> = sum_i I<i, r+c>^T dO<i, c>
    lead = "".join(chr(ord("a") + j) for j in range(i.ndim - 2))
    spec = f"{lead}mn,{lead}mk->nk"
    g, ii = do, i
    dw = jnp.einsum(spec, ii, g, preferred_element_type=acc_t)
    for _ in range(n - 1):
        g, ii = _shift(g, axes, n, 1, 0), _shift(ii, axes, n, 1, -1)
        dw = dw + jnp.einsum(spec, ii, g, preferred_element_type=acc_t)
    if batch_axes is not None:  # data parallelism: each batch shard holds a partial dW
        dw = jax.lax.psum(dw, batch_axes)
    return di.astype(i.dtype), dw.astype(w.dtype)


@functools.cache
def _build(mesh: Mesh, row_axis: str, col_axis: str, batch_axes: AxisNames, ndim: int, row_dim: int):
    n = _grid(mesh, row_axis, col_axis)
    axes = (row_axis, col_axis)
    x_spec, w_spec = _x_spec(ndim, row_axis, col_axis, batch_axes, row_dim), P(row_axis, col_axis)
    fwd_sm = jax.shard_map(
        functools.partial(_fwd_local, axes=axes, n=n), mesh=mesh, in_specs=(x_spec, w_spec), out_specs=x_spec
    )
    bwd_sm = jax.shard_map(
        functools.partial(_bwd_local, axes=axes, n=n, batch_axes=batch_axes),
        mesh=mesh,
        in_specs=(x_spec, w_spec, x_spec),
        out_specs=(x_spec, w_spec),
    )

    @jax.custom_vjp
    def f(i, w):
        return fwd_sm(i, w)

    def f_fwd(i, w):
        # Residuals: the layer's own input block and the (resident) weight; no rotated copies.
        return fwd_sm(i, w), (i, w)

    def f_bwd(res, do):
        i, w = res
        return bwd_sm(i, w, do)

    f.defvjp(f_fwd, f_bwd)
    return f


def _norm_batch(batch_axes: str | Sequence[str] | None) -> AxisNames:
    if batch_axes is None or isinstance(batch_axes, str):
        return batch_axes
    return tuple(batch_axes) or None


def st_matmul(
    i_skewed: jax.Array,
    w_skewed: jax.Array,
    *,
    mesh: Mesh,
    row_axis: str,
    col_axis: str,
    batch_axes: str | Sequence[str] | None = None,
    row_dim: int = -2,
) -> jax.Array:
    """O = I @ W on the (row_axis x col_axis) grid; I and W in skewed layout, O in plain layout.

    Differentiable: dI comes back in the skewed-I layout and dW in the skewed-W layout.
    i_skewed: [..., M, N] (first dim split over batch_axes if given; with row_dim=0 the row axis
    splits the first dim too, see below); w_skewed: [N, K].

    Grid and blocks
    ---------------
    Two mesh axes of equal size n form the grid: device (r, c) has index r on ``row_axis`` and c on
    ``col_axis``. M, N and K are each cut into n equal contiguous blocks; X<a, b> denotes block a of
    the second-to-last dim and block b of the last dim of X (all leading/batch dims kept whole).
    Indices are mod n throughout.

    Layouts (all are *global* arrays sharded with the plain block spec
    ``P(*batch, row_axis, col_axis)`` over their last two dims, so the block at position (r, c) of the
    array is what device (r, c) holds):

    * plain     X<r, c> on (r, c): the ordinary layout.        Used for O and dO.
    * skewed I  Is<r, c> = I<r, r + c>: row r's N-blocks rotated left by r.  Used for I and dI.
    * skewed W  Ws<r, c> = W<r + c, c>: column c's N-blocks rotated up by c. Used for W and dW.

    ``skew_input``/``unskew_input`` and ``skew_weight``/``unskew_weight`` convert between the plain
    and skewed global arrays (pure block permutations, usable on host or unsharded arrays).
    ``skew_sharded``/``unskew_sharded`` do the I <-> skewed-I conversion of an already block-sharded
    activation with a single collective-permute (e.g. to feed O of one st_matmul into the next).

    Schedules (step t = 0 .. n-1; "from (a, b)" = what is received before the next step)
    -----------------------------------------------------------------------------------
    * forward   O<r, c> stays.  Holds I<r, s>, W<s, c> with s = r + c + t.
                I from (r, c+1) (row ring), W from (r+1, c) (column ring).
    * dI        dI<r, r+c> stays (= skewed-I layout).  Holds dO<r, k>, W<r+c, k> with k = c + t.
                dO from (r, c+1) (row ring), W from (r-1, c+1) (anti-diagonal ring).
    * dW        dW<r+c, c> stays (= skewed-W layout).  Holds I<i, r+c>, dO<i, c> with i = r + t.
                dO from (r+1, c) (column ring), I from (r+1, c-1) (anti-diagonal ring).

    Every step's send depends only on the previous step's inputs, never on its result, so XLA may
    overlap it with the matmul. Only the forward's own I block and the weight (already resident) are
    saved for the backward. Deviations from the paper's wording, both because JAX arrays are
    immutable: the dI phase does n-1 hops and drops its rotated W copy instead of hopping it back to
    the forward layout (the original W is still there), and the dW phase starts from the *original*
    stashed I block (not the forward's last rotated copy), which makes dW land directly in the
    skewed-W layout, so the paper's final one-hop redistribution of dW is not needed.

    Batch dims: the first leading dim of I may also be split over ``batch_axes`` (plain data
    parallelism); then dW is summed over those axes with a psum (the only non-permute collective, and
    absent when batch_axes is None).

    Rows on the batch dim (``row_dim=0``): the M blocks need not be blocks of the second-to-last dim.
    With ``row_dim=0`` the row axis splits the FIRST dim of I (after ``batch_axes``, as the spec
    ``P((*batch_axes, row_axis), ..., col_axis)`` orders them): M is then every token of the batch
    and device (r, c)'s M-block is its share of whole sequences, which is how a trainer that splits the
    batch over (data, fsdp) already holds its activations, so entering the grid costs nothing but the
    skew.

    Weights in another layout: ``skew_weight_sharded`` turns a weight stored block-sharded in any of
    the layouts a rule table gives it over the two grid axes (either dim on either axis, or replicated)
    into the skewed-W layout with at most one collective-permute (plus local slices of replicated
    dims); its transpose brings dW back the same way.
    """
    if w_skewed.ndim != 2:
        raise ValueError(f"weight must be 2-D [N, K], got shape {w_skewed.shape}")
    f = _build(mesh, row_axis, col_axis, _norm_batch(batch_axes), i_skewed.ndim, row_dim)
    return f(i_skewed, w_skewed)


@functools.cache
def _build_skew(mesh: Mesh, row_axis: str, col_axis: str, batch_axes: AxisNames, ndim: int, sign: int, row_dim: int):
    n = _grid(mesh, row_axis, col_axis)
    spec = _x_spec(ndim, row_axis, col_axis, batch_axes, row_dim)

    def local(x):
        # skew: (r, c) needs block (r, r + c), held by device (r, r + c); unskew is the inverse.
        perm = [(r * n + (c + sign * r) % n, r * n + c) for r in range(n) for c in range(n)]
        return jax.lax.ppermute(x, (row_axis, col_axis), perm) if n > 1 else x

    return jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec)


def skew_sharded(
    x: jax.Array,
    *,
    mesh: Mesh,
    row_axis: str,
    col_axis: str,
    batch_axes: str | Sequence[str] | None = None,
    row_dim: int = -2,
) -> jax.Array:
    """skew_input(x, n) for a plain block-sharded activation, as one collective-permute
    (row r's blocks rotate by r within the row). Differentiable (its transpose is unskew)."""
    return _build_skew(mesh, row_axis, col_axis, _norm_batch(batch_axes), x.ndim, 1, row_dim)(x)


def unskew_sharded(
    x: jax.Array,
    *,
    mesh: Mesh,
    row_axis: str,
    col_axis: str,
    batch_axes: str | Sequence[str] | None = None,
    row_dim: int = -2,
) -> jax.Array:
    """unskew_input(x, n) for a skewed block-sharded activation, as one collective-permute."""
    return _build_skew(mesh, row_axis, col_axis, _norm_batch(batch_axes), x.ndim, -1, row_dim)(x)


# ---------------------------------------------------------------- weights from their stored layout


def _weight_route(n: int, dims: tuple, row_axis: str, col_axis: str):
    """For a weight whose dims (N, K) lie on `dims` (each row_axis, col_axis or None = whole),
    the device (f, t) that sends skewed block (r, c) = W<r + c, c>, for every (r, c); f, t being
    indices on (row_axis, col_axis). A pinned dim fixes f or t; a free one is chosen so that every
    device sends exactly one block (a permutation)."""

    def route(r, c, free_f, free_t):
        src = {row_axis: free_f, col_axis: free_t}
        for axis, block in zip(dims, ((r + c) % n, c)):
            if axis is not None:
                src[axis] = block
        return src[row_axis], src[col_axis]

    grid = [(r, c) for r in range(n) for c in range(n)]
    for free_f, free_t in (("r", "c"), ("c", "r")):
        pick = lambda r, c, name: r if name == "r" else c
        table = {(r, c): route(r, c, pick(r, c, free_f), pick(r, c, free_t)) for r, c in grid}
        if len(set(table.values())) == n * n:
            return table
    raise AssertionError(dims)  # unreachable: ("r", "c") or ("c", "r") always permutes


@functools.cache
def _build_weight_skew(mesh: Mesh, row_axis: str, col_axis: str, dims: tuple):
    n = _grid(mesh, row_axis, col_axis)
    table = _weight_route(n, dims, row_axis, col_axis)  # (r, c) -> sender (f, t)
    # What each sender slices out of the dims it holds whole: the N- and K-block of its receiver.
    send = {src: ((r + c) % n, c) for (r, c), src in table.items()}
    blocks = np.asarray([send[(f, t)] for f in range(n) for t in range(n)], np.int32)  # [n*n, 2]
    # Over the axis pair, device (f, t) has linear index f * n + t; devices keeping their block
    # send it to themselves (a ppermute zeroes whoever receives nothing).
    perm = [(f * n + t, r * n + c) for (r, c), (f, t) in table.items()]

    def local(w):
        me = jax.lax.axis_index(row_axis) * n + jax.lax.axis_index(col_axis)
        for dim, axis in enumerate(dims):
            if axis is None:  # held whole: keep the receiver's block
                size = w.shape[dim] // n
                w = jax.lax.dynamic_slice_in_dim(w, jnp.asarray(blocks)[me, dim] * size, size, axis=dim)
        if any(s != d for s, d in perm):
            w = jax.lax.ppermute(w, (row_axis, col_axis), perm)
        return w

    return jax.shard_map(local, mesh=mesh, in_specs=P(*dims), out_specs=P(row_axis, col_axis))


def skew_weight_sharded(
    w: jax.Array, dims: Sequence[str | None], *, mesh: Mesh, row_axis: str, col_axis: str
) -> jax.Array:
    """skew_weight(w, n) for a weight [N, K] block-sharded as P(*dims), each dim on row_axis,
    col_axis or None (whole on every grid device): at most one collective-permute, after local
    slices of the whole dims. Differentiable: the transpose routes dW back to P(*dims)."""
    dims = tuple(dims) + (None,) * (2 - len(dims))
    if (
        w.ndim != 2
        or any(a not in (row_axis, col_axis, None) for a in dims)
        or (dims[0] is not None and dims[0] == dims[1])
    ):
        raise ValueError(f"weight {w.shape} sharded {dims}: need 2 dims on distinct axes of {row_axis, col_axis}")
    n = _grid(mesh, row_axis, col_axis)
    if w.shape[0] % n or w.shape[1] % n:
        raise ValueError(f"weight dims {w.shape} must be divisible by n={n}")
    return _build_weight_skew(mesh, row_axis, col_axis, dims)(w)


# ---------------------------------------------------------------- one projection, as the trainer holds it


def project_sharded(proj, x: jax.Array, mesh: Mesh, strategy) -> jax.Array:
    """One projection (a linear kind: `first_weight`/`second_weight` taking a `use(w, names)` hook,
    `bottleneck`, `factored`) as P(n x n) GEMMs on the (fsdp, tensor) grid. The grid takes the
    activations as the trainer holds them (batch over data x fsdp, features over tensor: the M-block
    of grid row r is fsdp shard r's sequences), so only the skew enters: one collective-permute per
    GEMM input, the Cannon rings inside, and one permute per weight from its stored layout (its
    transpose returns dW), with no gather of any tensor."""
    from jax.ad_checkpoint import checkpoint_name
    from jax.sharding import NamedSharding

    grid = dict(mesh=mesh, row_axis="fsdp", col_axis="tensor")
    kw = dict(grid, batch_axes="data" if mesh.shape["data"] > 1 else None, row_dim=0)

    def skewed(get, dtype):
        held = []

        def use(w, names):  # the parameter as stored; remember where its blocks are
            held.append((w, tuple(spec_for(names, w.shape, mesh, strategy.rules)) + (None, None)))
            return w

        w = get(use)
        dims = held[0][1][:2] if len(held) == 1 and held[0][0] is w else None
        if dims is None or not set(dims) <= {"fsdp", "tensor", None}:
            dims = ("fsdp", "tensor")  # built from several parameters: laid out plainly by GSPMD first
        w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P(*dims)))
        return skew_weight_sharded(w.astype(dtype), dims, **grid)

    def matmul(v, get):
        return st_matmul(skew_sharded(v, **kw), skewed(get, v.dtype), **kw)

    if not proj.factored:
        return matmul(x, proj.first_weight)
    h = checkpoint_name(matmul(x, proj.first_weight), "lowrank")
    return matmul(proj.bottleneck(h), proj.second_weight)
