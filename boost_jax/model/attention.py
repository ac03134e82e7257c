"""Rotary embeddings and causal multi-head / grouped-query attention with an optional KV cache."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.model.linear import Projection, project
from boost_jax.parallel.rules import constrain


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE (LLaMA). x: [B, T, H, Dh]; positions: [B, T] integer."""
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * freqs  # [B, T, half]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def causal_attention(q, k, v, q_pos, k_pos):
    """q: [B, T, H, Dh]; k, v: [B, S, KV, Dh]; q_pos: [B, T]; k_pos: [B, S].

    Query heads are grouped over KV heads (GQA) without repeating k/v. A key is visible when its
    position is <= the query's, which also hides unwritten KV-cache slots (their positions lie ahead).
    """
    b, t, h, dh = q.shape
    kv = k.shape[2]
    q = q.reshape(b, t, kv, h // kv, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32) * dh ** -0.5
    visible = q_pos[:, None, None, :, None] >= k_pos[:, None, None, None, :]
    scores = jnp.where(visible, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, h * dh)


class Attention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype):
        d, h, kv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, d // h
        self.rope_theta = cfg.rope_theta
        self.grouped = bool(cfg.group_linears)
        proj = dict(rngs=rngs, param_dtype=param_dtype)
        self.q = Projection(cfg, d, h * self.head_dim, axes=("embed", "heads"), group="qkv", **proj)
        self.k = Projection(cfg, d, kv * self.head_dim, axes=("embed", "kv_heads"), group="qkv", **proj)
        self.v = Projection(cfg, d, kv * self.head_dim, axes=("embed", "kv_heads"), group="qkv", **proj)
        self.o = Projection(cfg, h * self.head_dim, d, axes=("heads", "embed"), group="o", **proj)

    def __call__(self, x, norm, positions, cache=None):
        """x: the block's input residual; `norm` is applied first (fused with the A's under BTP)."""
        b, t, _ = x.shape
        q, k, v = project([self.q, self.k, self.v], x, grouped=self.grouped, norm=norm)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        q = constrain(rope(q, positions, self.rope_theta), ("act_batch", "act_seq", "act_heads", None))
        k = constrain(rope(k, positions, self.rope_theta), ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", None))
        if cache is None:
            k_all, v_all, k_pos = k, v, positions
        else:
            # Write this chunk at its positions (all rows share one offset), attend over the cache.
            start = positions[0, 0]
            k_all = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), start, axis=1)
            v_all = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), start, axis=1)
            cache = {"k": k_all, "v": v_all}
            k_pos = jnp.broadcast_to(jnp.arange(k_all.shape[1])[None], (b, k_all.shape[1]))
            k_all, v_all = k_all.astype(q.dtype), v_all.astype(q.dtype)
        out = causal_attention(q, k_all, v_all, positions, k_pos)
        out = constrain(out, ("act_batch", "act_seq", "act_heads"))
        return self.o(out), cache
