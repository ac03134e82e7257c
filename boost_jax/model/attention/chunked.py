"""`chunked`: blockwise attention with an online softmax in plain JAX (FlashAttention-2's algorithm,
forward and a hand-written backward): no [T, S] matrix, key blocks wholly above the diagonal never
visited, and with documents the blocks outside every row's documents skipped. Its block form
(`Blockwise`) is what context parallelism runs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from boost_jax.model.attention.documents import Documents
from boost_jax.model.attention.registry import CHUNK, Blockwise, implementation
from boost_jax.model.attention.xla import query_groups

_NEG = -1e30  # masked score: finite, so a row's running max never becomes -inf


def _blocks(n, block):
    """(block length, number of blocks) covering n."""
    block = min(block, n)
    return block, -(-n // block)


def pad_to(x, axis, length):
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
    first = pad_to(docs.first_key, 0, nq * bq).at[t:].set(s).reshape(nq, bq).min(1) // bk
    last = pad_to(docs.last_query, 0, nk * bk).at[s:].set(-1).reshape(nk, bk).max(1)
    return first, jnp.minimum(last // bq + 1, nq)


def _segment_blocks(docs, bq, nq, bk, nk):
    """Segment ids by block: queries [nq, B, bq], keys [nk, B, bk] (padding: id 0, hidden by s_len)."""
    seg = docs.segments
    keys = seg if docs.key_segments is None else docs.key_segments
    b = seg.shape[0]
    return (
        pad_to(seg, 1, nq * bq).reshape(b, nq, bq).transpose(1, 0, 2),
        pad_to(keys, 1, nk * bk).reshape(b, nk, bk).transpose(1, 0, 2),
    )


def _layout(q, k, v, block):
    """q [B,T,H,D] -> [nq, B, KV, G, bq, D]; k, v [B,S,KV,D] -> [nk, B, KV, bk, D] (zero padded)."""
    b, t, h, dh = q.shape
    s, kv = k.shape[1], k.shape[2]
    bq, nq = _blocks(t, block)
    bk, nk = _blocks(s, block)
    qb = pad_to(query_groups(q, kv), 1, nq * bq).reshape(b, nq, bq, kv, h // kv, dh).transpose(1, 0, 3, 4, 2, 5)
    kb, vb = (pad_to(x, 1, nk * bk).reshape(b, nk, bk, kv, dh).transpose(1, 0, 3, 2, 4) for x in (k, v))
    return qb, kb, vb, (bq, nq, bk, nk)


def _unlayout_q(x, q_shape):
    """[nq, B, KV, G, bq, D] -> [B, T, H, D] (padding dropped)."""
    nq, b, kv, g, bq, dh = x.shape
    return x.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, kv * g, dh)[:, : q_shape[1]]


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
            acc = acc * corr[..., None] + jnp.einsum(
                "bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb[j], preferred_element_type=jnp.float32
            )
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
        return jax.lax.fori_loop(
            start, _n_visible_k_blocks(i, bq, bk, offset, nk), k_block, jnp.zeros(qb.shape[1:], jnp.float32)
        )

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
    return Documents(
        q_seg,
        jnp.zeros((tq,), jnp.int32),
        jnp.full((tk,), tq - 1, jnp.int32),
        key_segments=jnp.asarray(k_seg, jnp.int32),
    )


def _lse_rows(lse, b: int, t: int):
    """chunked's lse [nq, B, KV, G, bq] -> [B, T, H]."""
    nq, _, kv, g, bq = lse.shape
    return lse.transpose(1, 0, 4, 2, 3).reshape(b, nq * bq, kv * g)[:, :t]


def _lse_blocks(lse, kv: int, block: int):
    """[B, T, H] -> chunked's lse layout [nq, B, KV, G, bq] (padded rows: 0, their dO is 0)."""
    b, t, h = lse.shape
    bq, nq = _blocks(t, block)
    return pad_to(lse, 1, nq * bq).reshape(b, nq, bq, kv, h // kv).transpose(1, 0, 3, 4, 2)


def _chunked_block_fwd(q, k, v, offset, q_seg, k_seg):
    out, lse = _chunked_fwd(q, k, v, jnp.asarray(offset, jnp.int32), _pair_documents(q_seg, k_seg), CHUNK, jnp.float32)
    return out, _lse_rows(lse, q.shape[0], q.shape[1])


def _chunked_block_bwd(q, k, v, out, lse, dout, offset, q_seg, k_seg):
    return _chunked_bwd(
        q,
        k,
        v,
        out,
        _lse_blocks(lse, k.shape[2], CHUNK),
        dout,
        jnp.asarray(offset, jnp.int32),
        _pair_documents(q_seg, k_seg),
        CHUNK,
        wide=True,
    )


@implementation(
    "chunked",
    cost="chunked",
    documents=("segments", "lengths"),
    blockwise=Blockwise(_chunked_block_fwd, _chunked_block_bwd),
)
def chunked_attention(q, k, v, offset, block: int | None = None, *, docs: Documents | None = None):
    return _chunked(q, k, v, jnp.asarray(offset, jnp.int32), docs, block or CHUNK)
