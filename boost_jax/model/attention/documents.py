"""Where the documents of each row lie (`Documents`): what the implementations mask by when rows hold
several documents (data.batching=packed) or one document then padding (data.batching=document)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


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
