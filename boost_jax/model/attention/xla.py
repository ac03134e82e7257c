"""`xla`: the reference attention, one float32 score einsum [B, KV, G, T, S], a masked softmax and a
weighted sum."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.model.attention.documents import Documents
from boost_jax.model.attention.registry import implementation


def query_groups(q, kv):
    b, t, h, dh = q.shape
    return q.reshape(b, t, kv, h // kv, dh)


def _visible(t, s, offset):
    return (offset + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]


@implementation("xla", cost="materialized", documents=("segments", "lengths"))
def xla_attention(q, k, v, offset, *, docs: Documents | None = None):
    """Float32 scores [B, KV, G, T, S], masked softmax, weighted sum; k/v are never repeated."""
    dh, t, s = q.shape[-1], q.shape[1], k.shape[1]
    qg = query_groups(q, k.shape[2])
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * dh**-0.5
    mask = _visible(t, s, offset)
    if docs is not None:  # [B, 1, 1, T, S]: causal and in the query's document
        seg = docs.segments
        mask = (mask & (seg[:, :, None] == seg[:, None, :]))[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return checkpoint_name(jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(q.shape), "attn_out")
