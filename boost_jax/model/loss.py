"""Next-token cross-entropy from the final hidden states, vocab-parallel and chunked over tokens.

`head_loss(h, w, labels, chunk=c)` computes the mean cross-entropy (and PaLM's z-loss,
z · mean(logsumexp²), when z > 0) of logits h·w without ever holding float32 [B, T, V] logits: the
sequence is cut into chunks of c positions, a `lax.scan` runs the head and the loss one chunk at a
time, and each chunk is rematerialised in the backward pass, so at most one [B, c, V] float32 block
is live. The logits stay split over the vocab (`act_vocab`): only reductions over V (max, sum, the
label's logit picked by comparison with an iota) cross devices. With c >= T it is the plain
full-logits loss.

`low_logits=True` has the head GEMM write the logits in h's dtype (bfloat16 under bf16 compute; the GEMM
still accumulates in float32) and the cross-entropy read them into float32 inside its reductions, as a
bf16 PyTorch step's head and loss do: the [B, c, V] logits and their gradient cross HBM at half the
bytes, for logits rounded to h's dtype (`model.logits_dtype=compute`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from boost_jax.parallel.rules import constrain


def token_losses(logits, labels):
    """(cross-entropy, logsumexp) per token of logits [..., V] (computed in float32) and int labels [...]."""
    logits = logits.astype(jnp.float32)
    top = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    lse = jnp.log(jnp.exp(logits - top).sum(axis=-1)) + top[..., 0]
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape[-1:], 0)
    picked = (logits * (vocab == labels[..., None])).sum(axis=-1)
    return lse - picked, lse


def logits_of(h, w, low: bool = False, cast=None):
    """Float32 logits [B, t, V] of hidden states [B, t, d] and the head weight [d, V], vocab-parallel
    (`low`: in h's dtype). The GEMM runs in h's dtype with float32 accumulation; so do its two backward
    GEMMs (`_head`). `cast`: w already in h's dtype (the chunk loop casts it once, not once a chunk);
    w then only receives the gradient (`_head_cast`)."""
    logits = _head(h, w, low) if cast is None else _head_cast(h, jax.lax.stop_gradient(cast), w, low)
    return constrain(logits, ("act_batch", "act_seq", "act_vocab"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _head(h, w, low):
    logits = jnp.einsum("btd,dv->btv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return logits.astype(h.dtype) if low else logits


def _head_fwd(h, w, low):
    return _head(h, w, low), (h, w)


def _head_bwd(low, res, g):
    """The float32 logits' cotangent enters both GEMMs in h's dtype (a bfloat16 step's head backward
    would otherwise run as float32 GEMMs, benchmarks/RESULTS.md 2026-11-28 (bf16 logits)); both accumulate
    in float32, and the weight's gradient comes back in float32 (its dtype), summed over chunks."""
    h, w = res
    g = g.astype(h.dtype)
    dh = jnp.einsum("btv,dv->btd", g, w.astype(h.dtype), preferred_element_type=jnp.float32)
    dw = jnp.einsum("btd,btv->dv", h, g, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), dw.astype(w.dtype)


_head.defvjp(_head_fwd, _head_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_cast(h, w_cast, w, low):
    """`_head` with the weight given in h's dtype (`w_cast`) beside w itself, which takes the gradient."""
    del w
    logits = jnp.einsum("btd,dv->btv", h, w_cast, preferred_element_type=jnp.float32)
    return logits.astype(h.dtype) if low else logits


def _head_cast_fwd(h, w_cast, w, low):
    return _head_cast(h, w_cast, w, low), (h, w_cast, jnp.zeros((0,), w.dtype))


def _head_cast_bwd(low, res, g):
    h, w_cast, like = res
    g = g.astype(h.dtype)  # as `_head_bwd`; the weight's gradient in w's dtype (float32), not w_cast's
    dh = jnp.einsum("btv,dv->btd", g, w_cast, preferred_element_type=jnp.float32)
    dw = jnp.einsum("btd,btv->dv", h, g, preferred_element_type=jnp.float32)
    return dh.astype(h.dtype), jnp.zeros_like(w_cast), dw.astype(like.dtype)


_head_cast.defvjp(_head_cast_fwd, _head_cast_bwd)


def _sums(h, w, labels, valid, z_loss, low=False, cast=None):
    ce, lse = token_losses(logits_of(h, w, low, cast), labels)
    return jnp.sum(jnp.where(valid, ce + z_loss * lse * lse, 0.0))


def _split(x, n: int, chunk: int, groups: int, seq_groups: int = 1):
    """[B, T, ...] -> [groups * n, B/groups, seq_groups * chunk, ...]: each of the `seq_groups` equal
    pieces of the T positions (context parallelism: one per device of `context`) padded to n chunks,
    step i holding chunk i of every piece (each device scans its own positions); with groups > 1, the
    rows cut into `groups` interleaved row groups (group j: rows j, groups+j, ...; every device keeps a
    share of each group, as the pipeline's micro-batches do)."""
    b, t = x.shape[:2]
    rest = x.shape[2:]
    x = x.reshape(b, seq_groups, t // seq_groups, *rest)
    x = jnp.pad(x, [(0, 0), (0, 0), (0, n * chunk - t // seq_groups)] + [(0, 0)] * len(rest))
    x = x.reshape(b // groups, groups, seq_groups, n, chunk, *rest)
    x = jnp.moveaxis(x, (1, 3), (0, 1))  # [groups, n, B/groups, seq_groups, chunk, ...]
    return x.reshape(groups * n, b // groups, seq_groups * chunk, *rest)


def head_loss(
    h,
    w,
    labels,
    *,
    chunk: int = 0,
    z_loss: float = 0.0,
    mask=None,
    row_groups: int = 1,
    seq_groups: int = 1,
    low_logits: bool = False,
):
    """Mean over tokens of cross-entropy (+ z_loss · logsumexp²). h: [B, T, d]; w: [d, V]; labels: [B, T].

    chunk: positions per chunk (0 or >= T: one piece, the plain loss). row_groups: the rows are
    cut into that many groups as well (a pipeline's micro-batches: the live logits block is then
    [B/groups, c, V] however many micro-batches the pass has). mask: bool [B, T] of the targets that
    count; with it the *sum* over them is returned (the caller divides by the batch's count:
    boost_jax/runtime/step.py). seq_groups: the positions are chunked within that many equal pieces
    (context parallelism: each device's own), every step taking one chunk of each. low_logits: the
    logits in h's dtype (the module docstring)."""
    b, t, _ = h.shape
    w = w.astype(jnp.float32)  # used in h's dtype; its gradient sums over the chunks in float32
    if mask is not None:
        return _masked_sum(h, w, labels, mask, chunk, z_loss, row_groups, seq_groups, low_logits)
    if (not chunk or chunk >= t) and row_groups == 1:
        return _sums(h, w, labels, True, z_loss, low_logits) / (b * t)
    chunk, n = _chunks(t // seq_groups, chunk)
    # [groups * n, B/groups, seq_groups * c, ...]: one scan step per chunk of positions (and row group).
    split = lambda x: _split(x, n, chunk, row_groups, seq_groups)  # noqa: E731
    hs, ls = split(h), split(labels)
    vs = split(jnp.ones((row_groups, t), bool))  # [groups * n, 1, seq_groups * c]: False on the padding
    cast = w.astype(h.dtype)  # once, not once a chunk
    body = jax.checkpoint(lambda h_c, l_c, v_c: _sums(h_c, w, l_c, v_c, z_loss, low_logits, cast))  # logits recomputed

    def step(total, xs):
        return total + body(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (hs, ls, vs))
    return total / (b * t)


def _chunks(t: int, chunk: int) -> tuple[int, int]:
    """(chunk length, chunks) covering t positions (chunk 0: one piece)."""
    chunk = chunk if chunk and chunk < t else t
    return chunk, -(-t // chunk)


def _masked_sum(h, w, labels, mask, chunk: int, z_loss: float, row_groups: int = 1, seq_groups: int = 1, low=False):
    """Sum of the loss over the targets in `mask` [B, T], chunked like `head_loss`."""
    b, t, _ = h.shape
    if (not chunk or chunk >= t) and row_groups == 1:
        return _sums(h, w, labels, mask, z_loss, low)
    chunk, n = _chunks(t // seq_groups, chunk)
    split = lambda x: _split(x, n, chunk, row_groups, seq_groups)  # noqa: E731
    cast = w.astype(h.dtype)  # once, not once a chunk
    body = jax.checkpoint(lambda h_c, l_c, v_c: _sums(h_c, w, l_c, v_c, z_loss, low, cast))

    def step(total, xs):
        return total + body(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (split(h), split(labels), split(mask)))
    return total
