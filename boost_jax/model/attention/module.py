"""The attention layer (`Attention`, an nnx module): q/k/v/o projections, RoPE, the KV cache, and
`attend` (or the context island under context parallelism)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from boost_jax.kernels.gated_gemm import rope_table
from boost_jax.model.attention.documents import Documents
from boost_jax.model.attention.registry import attend, blockwise
from boost_jax.model.attention.rotary import rope
from boost_jax.model.kinds import kind_class
from boost_jax.model.linear import Projection, grouping, project, rope_in_gemm
from boost_jax.parallel.placement import LOCAL
from boost_jax.parallel.rules import constrain


class Attention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype, placement=LOCAL):
        d, h, kv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, d // h
        self.rope_theta = cfg.rope_theta
        self.grouped = grouping(cfg.group_linears)
        self.impl = cfg.attention
        proj = dict(rngs=rngs, param_dtype=param_dtype)
        self.q = Projection(cfg, d, h * self.head_dim, axes=("embed", "heads"), group="qkv", **proj)
        self.k = Projection(cfg, d, kv * self.head_dim, axes=("embed", "kv_heads"), group="qkv", **proj)
        self.v = Projection(cfg, d, kv * self.head_dim, axes=("embed", "kv_heads"), group="qkv", **proj)
        self.o = Projection(cfg, h * self.head_dim, d, axes=("heads", "embed"), group="o", **proj)
        factored = kind_class(cfg.linear).factored
        self.qkv_route, self.o_route = (placement.group(g, factored) for g in ("qkv", "o"))
        self.context = placement.context()  # None, or the sequence split over `context`

    def __call__(self, x, norm, positions, cache=None, docs: Documents | None = None, first=None):
        """x: the block's input residual; `norm` is applied first (fused with the A's under BTP).
        Without a cache the tokens sit at positions 0..T-1 (RoPE uses `positions`) and `docs`, if
        given, keeps every query inside its document; decoding with a cache ignores it. `first`: q's,
        k's and v's first stages computed elsewhere (model/linear.py `add_norm_first`; one device)."""
        b, t, _ = x.shape
        if first is None and self.context is not None and self.context.passes_bottleneck and cache is None:
            return self._bottleneck_ring(x, norm, positions, docs), cache
        qkv = [self.q, self.k, self.v]
        fused = rope_in_gemm(qkv, self.grouped, self.qkv_route)  # RoPE inside q's and k's σ kernels
        spin = (rope_table(positions, self.rope_theta, self.head_dim), (self.q, self.k)) if fused else None
        q, k, v = project(qkv, x, grouped=self.grouped, norm=norm, route=self.qkv_route, rope=spin, first=first)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        if not fused:
            q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        q = constrain(q, ("act_batch", "act_seq", "act_heads", None))
        k = constrain(k, ("act_batch", "act_seq", "act_kv_heads", None))
        v = constrain(v, ("act_batch", "act_seq", "act_kv_heads", None))
        if cache is None:
            offset = 0
        else:
            # Write this chunk at its positions (all rows share one offset), attend over the cache.
            offset = positions[0, 0]
            k = jax.lax.dynamic_update_slice_in_dim(cache["k"], k.astype(cache["k"].dtype), offset, axis=1)
            v = jax.lax.dynamic_update_slice_in_dim(cache["v"], v.astype(cache["v"].dtype), offset, axis=1)
            cache = {"k": k, "v": v}
            k, v = k.astype(q.dtype), v.astype(q.dtype)
        if self.context is not None and cache is None:  # the island: ring or gathered K/V
            out = self.context.attend(q, k, v, None if docs is None else docs.segments, blockwise(self.impl))
            out = out.reshape(b, t, self.n_heads * self.head_dim)
        else:
            out = attend(q, k, v, offset=offset, impl=self.impl, docs=docs if cache is None else None)
        return self._output(out), cache

    def _output(self, out):
        out = constrain(out, ("act_batch", "act_seq", "act_heads"))
        return project([self.o], out, grouped=False, route=self.o_route)[0]

    def _bottleneck_ring(self, x, norm, positions, docs):
        """parallel.context_kv=bottleneck: the context island gets σ(A_k x), σ(A_v x) and B_k, B_v
        and rebuilds every block's K/V itself (`rebuild_kv`)."""
        b, t, _ = x.shape
        q, (hk, bk), (hv, bv) = project(
            [self.q, self.k, self.v], x, grouped=self.grouped, norm=norm, route=self.qkv_route, keep=(self.k, self.v)
        )
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        q = constrain(rope(q, positions, self.rope_theta), ("act_batch", "act_seq", "act_heads", None))
        hk, hv = (constrain(h, ("act_batch", "act_seq", "act_rank")) for h in (hk, hv))
        rebuild = functools.partial(rebuild_kv, self.head_dim, self.rope_theta)
        out = self.context.attend_bottleneck(
            q, hk, hv, (bk, bv), positions, None if docs is None else docs.segments, blockwise(self.impl), rebuild
        )
        return self._output(out.reshape(b, t, self.n_heads * self.head_dim))


def rebuild_kv(head_dim: int, theta: float, weights, hk, hv, positions):
    """A block's K (with RoPE at `positions`) and V [B, S, KV, D] from its bottleneck activations
    hk, hv [B, S, r] and the second-stage weights (B_k, B_v) [r, KV * D]: the projections' second
    stage, as `project` runs it, on the heads the weights hold."""
    bk, bv = weights
    b, s, _ = hk.shape
    k = jnp.einsum("bsr,ro->bso", hk, bk.astype(hk.dtype)).reshape(b, s, -1, head_dim)
    v = jnp.einsum("bsr,ro->bso", hv, bv.astype(hv.dtype)).reshape(b, s, -1, head_dim)
    return rope(k, positions, theta), v
