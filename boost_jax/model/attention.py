"""Rotary embeddings and causal multi-head / grouped-query attention with an optional KV cache.

Every attention in the project runs through `attend`, which picks an implementation by the name in
`model.attention` from `IMPLEMENTATIONS`. All of them compute the same causal attention:

    query t sits at position `offset + t`, key s at position s; key s is visible iff s <= offset + t.

Training (and the pipeline) call it with offset 0 and as many keys as queries; a KV cache calls it
with the cache's keys (unwritten slots lie ahead of every query, so causality hides them) and the
offset of the first new token. q: [B, T, H, Dh], k/v: [B, S, KV, Dh] with H a multiple of KV (GQA).

Rows holding several documents (data.batching=packed) or one document then padding
(data.batching=document) pass `docs` (a `Documents`; offset 0, S == T, no KV cache): key s is then
visible to query t of row b iff s <= t and segments[b, s] == segments[b, t]. Every document is one
contiguous run of its row; padding (segment 0) attends to padding only, so its rows stay finite
(their values are implementation-defined and never used).

- xla: scores as one float32 einsum [B, KV, G, T, S], softmax, einsum (the reference).
- chunked: blockwise attention with an online softmax in plain JAX (FlashAttention-2's algorithm,
  forward and backward): no [T, S] matrix, key blocks wholly above the diagonal are never visited,
  memory O(T). Runs on any backend. With documents it also skips the key blocks that lie before
  every query block's documents (in every row), and the query blocks after every key block's.
- pallas: the Pallas flash-attention kernel of `jax.experimental.pallas.ops.gpu.attention`
  (Triton-lowered; the interpreter on CPU). GQA repeats k/v heads; lengths are padded to the block.
  Documents go in as the kernel's segment ids.
- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")`, bf16/fp16 on an NVIDIA GPU. Takes
  one document per row only (its query / key-value sequence lengths), not packed rows.
- auto: cudnn on a GPU in bf16/fp16 (head dim a multiple of 8, at most 128), else xla up to
  `AUTO_XLA_MAX_KEYS` keys, else chunked; packed rows never run cudnn.

A decode step (a traced offset) runs `chunked` under the fused kernels, which take offset 0 only.
The attention output is tagged `attn_out` (and, where the implementation keeps one, its float32
log-sum-exp `attn_lse`: chunked, pallas) for the remat policies (`boost_jax/model/remat.py`). Adding an
implementation is one function `fn(q, k, v, offset) -> out` registered with
`@implementation("name", cost=..., fused=...)`, here or from any module: config validation, the
trainer, the comm report and the planner (which prices it as its `cost` class) read the registry.
One that masks documents takes `docs` as a keyword, `fn(q, k, v, offset, *, docs)`, and says which
parts it reads with `documents=("segments", "lengths")` (or either alone); it is called with `docs=`
only when there are documents, and `model.attention` naming one that cannot take a run's documents
is a config error.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from boost_jax.errors import ConfigError
from boost_jax.kernels import platform
from boost_jax.model.kinds import kind_class
from boost_jax.model.linear import Projection, project
from boost_jax.parallel.placement import LOCAL
from boost_jax.parallel.rules import constrain, per_shard

IMPLEMENTATIONS: dict = {}  # name -> Implementation
AUTO_XLA_MAX_KEYS = 1024  # auto: below this many keys the one-einsum reference is cheaper
CHUNK = 512  # chunked: query and key block length
_NEG = -1e30  # masked score: finite, so a row's running max never becomes -inf


@dataclasses.dataclass(frozen=True)
class CostClass:
    """How the planner prices an implementation (boost_jax/planner: cost.attention_seconds, the time;
    partitions.attention, what the backward keeps), described without hardware. Scores either pass
    through HBM (`block` keys at a time, 0: a query's whole row; the blocks above the diagonal
    skipped) or stay inside one `fused` kernel that skips the masked blocks and runs at the cluster's
    flash efficiency. The `kept*` counts are read from compiled steps (tests/test_planner.py)."""
    name: str
    backward: float  # backward GEMM work over the forward's 2 GEMMs (q·kᵀ, p·v)
    score_bytes: tuple = (0, 0)  # HBM bytes per (head, query, key) score: forward, backward
    block: int = 0  # keys per block of scores (0: the whole row)
    fused: bool = False
    kept: int = 4  # arrays of the query width kept for the backward: q, k, v, the output (+ its [B, T, q] view)
    kept_scores: int = 0  # float32 arrays per score kept (0: a float32 log-sum-exp per query row and head)


# The cost classes implementations register with (`implementation(cost=...)`; a new one may bring its own).
COST_CLASSES: dict = {c.name: c for c in (
    # Scores materialised: the forward writes the float32 scores, reads them for the softmax, writes the
    # probabilities, reads them for P·V (12 bytes); the backward reads/writes dP, dS, P (16). Kept: the
    # float32 exp and softmax per score (+ the probabilities in the compute dtype when that is not float32).
    CostClass("materialized", backward=2, score_bytes=(12, 16), kept=4, kept_scores=2),
    # Blocks of 512 queries x 512 keys (`chunked` below): each block's scores pass through HBM as above,
    # and the backward recomputes them twice (its dQ pass and its dK/dV pass: 7 block GEMMs against the
    # forward's 2, twice the score traffic).
    CostClass("chunked", backward=3.5, score_bytes=(12, 32), block=CHUNK, kept=5),
    # FlashAttention: its backward runs 5 GEMMs (scores recomputed) against the forward's 2; the GPU
    # program keeps q, k, v, the output and its [B, T, q] view (and the log-sum-exp): llama_7b megatron
    # on 8 H100 stacks bf16[L, B, T, h/8, hd] x 4 and bf16[L, B, T, q/8].
    CostClass("flash", backward=2.5, fused=True, kept=5),
)}
# What of a `Documents` an implementation reads: segment ids (any rows), or per-row lengths (one
# document then padding per row only).
DOCUMENT_KINDS = ("segments", "lengths")
_WARNED: set = set()  # the notices `resolve` gave once already


@dataclasses.dataclass(frozen=True)
class Blockwise:
    """One query block against one key block, with the block's log-sum-exp: what context parallelism
    (boost_jax/parallel/context.py) merges with an online softmax. Query t sits at `offset + t`, key s
    at s (causal, as `attend`); q_seg / k_seg: segment ids [B, Tq] / [B, Tk] of documents (None: no
    documents; k_seg None: the keys are the queries' own positions).

    fwd(q, k, v, offset, q_seg, k_seg) -> (out float32 [B, Tq, H, D], lse float32 [B, Tq, H]);
    bwd(q, k, v, out, lse, dout, offset, q_seg, k_seg) -> (dq, dk, dv) float32, given the out and lse
    merged over every key block (FlashAttention-2's backward: the blocks' gradients then add up)."""
    fwd: Callable
    bwd: Callable


@dataclasses.dataclass(frozen=True)
class Implementation:
    fn: Callable  # fn(q, k, v, offset) -> out [B, T, H, Dh]
    cost: str  # the name of its CostClass (COST_CLASSES)
    fused: bool = False  # a fused kernel taking offset 0 only: decode steps (a traced offset) run `chunked`
    documents: tuple = ()  # the DOCUMENT_KINDS it masks by (then fn takes `docs=`)
    blockwise: Blockwise | None = None  # its block form: what runs under context parallelism


def implementation(name: str, *, cost, fused: bool = False, documents: tuple = (),
                   blockwise: Blockwise | None = None):
    """Register `fn(q, k, v, offset)` as `model.attention=name`, priced by the planner as `cost` (a
    COST_CLASSES name, or a new CostClass, registered with it); with `documents` (DOCUMENT_KINDS it
    reads) it also takes `fn(q, k, v, offset, docs=Documents)`; with `blockwise` it runs under context
    parallelism (`parallel.context` > 1)."""
    if isinstance(cost, CostClass):
        COST_CLASSES[cost.name] = cost
        cost = cost.name
    if cost not in COST_CLASSES:
        raise ValueError(f"attention implementation {name!r}: cost {cost!r} is not one of {tuple(COST_CLASSES)}")
    documents = tuple(documents)
    if not set(documents) <= set(DOCUMENT_KINDS):
        raise ValueError(f"attention implementation {name!r}: documents {documents} are not among {DOCUMENT_KINDS}")

    def register(fn):
        IMPLEMENTATIONS[name] = Implementation(fn, cost, fused, documents, blockwise)
        return fn

    return register


def names() -> tuple[str, ...]:
    """Every value `model.attention` takes."""
    return ("auto", *IMPLEMENTATIONS)


def cost_class(name: str) -> str:
    """The name of the CostClass the planner prices implementation `name` by (not `auto`: resolve it
    first); COST_CLASSES holds the class."""
    return IMPLEMENTATIONS[name].cost


def takes_context(name: str) -> bool:
    """Whether `model.attention=name` runs with the sequence split over `context` (it has a block
    form; `auto`: see under_context)."""
    return name == "auto" or (name in IMPLEMENTATIONS and IMPLEMENTATIONS[name].blockwise is not None)


def under_context(name: str) -> str:
    """The implementation `model.attention=name` runs as with the sequence split over parallel.context:
    `auto` runs chunked's block form there (the planner prices context plans by it)."""
    return "chunked" if name == "auto" else name


def blockwise(name: str) -> Blockwise:
    """The block form `model.attention=name` runs under context parallelism (see under_context)."""
    if not takes_context(name):
        able = ", ".join(n for n in names() if takes_context(n))
        raise ConfigError(f"config field `model.attention`: {name} cannot run with the sequence split over "
                          f"parallel.context; set model.attention to one of {able}")
    return IMPLEMENTATIONS[under_context(name)].blockwise


def takes_documents(name: str, kind: str) -> bool:
    """Whether `model.attention=name` masks documents given as `kind` ("segments": any rows;
    "lengths": one document per row). `auto` always picks one that does."""
    if kind not in DOCUMENT_KINDS:
        raise ValueError(f"document kind {kind!r} is not one of {DOCUMENT_KINDS}")
    return name == "auto" or (name in IMPLEMENTATIONS and kind in IMPLEMENTATIONS[name].documents)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Documents:
    """Where the documents of each row lie (see the module docstring); a pytree. Build it with
    `Documents.packed` or `Documents.one_per_row`."""
    segments: jax.Array  # int32 [B, T]: the document id of every position; 0 = padding
    first_key: jax.Array  # int32 [T]: min over rows of the first position of t's document (block skipping)
    last_query: jax.Array  # int32 [T]: max over rows of the last position of t's document
    lengths: jax.Array | None = None  # int32 [B]: only when every row is one document, then padding
    # int32 [B, S]: the keys' segment ids when the keys are other positions than the queries (a block
    # of another device's keys under context parallelism); None: the keys are the queries' positions.
    key_segments: jax.Array | None = None

    @classmethod
    def packed(cls, segments) -> Documents:
        """Any rows: segments [B, T], each document one contiguous run of its row."""
        segments = jnp.asarray(segments, jnp.int32)
        return cls(segments, *_document_spans(segments))

    @classmethod
    def one_per_row(cls, lengths, t: int) -> Documents:
        """Row b: one document at positions < lengths[b], then padding (of T = t positions)."""
        lengths = jnp.asarray(lengths, jnp.int32)
        segments = (jnp.arange(t) < lengths[:, None]).astype(jnp.int32)
        return cls(segments, *_document_spans(segments), lengths)

    def rows(self) -> dict:
        """The per-row parts, [B, ...] each: what a pipeline carries with a micro-batch's rows."""
        rows = {"segments": self.segments}
        return rows if self.lengths is None else {**rows, "lengths": self.lengths}

    @classmethod
    def from_rows(cls, rows: dict) -> Documents:
        """`Documents` of the rows `rows()` gave (the row-invariant spans recomputed over them)."""
        return cls(rows["segments"], *_document_spans(rows["segments"]), rows.get("lengths"))

    @property
    def kind(self) -> str:
        """What these documents can be given as: "lengths" (one document per row; segments too) or
        "segments" (packed rows)."""
        return "segments" if self.lengths is None else "lengths"


def _document_spans(segments):
    """(first_key, last_query) [T] of `Documents`: each position's run start (cummax of the positions
    where the id changes) and end (reverse cummin), min / max over rows."""
    b, t = segments.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    change = segments[:, 1:] != segments[:, :-1]
    edge = jnp.ones((b, 1), bool)
    starts = jax.lax.cummax(jnp.where(jnp.concatenate([edge, change], 1), pos, 0), axis=1)
    ends = jax.lax.cummin(jnp.where(jnp.concatenate([change, edge], 1), pos, t - 1), axis=1, reverse=True)
    return starts.min(0), ends.max(0)


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


def _static_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0


def masks(name: str, kind: str) -> bool:
    """Whether `name` masks documents of `kind` (Documents.kind): lengths rows carry segments too."""
    return any(takes_documents(name, k) for k in (DOCUMENT_KINDS if kind == "lengths" else ("segments",)))


def auto_impl(on_gpu: bool, half: bool, head_dim: int, queries: int, keys: int, documents: str | None = None) -> str:
    """What `auto` runs: cudnn on a GPU in bf16/fp16 where cuDNN's fused kernel takes the shapes
    (head dim a multiple of 8, at most 128, as many keys as queries), else xla up to
    AUTO_XLA_MAX_KEYS keys, else chunked. `documents`: None (no documents), "lengths" (one document
    per row) or "segments" (packed rows: cudnn is out). (The planner prices plans with it.)"""
    cudnn_ok = documents is None or masks("cudnn", documents)
    if on_gpu and half and head_dim % 8 == 0 and head_dim <= 128 and keys == queries and cudnn_ok:
        return "cudnn"
    return "xla" if keys <= AUTO_XLA_MAX_KEYS else "chunked"


def resolve(impl: str, q, k, offset, docs: Documents | None = None) -> str:
    """The implementation `impl` runs as for these shapes (and documents) on this backend."""
    fused_ok = _static_zero(offset)
    kind = None if docs is None else docs.kind
    if impl == "auto":
        shape = (fused_ok and platform.name() == "gpu", q.dtype in (jnp.bfloat16, jnp.float16),
                 q.shape[-1], q.shape[1], k.shape[1])
        name = auto_impl(*shape, documents=kind)
        if kind == "segments" and name != auto_impl(*shape) and name not in _WARNED:  # said only when it differs
            _WARNED.add(name)
            warnings.warn(f"model.attention=auto: packed rows (data.batching=packed) run {name}; "
                          "cudnn takes one document per row only", stacklevel=3)
        return name
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"config field `model.attention`: {impl!r} is not one of {names()}")
    if kind is not None and not masks(impl, kind):
        able = ", ".join(n for n in names() if masks(n, kind))
        batching = "packed" if kind == "segments" else "document"
        raise ConfigError(f"config field `model.attention`: {impl} cannot mask the documents of "
                          f"data.batching={batching}; set model.attention to one of {able} (or data.batching=stream)")
    if IMPLEMENTATIONS[impl].fused and not fused_ok:
        return "chunked"
    return impl


