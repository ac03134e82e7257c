"""`cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, bf16/fp16 on an NVIDIA GPU; one
document per row only (its query / key-value sequence lengths). A head dim cuDNN's fused kernel does not
take (not a multiple of 8, e.g. 3B's 100) runs zero-padded to the next multiple of 8 at the unpadded scale."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.errors import ConfigError
from boost_jax.kernels import platform
from boost_jax.model.attention.documents import Documents
from boost_jax.model.attention.registry import implementation
from boost_jax.parallel.rules import per_shard


@implementation("cudnn", cost="flash", fused=True, documents=("lengths",))
def cudnn_attention(q, k, v, offset, *, docs: Documents | None = None):
    """cuDNN's fused kernel; with documents (one per row only) its query / key-value lengths."""
    if not platform.is_nvidia():
        raise ConfigError(
            f"config field `model.attention`: cudnn needs an NVIDIA GPU (the step is built for "
            f"{platform.name()!r} devices); use chunked, xla or auto"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ConfigError(
            f"config field `model.attention`: cudnn runs bfloat16/float16, the model computes in "
            f"{q.dtype}; set model.dtype=bfloat16 (or model.attention=chunked)"
        )
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"cudnn attention needs as many keys as queries, got {q.shape[1]} and {k.shape[1]}")
    call = padded_head_dim(jax.nn.dot_product_attention)
    # per_shard: per head shard where XLA cannot partition the call (inside the 1F1B pipeline's stages)
    heads, kv_heads = ("act_batch", "act_seq", "act_heads", None), ("act_batch", "act_seq", "act_kv_heads", None)
    if docs is None:
        out = per_shard(
            lambda q, k, v: call(q, k, v, is_causal=True, implementation="cudnn"),
            (q, k, v),
            (heads, kv_heads, kv_heads),
            heads,
        )
        return checkpoint_name(out, "attn_out")
    if docs.lengths is None:
        raise ConfigError(
            "config field `model.attention`: cudnn takes one document per row only "
            "(data.batching=document), not packed rows; use chunked, xla or auto"
        )
    out = per_shard(
        lambda q, k, v, n: call(
            q, k, v, is_causal=True, implementation="cudnn", query_seq_lengths=n, key_value_seq_lengths=n
        ),
        (q, k, v, docs.lengths),
        (heads, kv_heads, kv_heads, ("act_batch",)),
        heads,
    )
    return checkpoint_name(out, "attn_out")


HEAD_DIM_MULTIPLE = 8  # cuDNN's fused attention takes head dims that are multiples of 8


def padded_head_dim(attend):
    """`attend(q, k, v, **kw)` ([B, T, heads, D] each) with D zero-padded to a multiple of
    HEAD_DIM_MULTIPLE and the output sliced back: padded q·k products are unchanged, padded v columns
    give zero output columns; the softmax scale stays 1/sqrt(D)."""

    def call(q, k, v, **kw):
        dim = q.shape[-1]
        extra = -dim % HEAD_DIM_MULTIPLE
        if not extra:
            return attend(q, k, v, **kw)
        pad = [(0, 0)] * (q.ndim - 1) + [(0, extra)]
        q, k, v = (jnp.pad(a, pad) for a in (q, k, v))
        return attend(q, k, v, scale=1.0 / math.sqrt(dim), **kw)[..., :dim]

    return call
