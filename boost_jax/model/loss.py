"""Next-token cross-entropy from the final hidden states, vocab-parallel and chunked over tokens.

`head_loss(h, w, labels, chunk=c)` computes the mean cross-entropy (and PaLM's z-loss,
z · mean(logsumexp²), when z > 0) of logits h·w without ever holding float32 [B, T, V] logits: the
sequence is cut into chunks of c positions, a `lax.scan` runs the head and the loss one chunk at a
time, and each chunk is rematerialised in the backward pass, so at most one [B, c, V] float32 block
is live. The logits stay split over the vocab (`act_vocab`): only reductions over V (max, sum, the
label's logit picked by comparison with an iota) cross devices. With c >= T it is the plain
full-logits loss.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from boost_jax.parallel.rules import constrain


def token_losses(logits, labels):
    """(cross-entropy, logsumexp) per token of float32 logits [..., V] and int labels [...]."""
    top = jax.lax.stop_gradient(logits.max(axis=-1, keepdims=True))
    lse = jnp.log(jnp.exp(logits - top).sum(axis=-1)) + top[..., 0]
    vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    picked = jnp.where(vocab == labels[..., None], logits, 0.0).sum(axis=-1)
    return lse - picked, lse


def logits_of(h, w):
    """Float32 logits [B, t, V] of hidden states [B, t, d] and the head weight [d, V], vocab-parallel."""
    logits = jnp.einsum("btd,dv->btv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    return constrain(logits, ("act_batch", "act_seq", "act_vocab"))


def _sums(h, w, labels, valid, z_loss):
    ce, lse = token_losses(logits_of(h, w), labels)
    return jnp.sum(jnp.where(valid, ce + z_loss * lse * lse, 0.0))


def head_loss(h, w, labels, *, chunk: int = 0, z_loss: float = 0.0, mask=None):
    """Mean over tokens of cross-entropy (+ z_loss · logsumexp²). h: [B, T, d]; w: [d, V]; labels: [B, T].

    chunk: positions per chunk (0 or >= T: one piece, the plain loss). mask: bool [B, T] of the
    targets that count; with it the *sum* over them is returned (the caller divides by the batch's
    count: boost_jax/runtime/step.py)."""
    b, t, _ = h.shape
    w = w.astype(jnp.float32)  # used in h's dtype; its gradient sums over the chunks in float32
    if mask is not None:
        return _masked_sum(h, w, labels, mask, chunk, z_loss)
    if not chunk or chunk >= t:
        return _sums(h, w, labels, True, z_loss) / (b * t)
    n = -(-t // chunk)
    pad = n * chunk - t
    valid = jnp.arange(n * chunk) < t
    # [n, B, c, ...]: one scan step per chunk of positions (the batch split is untouched).
    split = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(  # noqa: E731
        b, n, chunk, *x.shape[2:]), 1, 0)
    hs, ls = split(h), split(labels)
    vs = valid.reshape(n, 1, chunk)
    body = jax.checkpoint(lambda h_c, l_c, v_c: _sums(h_c, w, l_c, v_c, z_loss))  # recompute logits in bwd

    def step(total, xs):
        return total + body(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (hs, ls, vs))
    return total / (b * t)


def _masked_sum(h, w, labels, mask, chunk: int, z_loss: float):
    """Sum of the loss over the targets in `mask` [B, T], chunked like `head_loss`."""
    b, t, _ = h.shape
    if not chunk or chunk >= t:
        return _sums(h, w, labels, mask, z_loss)
    n = -(-t // chunk)
    pad = n * chunk - t
    split = lambda x: jnp.moveaxis(jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2)).reshape(  # noqa: E731
        b, n, chunk, *x.shape[2:]), 1, 0)
    body = jax.checkpoint(lambda h_c, l_c, v_c: _sums(h_c, w, l_c, v_c, z_loss))

    def step(total, xs):
        return total + body(*xs), None

    total, _ = jax.lax.scan(step, jnp.zeros((), jnp.float32), (split(h), split(labels), split(mask)))
    return total
