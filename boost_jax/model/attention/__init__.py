"""Rotary embeddings and causal multi-head / grouped-query attention with an optional KV cache.

Every attention in the project runs through `attend`, which picks an implementation by the name in
`model.attention` from `IMPLEMENTATIONS`. All of them compute the same causal attention:

    query t sits at position `offset + t`, key s at position s; key s is visible iff s <= offset + t.

Training (and the pipeline) call it with offset 0 and as many keys as queries; a KV cache calls it
with the cache's keys and the offset of the first new token. q: [B, T, H, Dh], k/v: [B, S, KV, Dh]
with H a multiple of KV (GQA). Rows of several documents pass `docs` (a `Documents`): key s is then
visible to query t of row b iff s <= t and segments[b, s] == segments[b, t]. The implementations
(xla, chunked, pallas, cudnn, auto), documents, decoding and adding one: the comments below.
"""

# Training (and the pipeline) call it with offset 0 and as many keys as queries; a KV cache calls it
# with the cache's keys (unwritten slots lie ahead of every query, so causality hides them) and the
# offset of the first new token. q: [B, T, H, Dh], k/v: [B, S, KV, Dh] with H a multiple of KV (GQA).
#
# Rows holding several documents (data.batching=packed) or one document then padding
# (data.batching=document) pass `docs` (a `Documents`; offset 0, S == T, no KV cache): key s is then
# visible to query t of row b iff s <= t and segments[b, s] == segments[b, t]. Every document is one
# contiguous run of its row; padding (segment 0) attends to padding only, so its rows stay finite
# (their values are implementation-defined and never used).
#
# - xla: scores as one float32 einsum [B, KV, G, T, S], softmax, einsum (the reference).
# - chunked: blockwise attention with an online softmax in plain JAX (FlashAttention-2's algorithm,
#   forward and backward): no [T, S] matrix, key blocks wholly above the diagonal are never visited,
#   memory O(T). Runs on any backend. With documents it also skips the key blocks that lie before
#   every query block's documents (in every row), and the query blocks after every key block's.
# - pallas: the Pallas flash-attention kernel of `jax.experimental.pallas.ops.gpu.attention`
#   (Triton-lowered; the interpreter on CPU). GQA repeats k/v heads; lengths are padded to the block.
#   Documents go in as the kernel's segment ids.
# - cudnn: `jax.nn.dot_product_attention(implementation="cudnn")`, bf16/fp16 on an NVIDIA GPU. Takes
#   one document per row only (its query / key-value sequence lengths), not packed rows.
# - auto: cudnn on a GPU in bf16/fp16 (head dim at most 128; cudnn pads it to a multiple of 8), else xla up to
#   `AUTO_XLA_MAX_KEYS` keys, else chunked; packed rows never run cudnn.
#
# A decode step (a traced offset) runs `chunked` under the fused kernels, which take offset 0 only.
# The attention output is tagged `attn_out` (and, where the implementation keeps one, its float32
# log-sum-exp `attn_lse`: chunked, pallas) for the remat policies (`boost_jax/model/remat.py`). Adding an
# implementation is one function `fn(q, k, v, offset) -> out` registered with
# `@implementation("name", cost=..., fused=...)`, in a file of its own here (imported below) or from
# any module: config validation, the
# trainer, the comm report and the planner (which prices it as its `cost` class) read the registry.
# One that masks documents takes `docs` as a keyword, `fn(q, k, v, offset, *, docs)`, and says which
# parts it reads with `documents=("segments", "lengths")` (or either alone); it is called with `docs=`
# only when there are documents, and `model.attention` naming one that cannot take a run's documents
# is a config error.
#
# The files: registry.py (the registry, the planner's cost classes, `resolve` and `attend`),
# documents.py (`Documents`), rotary.py (`rope`), one file per implementation (xla.py, chunked.py,
# pallas.py, cudnn.py), module.py (the `Attention` layer). Importing this package registers the four
# implementations, in this order.

# Not sorted: the implementations register in the order `names()` lists them (xla, chunked, pallas, cudnn).
from boost_jax.model.attention.registry import (  # noqa: I001
    AUTO_XLA_MAX_KEYS,
    CHUNK,
    COST_CLASSES,
    DOCUMENT_KINDS,
    IMPLEMENTATIONS,
    Blockwise,
    CostClass,
    Implementation,
    attend,
    auto_impl,
    blockwise,
    cost_class,
    implementation,
    masks,
    names,
    resolve,
    takes_context,
    takes_documents,
    under_context,
)
from boost_jax.model.attention.documents import Documents
from boost_jax.model.attention.rotary import rope
from boost_jax.model.attention.xla import xla_attention
from boost_jax.model.attention.chunked import chunked_attention
from boost_jax.model.attention.pallas import pallas_attention
from boost_jax.model.attention.cudnn import cudnn_attention
from boost_jax.model.attention.module import Attention, rebuild_kv

__all__ = [
    "AUTO_XLA_MAX_KEYS",
    "CHUNK",
    "COST_CLASSES",
    "DOCUMENT_KINDS",
    "IMPLEMENTATIONS",
    "Attention",
    "Blockwise",
    "CostClass",
    "Documents",
    "Implementation",
    "attend",
    "auto_impl",
    "blockwise",
    "chunked_attention",
    "cost_class",
    "cudnn_attention",
    "implementation",
    "masks",
    "names",
    "pallas_attention",
    "rebuild_kv",
    "resolve",
    "rope",
    "takes_context",
    "takes_documents",
    "under_context",
    "xla_attention",
]
