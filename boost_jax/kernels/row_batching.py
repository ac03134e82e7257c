"""`jax.vmap` for row-wise norm kernels whose primitive has no batching rule (jax-triton's calls).

A norm kernel's forward takes rows x2 [R, d] (the fused add + norm: x2 and a residual) and a scale [d]
and returns row-major outputs ((y [R, d], s [R]), or (y, h)); its backward takes (x2, scale, dy, ds)
(ds: [R], or [R, d] for h's gradient) and returns (dx [R, d], dscale [d]). Under vmap (the trainer's
data-parallel gradient island and pipeline stages vmap the model) the calls get a leading batch dim:

- forward, scale shared by the batch: the batch is more rows, so [B, R, d] runs as one call on
  [B·R, d];
- forward with a batched scale (each pipeline stage its own weights), and every backward (dscale is
  a sum over rows, which must stay per batch member): one call per batch member, in a `lax.map`
  loop (a single call when the batch has one member, which is what each device holds in the
  gradient island and a GPipe stage).

The wrappers call themselves in their rules, so nested vmaps peel one batch dim at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_batching import custom_vmap


def _batched(value, is_batched: bool, size: int):
    return value if is_batched else jnp.broadcast_to(value, (size, *value.shape))


def _per_member(call, size: int, shared_scale: bool, scale, *rows):
    """`call(*rows_b, scale_b)` for each batch member b (scale shared when `shared_scale`)."""
    if size == 1:
        out = call(*(r[0] for r in rows), scale if shared_scale else scale[0])
        return jax.tree.map(lambda o: o[None], out)
    if shared_scale:
        return lax.map(lambda rs: call(*rs, scale), rows)
    return lax.map(lambda a: call(*a[0], a[1]), (rows, scale))


def forward(call):
    """`call(*rows, scale) -> outputs` as a function vmap batches (see the module docstring): `rows`
    are [R, d] arrays (x2, or x2 and a residual), every output is row-major ([R, d] or [R])."""

    @custom_vmap
    def fwd(*args):
        return tuple(call(*args))

    @fwd.def_vmap
    def rule(size, in_batched, *args):
        *rows, scale = args
        rows = [_batched(r, b, size) for r, b in zip(rows, in_batched[:-1])]
        if not in_batched[-1]:
            out = fwd(*(r.reshape(-1, r.shape[-1]) for r in rows), scale)
            lead = rows[0].shape[:-1]
            return tuple(o.reshape(lead + o.shape[1:]) for o in out), tuple(True for _ in out)
        out = tuple(_per_member(fwd, size, False, scale, *rows))
        return out, tuple(True for _ in out)

    return fwd


def backward(call):
    """`call(x2, scale, dy, ds) -> (dx, dscale)` as a function vmap batches (see the module docstring)."""

    @custom_vmap
    def bwd(x2, scale, dy, ds):
        return tuple(call(x2, scale, dy, ds))

    @bwd.def_vmap
    def rule(size, in_batched, x2, scale, dy, ds):
        x_batched, scale_batched, dy_batched, ds_batched = in_batched
        rows = (_batched(x2, x_batched, size), _batched(dy, dy_batched, size), _batched(ds, ds_batched, size))
        out = _per_member(lambda x, g, gs, w: bwd(x, w, g, gs), size, not scale_batched, scale, *rows)
        return tuple(out), (True, True)

    return bwd
