"""What the model reads from a batch (boost_jax/data/loader.py makes them, per `data.batching`):

- stream: int32 tokens [..., B, T+1]; every position is a token, every next token a target.
- document: {"tokens": [..., B, T+1], "lengths": [..., B]}: one document per row, padding after it.
- packed: {"tokens", "segments", "positions"}, each [..., B, T+1]: segment id per position (0:
  padding) and the position within its document piece (RoPE restarts there).
- stream rows with padding rows: {"tokens": [..., B, T+1], "rows": bool [..., B]}: a row counts
  only where `rows` is true (an evaluation's last, partial batch; runtime/evaluation.py).

Inputs are the first T columns, targets the last T; a target counts only if it continues its
input's document (the padding and the token that would cross into the next document do not).
"""

from __future__ import annotations

import jax.numpy as jnp


def is_documents(batch) -> bool:
    return isinstance(batch, dict)


def tokens_of(batch):
    return batch["tokens"] if is_documents(batch) else batch


def target_mask(batch):
    """bool [..., B, T]: which targets count (None: all of them, a stream batch)."""
    if not is_documents(batch):
        return None
    if "rows" in batch:
        return _row_mask(batch)
    if "segments" in batch:
        seg = batch["segments"]
        return (seg[..., 1:] == seg[..., :-1]) & (seg[..., 1:] != 0)
    t = batch["tokens"].shape[-1] - 1
    return jnp.arange(t) + 1 < batch["lengths"][..., None]


def input_mask(batch):
    """bool [..., B, T]: which inputs are tokens rather than padding (None: all of them)."""
    if not is_documents(batch):
        return None
    if "rows" in batch:
        return _row_mask(batch)
    if "segments" in batch:
        return batch["segments"][..., :-1] != 0
    t = batch["tokens"].shape[-1] - 1
    return jnp.arange(t) < batch["lengths"][..., None]


def _row_mask(batch):
    """bool [..., B, T]: every position of the rows that count."""
    t = batch["tokens"].shape[-1] - 1
    return jnp.broadcast_to(batch["rows"][..., None], (*batch["rows"].shape, t))


def counts(batch) -> tuple:
    """(input tokens that are not padding, targets that count), as int32 scalars."""
    tokens = tokens_of(batch)
    if not is_documents(batch):
        n = tokens[..., :-1].size
        return jnp.int32(n), jnp.int32(n)
    return input_mask(batch).sum(dtype=jnp.int32), target_mask(batch).sum(dtype=jnp.int32)
