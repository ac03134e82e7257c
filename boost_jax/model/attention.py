"""Rotary embeddings and causal multi-head / grouped-query attention with an optional KV cache.

Every attention in the project runs through `attend`, which picks an implementation by the name in
`model.attention` from `IMPLEMENTATIONS`. All of them compute the same causal attention:

    query t sits at position `offset + t`, key s at position s; key s is visible iff s <= offset + t.

Training (and the pipeline) call it with offset 0 and as many keys as queries; a KV cache calls it
with the cache's keys (unwritten slots lie ahead of every query, so causality hides them) and the
offset of the first new token. q: [B, T, H, Dh], k/v: [B, S, KV, Dh] with H a multiple of KV (GQA).

- xla: scores as one float32 einsum [B, KV, G, T, S], softmax, einsum (the reference).
- chunked: blockwise attention with an online softmax in plain JAX (FlashAttention-2's algorithm,
  forward and backward): no [T, S] matrix, key blocks wholly above the diagonal are never visited,
  memory O(T). Runs on any backend.
- pallas: the Pallas flash-attention kernel of `jax.experimental.pallas.ops.gpu.attention`
  (Triton-lowered; the interpreter on CPU). GQA repeats k/v heads; lengths are padded to the block.
- cudnn: `jax.nn.dot_product_attention(implementation="cudnn")`, bf16/fp16 on an NVIDIA GPU.
- auto: cudnn on a GPU in bf16/fp16 (head dim a multiple of 8, at most 128), else xla up to
  `AUTO_XLA_MAX_KEYS` keys, else chunked.

A decode step (a traced offset) runs `chunked` under the fused kernels, which take offset 0 only.
The attention output is tagged `attn_out` (and, where the implementation keeps one, its float32
log-sum-exp `attn_lse`: chunked, pallas) for the remat policies (`boost_jax/model/remat.py`). Adding an
implementation is one function `fn(q, k, v, offset) -> out` registered with
`@implementation("name", cost=..., fused=...)`, here or from any module: config validation, the
trainer, the comm report and the planner (which prices it as its `cost` class) read the registry.
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
from boost_jax.model.kinds import kind_class
from boost_jax.model.linear import Projection, project
from boost_jax.parallel.placement import LOCAL
from boost_jax.parallel.rules import constrain

IMPLEMENTATIONS: dict = {}  # name -> Implementation
AUTO_XLA_MAX_KEYS = 1024  # auto: below this many keys the one-einsum reference is cheaper
CHUNK = 512  # chunked: query and key block length
_NEG = -1e30  # masked score: finite, so a row's running max never becomes -inf


# How the planner prices an implementation (boost_jax/planner/cost.py `attention_seconds`): scores
# materialised in HBM, blockwise in plain JAX (chunked), or a fused flash kernel.
COST_CLASSES = ("materialized", "chunked", "flash")


@dataclasses.dataclass(frozen=True)
class Implementation:
    fn: Callable  # fn(q, k, v, offset) -> out [B, T, H, Dh]
    cost: str  # one of COST_CLASSES
    fused: bool = False  # a fused kernel taking offset 0 only: decode steps (a traced offset) run `chunked`


def implementation(name: str, *, cost: str, fused: bool = False):
    """Register `fn(q, k, v, offset)` as `model.attention=name`, priced by the planner as `cost`."""
    if cost not in COST_CLASSES:
        raise ValueError(f"attention implementation {name!r}: cost {cost!r} is not one of {COST_CLASSES}")

    def register(fn):
        IMPLEMENTATIONS[name] = Implementation(fn, cost, fused)
        return fn

    return register


def names() -> tuple[str, ...]:
    """Every value `model.attention` takes."""
    return ("auto", *IMPLEMENTATIONS)


def cost_class(name: str) -> str:
    """How the planner prices implementation `name` (not `auto`: resolve it first)."""
    return IMPLEMENTATIONS[name].cost


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


def auto_impl(on_gpu: bool, half: bool, head_dim: int, queries: int, keys: int) -> str:
    """What `auto` runs: cudnn on a GPU in bf16/fp16 where cuDNN's fused kernel takes the shapes
    (head dim a multiple of 8, at most 128, as many keys as queries), else xla up to
    AUTO_XLA_MAX_KEYS keys, else chunked. (The planner prices plans with it.)"""
    if on_gpu and half and head_dim % 8 == 0 and head_dim <= 128 and keys == queries:
        return "cudnn"
    return "xla" if keys <= AUTO_XLA_MAX_KEYS else "chunked"


def resolve(impl: str, q, k, offset) -> str:
    """The implementation `impl` runs as for these shapes on this backend."""
    fused_ok = _static_zero(offset)
    if impl == "auto":
        return auto_impl(fused_ok and jax.default_backend() == "gpu", q.dtype in (jnp.bfloat16, jnp.float16),
                         q.shape[-1], q.shape[1], k.shape[1])
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"config field `model.attention`: {impl!r} is not one of {names()}")
    if IMPLEMENTATIONS[impl].fused and not fused_ok:
        return "chunked"
    return impl


def attend(q, k, v, *, offset=0, impl: str = "xla"):
    """Causal attention (see the module docstring) -> [B, T, H * Dh] in q's dtype."""
    b, t, h, dh = q.shape
    return IMPLEMENTATIONS[resolve(impl, q, k, offset)].fn(q, k, v, offset).reshape(b, t, h * dh)