def attend(q, k, v, *, offset=0, impl: str = "xla", docs: Documents | None = None):
    """Causal attention (see the module docstring) -> [B, T, H * Dh] in q's dtype; with `docs`, each
    query sees its own document only."""
    b, t, h, dh = q.shape
    fn = IMPLEMENTATIONS[resolve(impl, q, k, offset, docs)].fn
    if docs is None:
        return fn(q, k, v, offset).reshape(b, t, h * dh)
    if not _static_zero(offset) or k.shape[1] != t or docs.segments.shape != (b, t):
        raise ValueError(f"attention with documents needs offset 0 and segments [B, T] = {[b, t]} for as many "
                         f"keys as queries, got offset {offset}, {k.shape[1]} keys, segments {docs.segments.shape}")
    return fn(q, k, v, offset, docs=docs).reshape(b, t, h * dh)


def _grouped(q, kv):
    b, t, h, dh = q.shape
    return q.reshape(b, t, kv, h // kv, dh)


def _visible(t, s, offset):
    return (offset + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]


@implementation("xla", cost="materialized", documents=("segments", "lengths"))
def xla_attention(q, k, v, offset, *, docs: Documents | None = None):
    """Float32 scores [B, KV, G, T, S], masked softmax, weighted sum; k/v are never repeated."""
    dh, t, s = q.shape[-1], q.shape[1], k.shape[1]
    qg = _grouped(q, k.shape[2])
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * dh ** -0.5
    mask = _visible(t, s, offset)
    if docs is not None:  # [B, 1, 1, T, S]: causal and in the query's document
        seg = docs.segments
        mask = (mask & (seg[:, :, None] == seg[:, None, :]))[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return checkpoint_name(jnp.einsum("bkgts,bskd->btkgd", probs, v).reshape(q.shape), "attn_out")


# ------------------------------------------------------------------------------------------ chunked

def _blocks(n, block):
    """(block length, number of blocks) covering n."""
    block = min(block, n)
    return block, -(-n // block)


def _pad_to(x, axis, length):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, length - x.shape[axis])
    return jnp.pad(x, pad)


def _block_scores(qi, kj, i, j, bq, bk, offset, s_len, scale, seg=None):
    """Masked float32 scores [B, KV, G, bq, bk] of query block i against key block j; `seg`: the
    blocks' segment ids ([B, bq], [B, bk]) with documents."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    qpos = offset + i * bq + jnp.arange(bq)
    kpos = j * bk + jnp.arange(bk)
    mask = (qpos[:, None] >= kpos[None, :]) & (kpos < s_len)[None, :]
    if seg is not None:
        mask = mask & (seg[0][:, :, None] == seg[1][:, None, :])[:, None, None]
    return jnp.where(mask, s, _NEG)


def _first_visible_q_block(j, bq, bk, offset):
    """The first query block whose last query sees key block j's first key."""
    return jnp.maximum(j * bk - offset - (bq - 1), 0) // bq


def _n_visible_k_blocks(i, bq, bk, offset, nk):
    """Key blocks query block i sees: those starting at or before its last query's position."""
    return jnp.minimum((offset + (i + 1) * bq - 1) // bk + 1, nk)


def _document_bounds(docs, bq, nq, bk, nk):
    """(first key block of every query block [nq], end of the query blocks of every key block [nk]):
    outside them every key lies in another document than every query, in every row. Causality bounds
    the other side."""
    t, s = docs.first_key.shape[0], docs.last_query.shape[0]
    first = _pad_to(docs.first_key, 0, nq * bq).at[t:].set(s).reshape(nq, bq).min(1) // bk
    last = _pad_to(docs.last_query, 0, nk * bk).at[s:].set(-1).reshape(nk, bk).max(1)
    return first, jnp.minimum(last // bq + 1, nq)


def _segment_blocks(docs, bq, nq, bk, nk):
    """Segment ids by block: queries [nq, B, bq], keys [nk, B, bk] (padding: id 0, hidden by s_len)."""
    seg = docs.segments
    keys = seg if docs.key_segments is None else docs.key_segments
    b = seg.shape[0]
    return (_pad_to(seg, 1, nq * bq).reshape(b, nq, bq).transpose(1, 0, 2),
            _pad_to(keys, 1, nk * bk).reshape(b, nk, bk).transpose(1, 0, 2))


def _layout(q, k, v, block):
    """q [B,T,H,D] -> [nq, B, KV, G, bq, D]; k, v [B,S,KV,D] -> [nk, B, KV, bk, D] (zero padded)."""
    b, t, h, dh = q.shape
    s, kv = k.shape[1], k.shape[2]
    bq, nq = _blocks(t, block)
    bk, nk = _blocks(s, block)
    qb = _pad_to(_grouped(q, kv), 1, nq * bq).reshape(b, nq, bq, kv, h // kv, dh).transpose(1, 0, 3, 4, 2, 5)
    kb, vb = (_pad_to(x, 1, nk * bk).reshape(b, nk, bk, kv, dh).transpose(1, 0, 3, 2, 4) for x in (k, v))
    return qb, kb, vb, (bq, nq, bk, nk)


def _unlayout_q(x, q_shape):
    """[nq, B, KV, G, bq, D] -> [B, T, H, D] (padding dropped)."""
    nq, b, kv, g, bq, dh = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, kv * g, dh)[:, :q_shape[1]]


def _chunked_fwd(q, k, v, offset, docs, block, out_dtype=None):
    """(out [B,T,H,D] in `out_dtype` (default q.dtype), lse [nq, B, KV, G, bq] float32)."""
    qb, kb, vb, (bq, nq, bk, nk) = _layout(q, k, v, block)
    scale = q.shape[-1] ** -0.5
    s_len = k.shape[1]
    if docs is not None:
        first_k, _ = _document_bounds(docs, bq, nq, bk, nk)
        seg_q, seg_k = _segment_blocks(docs, bq, nq, bk, nk)

    def q_block(i):
        qi = qb[i]

        def k_block(j, carry):
            m, l, acc = carry
            seg = None if docs is None else (seg_q[i], seg_k[j])
            s = _block_scores(qi, kb[j], i, j, bq, bk, offset, s_len, scale, seg)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            acc = acc * corr[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb[j],
                                                     preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc

        stats = jnp.full(qi.shape[:-1], _NEG, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros(qi.shape, jnp.float32))
        start = 0 if docs is None else first_k[i]
        m, l, acc = jax.lax.fori_loop(start, _n_visible_k_blocks(i, bq, bk, offset, nk), k_block, init)
        return (acc / l[..., None]).astype(out_dtype or q.dtype), m + jnp.log(l)

    out, lse = jax.lax.map(q_block, jnp.arange(nq))
    return _unlayout_q(out, q.shape), lse


def _chunked_bwd(q, k, v, out, lse, dout, offset, docs, block, wide: bool = False):
    """(dq, dk, dv) in q's and k's dtypes, or float32 when `wide`."""
    qb, kb, vb, (bq, nq, bk, nk) = _layout(q, k, v, block)
    ob, dob = (_layout(x, k, v, block)[0] for x in (out, dout))
    scale = q.shape[-1] ** -0.5
    s_len = k.shape[1]
    if docs is not None:
        first_k, end_q = _document_bounds(docs, bq, nq, bk, nk)
        seg_q, seg_k = _segment_blocks(docs, bq, nq, bk, nk)
    # delta_i = Σ_d dO·O (FlashAttention-2's row term); padded rows have dO = 0 and add nothing.
    delta = jnp.einsum("nbkgqd,nbkgqd->nbkgq", dob.astype(jnp.float32), ob.astype(jnp.float32))

    def probs(i, j):
        seg = None if docs is None else (seg_q[i], seg_k[j])
        s = _block_scores(qb[i], kb[j], i, j, bq, bk, offset, s_len, scale, seg)
        p = jnp.exp(s - lse[i][..., None])
        dp = jnp.einsum("bkgqd,bksd->bkgqs", dob[i], vb[j], preferred_element_type=jnp.float32)
        return p, p * (dp - delta[i][..., None])

    def dq_block(i):
        def k_block(j, dq):
            _, ds = probs(i, j)
            return dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, kb[j].astype(jnp.float32)) * scale

        start = 0 if docs is None else first_k[i]
        return jax.lax.fori_loop(start, _n_visible_k_blocks(i, bq, bk, offset, nk), k_block,
                                 jnp.zeros(qb.shape[1:], jnp.float32))

    def dkv_block(j):
        def q_block(i, carry):
            dk, dv = carry
            p, ds = probs(i, j)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, dob[i].astype(jnp.float32))
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qb[i].astype(jnp.float32)) * scale
            return dk, dv

        zeros = jnp.zeros(kb.shape[1:], jnp.float32)
        stop = nq if docs is None else end_q[j]
        return jax.lax.fori_loop(_first_visible_q_block(j, bq, bk, offset), stop, q_block, (zeros, zeros))

    dq = _unlayout_q(jax.lax.map(dq_block, jnp.arange(nq)), q.shape).astype(jnp.float32 if wide else q.dtype)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(nk))
    b, s, kv, dh = k.shape
    k_dtype = jnp.float32 if wide else k.dtype
    unk = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bk, kv, dh)[:, :s].astype(k_dtype)  # noqa: E731
    return dq, unk(dk), unk(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _chunked(q, k, v, offset, docs, block):
    return _chunked_fwd(q, k, v, offset, docs, block)[0]


def _chunked_vjp_fwd(q, k, v, offset, docs, block):
    out, lse = _chunked_fwd(q, k, v, offset, docs, block)
    out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")
    return out, (q, k, v, offset, docs, out, lse)


def _chunked_vjp_bwd(block, res, dout):
    q, k, v, offset, docs, out, lse = res
    dq, dk, dv = _chunked_bwd(q, k, v, out, lse, dout, offset, docs, block)
    return dq, dk, dv, None, None  # offset and the documents are integers


_chunked.defvjp(_chunked_vjp_fwd, _chunked_vjp_bwd)


def _pair_documents(q_seg, k_seg):
    """The Documents of a query block against a key block (see `Blockwise`): the keys' own segment
    ids when they are other positions, whose spans are unknown here (no document block skipping)."""
    if q_seg is None:
        return None
    if k_seg is None:
        return Documents.packed(q_seg)
    tq, tk = q_seg.shape[1], k_seg.shape[1]
    return Documents(q_seg, jnp.zeros((tq,), jnp.int32), jnp.full((tk,), tq - 1, jnp.int32),
                     key_segments=jnp.asarray(k_seg, jnp.int32))


def _lse_rows(lse, b: int, t: int):
    """chunked's lse [nq, B, KV, G, bq] -> [B, T, H]."""
    nq, _, kv, g, bq = lse.shape
    return lse.transpose(1, 0, 4, 2, 3).reshape(b, nq * bq, kv * g)[:, :t]


def _lse_blocks(lse, kv: int, block: int):
    """[B, T, H] -> chunked's lse layout [nq, B, KV, G, bq] (padded rows: 0, their dO is 0)."""
    b, t, h = lse.shape
    bq, nq = _blocks(t, block)
    return _pad_to(lse, 1, nq * bq).reshape(b, nq, bq, kv, h // kv).transpose(1, 0, 3, 4, 2)


def _chunked_block_fwd(q, k, v, offset, q_seg, k_seg):
    out, lse = _chunked_fwd(q, k, v, jnp.asarray(offset, jnp.int32), _pair_documents(q_seg, k_seg), CHUNK,
                            jnp.float32)
    return out, _lse_rows(lse, q.shape[0], q.shape[1])


def _chunked_block_bwd(q, k, v, out, lse, dout, offset, q_seg, k_seg):
    return _chunked_bwd(q, k, v, out, _lse_blocks(lse, k.shape[2], CHUNK), dout, jnp.asarray(offset, jnp.int32),
                        _pair_documents(q_seg, k_seg), CHUNK, wide=True)


@implementation("chunked", cost="chunked", documents=("segments", "lengths"),
                blockwise=Blockwise(_chunked_block_fwd, _chunked_block_bwd))
def chunked_attention(q, k, v, offset, block: int | None = None, *, docs: Documents | None = None):
    return _chunked(q, k, v, jnp.asarray(offset, jnp.int32), docs, block or CHUNK)


# ------------------------------------------------------------------------------------------- pallas

def _pallas_mha_module():
    # Triton-lowered flash attention. JAX deprecates these ops after 0.11 (for tokamax) and the
    # Pallas Triton backend in 0.11 itself: when the module is gone, say so and name the others.
    try:
        from jax.experimental.pallas.ops.gpu import attention as mod
    except ImportError as e:
        raise ConfigError(f"config field `model.attention`: pallas needs jax.experimental.pallas.ops.gpu.attention, "
                          f"which jax {jax.__version__} does not have ({e}); use cudnn, chunked or xla") from e
    return mod


# The module's private backward, called with the residuals our forward tags for remat. Used only
# when its signature is this one (jax 0.6 to 0.10 at least); otherwise the module's public `mha`
# (its own custom_vjp) runs, with a warning: the same kernels, only `attn_lse` is not kept for remat.
_MHA_BACKWARD_PARAMS = ("sm_scale", "causal", "block_sizes", "backward_pass_impl", "num_warps", "num_stages",
                        "grid", "interpret", "debug", "return_residuals", "res", "do")


def _private_backward_ok(mod) -> bool:
    try:
        return tuple(inspect.signature(mod._mha_backward).parameters) == _MHA_BACKWARD_PARAMS
    except (AttributeError, TypeError, ValueError):
        return False


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _pallas(q, k, v, segment_ids, block, interpret):
    return _pallas_fwd(q, k, v, segment_ids, block, interpret)[0]


def _pallas_blocks(block):
    mod = _pallas_mha_module()
    return mod.BlockSizes(block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block,
                          block_q_dq=block, block_kv_dq=block)


def _pallas_fwd(q, k, v, segment_ids, block, interpret):
    mod = _pallas_mha_module()
    out, lse = mod.mha(q, k, v, segment_ids, sm_scale=q.shape[-1] ** -0.5, causal=True,
                       block_sizes=_pallas_blocks(block), interpret=interpret, return_residuals=True)
    out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")
    return out, (q, k, v, segment_ids, out, lse)


def _pallas_bwd(block, interpret, res, dout):
    mod = _pallas_mha_module()
    # The module's own backward kernels (dq and dk/dv), fed the residuals saved above.
    dq, dk, dv, _ = mod._mha_backward(res[0].shape[-1] ** -0.5, True, _pallas_blocks(block), "triton", None, 2, None,
                                      interpret, False, False, res, dout)
    return dq, dk, dv, None  # segment ids are integers


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


@implementation("pallas", cost="flash", fused=True, documents=("segments", "lengths"))
def pallas_attention(q, k, v, offset, block: int | None = None, interpret: bool | None = None, *,
                     docs: Documents | None = None):
    """Training shapes only (offset 0, S == T); lengths are zero-padded to a power-of-two block
    (padded keys lie after every real query, so causality hides them), and so are the documents'
    segment ids, the kernel's `segment_ids`."""
    b, t, h, dh = q.shape
    if k.shape[1] != t:
        raise ValueError(f"pallas attention needs as many keys as queries, got {t} and {k.shape[1]}")
    block = block or min(64, 1 << max(4, math.ceil(math.log2(t))))
    if interpret is None:
        interpret = platform.name() == "cpu"
    g = h // k.shape[2]
    tp = -(-t // block) * block
    qp, kp, vp = (_pad_to(x, 1, tp) for x in (q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)))
    segment_ids = None if docs is None else _pad_to(docs.segments, 1, tp)
    mod = _pallas_mha_module()
    if not _private_backward_ok(mod):
        warnings.warn(f"pallas attention: jax {jax.__version__} changed the private _mha_backward of "
                      "jax.experimental.pallas.ops.gpu.attention; running its public mha (same kernels; "
                      "remat cannot keep attn_lse)", stacklevel=2)
        out = mod.mha(qp, kp, vp, segment_ids, sm_scale=dh ** -0.5, causal=True, block_sizes=_pallas_blocks(block),
                      interpret=bool(interpret))
        return checkpoint_name(out, "attn_out")[:, :t]
    return _pallas(qp, kp, vp, segment_ids, block, bool(interpret))[:, :t]


# -------------------------------------------------------------------------------------------- cudnn

@implementation("cudnn", cost="flash", fused=True, documents=("lengths",))
def cudnn_attention(q, k, v, offset, *, docs: Documents | None = None):
    """cuDNN's fused kernel; with documents (one per row only) its query / key-value lengths."""
    if not platform.is_nvidia():
        raise ConfigError(f"config field `model.attention`: cudnn needs an NVIDIA GPU (the step is built for "
                          f"{platform.name()!r} devices); use chunked, xla or auto")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ConfigError(f"config field `model.attention`: cudnn runs bfloat16/float16, the model computes in "
                          f"{q.dtype}; set model.dtype=bfloat16 (or model.attention=chunked)")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"cudnn attention needs as many keys as queries, got {q.shape[1]} and {k.shape[1]}")
    # per_shard: per head shard where XLA cannot partition the call (inside the 1F1B pipeline's stages)
    heads, kv_heads = ("act_batch", "act_seq", "act_heads", None), ("act_batch", "act_seq", "act_kv_heads", None)
    if docs is None:
        out = per_shard(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
                        (q, k, v), (heads, kv_heads, kv_heads), heads)
        return checkpoint_name(out, "attn_out")
    if docs.lengths is None:
        raise ConfigError("config field `model.attention`: cudnn takes one document per row only "
                          "(data.batching=document), not packed rows; use chunked, xla or auto")
    out = per_shard(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn", query_seq_lengths=n, key_value_seq_lengths=n),
        (q, k, v, docs.lengths), (heads, kv_heads, kv_heads, ("act_batch",)), heads)
    return checkpoint_name(out, "attn_out")


# ------------------------------------------------------------------------------------------- module

class Attention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, param_dtype, placement=LOCAL):
        d, h, kv = cfg.d_model, cfg.n_heads, cfg.n_kv_heads
        self.n_heads, self.n_kv_heads, self.head_dim = h, kv, d // h
        self.rope_theta = cfg.rope_theta
        self.grouped = bool(cfg.group_linears)
        self.impl = cfg.attention
        proj = dict(rngs=rngs, param_dtype=param_dtype)
        self.q = Projection(cfg, d, h * self.head_dim, axes=("embed", "heads"), group="qkv", **proj)
        self.k = Projection(cfg, d, kv * self.head_dim, axes=("embed", "kv_heads"), group="qkv", **proj)
        self.v = Projection(cfg, d, kv * self.head_dim, axes=("embed", "kv_heads"), group="qkv", **proj)
        self.o = Projection(cfg, h * self.head_dim, d, axes=("heads", "embed"), group="o", **proj)
        factored = kind_class(cfg.linear).factored
        self.qkv_route, self.o_route = (placement.group(g, factored) for g in ("qkv", "o"))
        self.context = placement.context()  # None, or the sequence split over `context`

    def __call__(self, x, norm, positions, cache=None, docs: Documents | None = None):
        """x: the block's input residual; `norm` is applied first (fused with the A's under BTP).
        Without a cache the tokens sit at positions 0..T-1 (RoPE uses `positions`) and `docs`, if
        given, keeps every query inside its document; decoding with a cache ignores it."""
        b, t, _ = x.shape
        if self.context is not None and self.context.passes_bottleneck and cache is None:
            return self._bottleneck_ring(x, norm, positions, docs), cache
        q, k, v = project([self.q, self.k, self.v], x, grouped=self.grouped, norm=norm, route=self.qkv_route)
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        k = k.reshape(b, t, self.n_kv_heads, self.head_dim)
        v = v.reshape(b, t, self.n_kv_heads, self.head_dim)
        q = constrain(rope(q, positions, self.rope_theta), ("act_batch", "act_seq", "act_heads", None))
        k = constrain(rope(k, positions, self.rope_theta), ("act_batch", "act_seq", "act_kv_heads", None))
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
        q, (hk, bk), (hv, bv) = project([self.q, self.k, self.v], x, grouped=self.grouped, norm=norm,
                                        route=self.qkv_route, keep=(self.k, self.v))
        q = q.reshape(b, t, self.n_heads, self.head_dim)
        q = constrain(rope(q, positions, self.rope_theta), ("act_batch", "act_seq", "act_heads", None))
        hk, hv = (constrain(h, ("act_batch", "act_seq", "act_rank")) for h in (hk, hv))
        rebuild = functools.partial(rebuild_kv, self.head_dim, self.rope_theta)
        out = self.context.attend_bottleneck(q, hk, hv, (bk, bv), positions, None if docs is None else docs.segments,
                                             blockwise(self.impl), rebuild)
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
