"""`cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")`, bf16/fp16 on an NVIDIA GPU; one
document per row only (its query / key-value sequence lengths)."""

from __future__ import annotations

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
    # per_shard: per head shard where XLA cannot partition the call (inside the 1F1B pipeline's stages)
    heads, kv_heads = ("act_batch", "act_seq", "act_heads", None), ("act_batch", "act_seq", "act_kv_heads", None)
    if docs is None:
        out = per_shard(
            lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
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
        lambda q, k, v, n: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn", query_seq_lengths=n, key_value_seq_lengths=n
        ),
        (q, k, v, docs.lengths),
        (heads, kv_heads, kv_heads, ("act_batch",)),
        heads,
    )
    return checkpoint_name(out, "attn_out")