def _grouped(q, kv):
    b, t, h, dh = q.shape
    return q.reshape(b, t, kv, h // kv, dh)


def _visible(t, s, offset):
    return (offset + jnp.arange(t))[:, None] >= jnp.arange(s)[None, :]


@implementation("xla", cost="materialized")
def xla_attention(q, k, v, offset):
    """Float32 scores [B, KV, G, T, S], masked softmax, weighted sum; k/v are never repeated."""
    dh, t, s = q.shape[-1], q.shape[1], k.shape[1]
    qg = _grouped(q, k.shape[2])
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * dh ** -0.5
    scores = jnp.where(_visible(t, s, offset), scores, jnp.finfo(jnp.float32).min)
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


def _block_scores(qi, kj, i, j, bq, bk, offset, s_len, scale):
    """Masked float32 scores [B, KV, G, bq, bk] of query block i against key block j."""
    s = jnp.einsum("bkgqd,bksd->bkgqs", qi, kj, preferred_element_type=jnp.float32) * scale
    qpos = offset + i * bq + jnp.arange(bq)
    kpos = j * bk + jnp.arange(bk)
    mask = (qpos[:, None] >= kpos[None, :]) & (kpos < s_len)[None, :]
    return jnp.where(mask, s, _NEG)


def _first_visible_q_block(j, bq, bk, offset):
    """The first query block whose last query sees key block j's first key."""
    return jnp.maximum(j * bk - offset - (bq - 1), 0) // bq


def _n_visible_k_blocks(i, bq, bk, offset, nk):
    """Key blocks query block i sees: those starting at or before its last query's position."""
    return jnp.minimum((offset + (i + 1) * bq - 1) // bk + 1, nk)


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


def _chunked_fwd(q, k, v, offset, block):
    """(out [B,T,H,D] in q.dtype, lse [nq, B, KV, G, bq] float32)."""
    qb, kb, vb, (bq, nq, bk, nk) = _layout(q, k, v, block)
    scale = q.shape[-1] ** -0.5
    s_len = k.shape[1]

    def q_block(i):
        qi = qb[i]

        def k_block(j, carry):
            m, l, acc = carry
            s = _block_scores(qi, kb[j], i, j, bq, bk, offset, s_len, scale)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            acc = acc * corr[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", p.astype(vb.dtype), vb[j],
                                                     preferred_element_type=jnp.float32)
            return m_new, l * corr + p.sum(-1), acc

        stats = jnp.full(qi.shape[:-1], _NEG, jnp.float32)
        init = (stats, jnp.zeros_like(stats), jnp.zeros(qi.shape, jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, _n_visible_k_blocks(i, bq, bk, offset, nk), k_block, init)
        return (acc / l[..., None]).astype(q.dtype), m + jnp.log(l)

    out, lse = jax.lax.map(q_block, jnp.arange(nq))
    return _unlayout_q(out, q.shape), lse


def _chunked_bwd(q, k, v, out, lse, dout, offset, block):
    qb, kb, vb, (bq, nq, bk, nk) = _layout(q, k, v, block)
    ob, dob = (_layout(x, k, v, block)[0] for x in (out, dout))
    scale = q.shape[-1] ** -0.5
    s_len = k.shape[1]
    # delta_i = Σ_d dO·O (FlashAttention-2's row term); padded rows have dO = 0 and add nothing.
    delta = jnp.einsum("nbkgqd,nbkgqd->nbkgq", dob.astype(jnp.float32), ob.astype(jnp.float32))

    def probs(i, j):
        s = _block_scores(qb[i], kb[j], i, j, bq, bk, offset, s_len, scale)
        p = jnp.exp(s - lse[i][..., None])
        dp = jnp.einsum("bkgqd,bksd->bkgqs", dob[i], vb[j], preferred_element_type=jnp.float32)
        return p, p * (dp - delta[i][..., None])

    def dq_block(i):
        def k_block(j, dq):
            _, ds = probs(i, j)
            return dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, kb[j].astype(jnp.float32)) * scale

        return jax.lax.fori_loop(0, _n_visible_k_blocks(i, bq, bk, offset, nk), k_block,
                                 jnp.zeros(qb.shape[1:], jnp.float32))

    def dkv_block(j):
        def q_block(i, carry):
            dk, dv = carry
            p, ds = probs(i, j)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, dob[i].astype(jnp.float32))
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, qb[i].astype(jnp.float32)) * scale
            return dk, dv

        zeros = jnp.zeros(kb.shape[1:], jnp.float32)
        return jax.lax.fori_loop(_first_visible_q_block(j, bq, bk, offset), nq, q_block, (zeros, zeros))

    dq = _unlayout_q(jax.lax.map(dq_block, jnp.arange(nq)), q.shape).astype(q.dtype)
    dk, dv = jax.lax.map(dkv_block, jnp.arange(nk))
    b, s, kv, dh = k.shape
    unk = lambda x: x.transpose(1, 0, 3, 2, 4).reshape(b, nk * bk, kv, dh)[:, :s].astype(k.dtype)  # noqa: E731
    return dq, unk(dk), unk(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunked(q, k, v, offset, block):
    return _chunked_fwd(q, k, v, offset, block)[0]


def _chunked_vjp_fwd(q, k, v, offset, block):
    out, lse = _chunked_fwd(q, k, v, offset, block)
    out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")
    return out, (q, k, v, offset, out, lse)


def _chunked_vjp_bwd(block, res, dout):
    q, k, v, offset, out, lse = res
    dq, dk, dv = _chunked_bwd(q, k, v, out, lse, dout, offset, block)
    return dq, dk, dv, None


_chunked.defvjp(_chunked_vjp_fwd, _chunked_vjp_bwd)


@implementation("chunked", cost="chunked")
def chunked_attention(q, k, v, offset, block: int | None = None):
    return _chunked(q, k, v, jnp.asarray(offset, jnp.int32), block or CHUNK)


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


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pallas(q, k, v, block, interpret):
    return _pallas_fwd(q, k, v, block, interpret)[0]


def _pallas_blocks(block):
    mod = _pallas_mha_module()
    return mod.BlockSizes(block_q=block, block_k=block, block_q_dkv=block, block_kv_dkv=block,
                          block_q_dq=block, block_kv_dq=block)


def _pallas_fwd(q, k, v, block, interpret):
    mod = _pallas_mha_module()
    out, lse = mod.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5, causal=True, block_sizes=_pallas_blocks(block),
                       interpret=interpret, return_residuals=True)
    out, lse = checkpoint_name(out, "attn_out"), checkpoint_name(lse, "attn_lse")
    return out, (q, k, v, out, lse)


