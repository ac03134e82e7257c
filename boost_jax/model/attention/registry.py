"""The attention registry: `@implementation(name, cost=..., fused=..., documents=..., blockwise=...)`
registers `fn(q, k, v, offset)` as `model.attention=name`; `attend` runs the one `resolve` picks (see
the package docstring). The planner prices each implementation by its cost class (COST_CLASSES);
config validation, the trainer and the comm report ask the functions below about names."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax.numpy as jnp

from boost_jax.errors import ConfigError
from boost_jax.kernels import platform
from boost_jax.model.attention.documents import Documents

IMPLEMENTATIONS: dict = {}  # name -> Implementation
AUTO_XLA_MAX_KEYS = 1024  # auto: below this many keys the one-einsum reference is cheaper
CHUNK = 512  # chunked: query and key block length


@dataclasses.dataclass(frozen=True)
class CostClass:
    """How the planner prices an implementation (boost_jax/planner: cost.attention_seconds, the time;
    planner/ops/cores.py, what the backward keeps), described without hardware. Scores either pass
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
COST_CLASSES: dict = {
    c.name: c
    for c in (
        # Scores materialised: the forward writes the float32 scores, reads them for the softmax, writes the
        # probabilities, reads them for P·V (12 bytes); the backward reads/writes dP, dS, P (16). Kept: the
        # float32 exp and softmax per score (+ the probabilities in the compute dtype when that is not float32).
        CostClass("materialized", backward=2, score_bytes=(12, 16), kept=4, kept_scores=2),
        # Blocks of 512 queries x 512 keys (`chunked.py`): each block's scores pass through HBM as above,
        # and the backward recomputes them twice (its dQ pass and its dK/dV pass: 7 block GEMMs against the
        # forward's 2, twice the score traffic).
        CostClass("chunked", backward=3.5, score_bytes=(12, 32), block=CHUNK, kept=5),
        # FlashAttention: its backward runs 5 GEMMs (scores recomputed) against the forward's 2; the GPU
        # program keeps q, k, v, the output and its [B, T, q] view (and the log-sum-exp): llama_7b megatron
        # on 8 H100 stacks bf16[L, B, T, h/8, hd] x 4 and bf16[L, B, T, q/8].
        CostClass("flash", backward=2.5, fused=True, kept=5),
    )
}
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


def implementation(name: str, *, cost, fused: bool = False, documents: tuple = (), blockwise: Blockwise | None = None):
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
        raise ConfigError(
            f"config field `model.attention`: {name} cannot run with the sequence split over "
            f"parallel.context; set model.attention to one of {able}"
        )
    return IMPLEMENTATIONS[under_context(name)].blockwise


def takes_documents(name: str, kind: str) -> bool:
    """Whether `model.attention=name` masks documents given as `kind` ("segments": any rows;
    "lengths": one document per row). `auto` always picks one that does."""
    if kind not in DOCUMENT_KINDS:
        raise ValueError(f"document kind {kind!r} is not one of {DOCUMENT_KINDS}")
    return name == "auto" or (name in IMPLEMENTATIONS and kind in IMPLEMENTATIONS[name].documents)


def _static_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0


def masks(name: str, kind: str) -> bool:
    """Whether `name` masks documents of `kind` (Documents.kind): lengths rows carry segments too."""
    return any(takes_documents(name, k) for k in (DOCUMENT_KINDS if kind == "lengths" else ("segments",)))


def auto_impl(on_gpu: bool, half: bool, head_dim: int, queries: int, keys: int, documents: str | None = None) -> str:
    """What `auto` runs: cudnn on a GPU in bf16/fp16 where cuDNN's fused kernel takes the shapes
    (head dim at most 128 once padded to a multiple of 8, as many keys as queries), else xla up to
    AUTO_XLA_MAX_KEYS keys, else chunked. `documents`: None (no documents), "lengths" (one document
    per row) or "segments" (packed rows: cudnn is out). (The planner prices plans with it.)"""
    cudnn_ok = documents is None or masks("cudnn", documents)
    if on_gpu and half and -(-head_dim // 8) * 8 <= 128 and keys == queries and cudnn_ok:
        return "cudnn"
    return "xla" if keys <= AUTO_XLA_MAX_KEYS else "chunked"


def resolve(impl: str, q, k, offset, docs: Documents | None = None) -> str:
    """The implementation `impl` runs as for these shapes (and documents) on this backend."""
    fused_ok = _static_zero(offset)
    kind = None if docs is None else docs.kind
    if impl == "auto":
        shape = (
            fused_ok and platform.name() == "gpu",
            q.dtype in (jnp.bfloat16, jnp.float16),
            q.shape[-1],
            q.shape[1],
            k.shape[1],
        )
        name = auto_impl(*shape, documents=kind)
        if kind == "segments" and name != auto_impl(*shape) and name not in _WARNED:  # said only when it differs
            _WARNED.add(name)
            warnings.warn(
                f"model.attention=auto: packed rows (data.batching=packed) run {name}; "
                "cudnn takes one document per row only",
                stacklevel=3,
            )
        return name
    if impl not in IMPLEMENTATIONS:
        raise ConfigError(f"config field `model.attention`: {impl!r} is not one of {names()}")
    if kind is not None and not masks(impl, kind):
        able = ", ".join(n for n in names() if masks(n, kind))
        batching = "packed" if kind == "segments" else "document"
        raise ConfigError(
            f"config field `model.attention`: {impl} cannot mask the documents of "
            f"data.batching={batching}; set model.attention to one of {able} (or data.batching=stream)"
        )
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
        raise ValueError(
            f"attention with documents needs offset 0 and segments [B, T] = {[b, t]} for as many "
            f"keys as queries, got offset {offset}, {k.shape[1]} keys, segments {docs.segments.shape}"
        )
    return fn(q, k, v, offset, docs=docs).reshape(b, t, h * dh)