def _pallas_bwd(block, interpret, res, dout):
    mod = _pallas_mha_module()
    q, k, v, out, lse = res
    # The module's own backward kernels (dq and dk/dv), fed the residuals saved above.
    dq, dk, dv, _ = mod._mha_backward(q.shape[-1] ** -0.5, True, _pallas_blocks(block), "triton", None, 2, None,
                                      interpret, False, False, (q, k, v, None, out, lse), dout)
    return dq, dk, dv


_pallas.defvjp(lambda q, k, v, block, interpret: _pallas_fwd(q, k, v, block, interpret), _pallas_bwd)


@implementation("pallas", cost="flash", fused=True)
def pallas_attention(q, k, v, offset, block: int | None = None, interpret: bool | None = None):
    """Training shapes only (offset 0, S == T); lengths are zero-padded to a power-of-two block
    (padded keys lie after every real query, so causality hides them)."""
    b, t, h, dh = q.shape
    if k.shape[1] != t:
        raise ValueError(f"pallas attention needs as many keys as queries, got {t} and {k.shape[1]}")
    block = block or min(64, 1 << max(4, math.ceil(math.log2(t))))
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    g = h // k.shape[2]
    tp = -(-t // block) * block
    qp, kp, vp = (_pad_to(x, 1, tp) for x in (q, jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)))
    mod = _pallas_mha_module()
    if not _private_backward_ok(mod):
        warnings.warn(f"pallas attention: jax {jax.__version__} changed the private _mha_backward of "
                      "jax.experimental.pallas.ops.gpu.attention; running its public mha (same kernels; "
                      "remat cannot keep attn_lse)", stacklevel=2)
        out = mod.mha(qp, kp, vp, None, sm_scale=dh ** -0.5, causal=True, block_sizes=_pallas_blocks(block),
                      interpret=bool(interpret))
        return checkpoint_name(out, "attn_out")[:, :t]
    return _pallas(qp, kp, vp, block, bool(interpret))[:, :t]


# -------------------------------------------------------------------------------------------- cudnn

@implementation("cudnn", cost="flash", fused=True)
def cudnn_attention(q, k, v, offset):
    if jax.default_backend() != "gpu":
        raise ConfigError(f"config field `model.attention`: cudnn needs an NVIDIA GPU (this backend is "
                          f"{jax.default_backend()!r}); use chunked, xla or auto")
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ConfigError(f"config field `model.attention`: cudnn runs bfloat16/float16, the model computes in "
                          f"{q.dtype}; set model.dtype=bfloat16 (or model.attention=chunked)")
    if k.shape[1] != q.shape[1]:
        raise ValueError(f"cudnn attention needs as many keys as queries, got {q.shape[1]} and {k.shape[1]}")
    return checkpoint_name(jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"), "attn_out")


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

    def __call__(self, x, norm, positions, cache=None):
        """x: the block's input residual; `norm` is applied first (fused with the A's under BTP).
        Without a cache the tokens sit at positions 0..T-1 (RoPE uses `positions`)."""
        b, t, _ = x.shape
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
        out = attend(q, k, v, offset=offset, impl=self.impl)
        out = constrain(out, ("act_batch", "act_seq", "act_heads"))
        return project([self.o], out, grouped=False, route=self.o_route)[0], cache
