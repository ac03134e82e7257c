"""A deterministic, stateless batch loader over one or more token arrays.

The stream is cut into non-overlapping windows of seq_len+1 tokens. Sample i of the run is window
perm_e[i mod n] of epoch e = i // n, with perm_e a permutation seeded by (seed, e). A batch is
therefore a pure function of its position (samples consumed so far): resuming needs one integer,
and every process computes its own rows of the same global batch.
"""
from __future__ import annotations

import numpy as np


class TokenLoader:
    def __init__(self, segments: list[np.ndarray], *, seq_len: int, global_batch: int, seed: int,
                 vocab_size: int, name: str, process_index: int = 0, process_count: int = 1, shuffle=True):
        self.window = seq_len + 1
        self.segments = [s for s in segments if len(s) >= self.window]
        counts = np.array([len(s) // self.window for s in self.segments], dtype=np.int64)
        self.n = int(counts.sum())
        if self.n == 0:
            total = sum(len(s) for s in segments)
            raise ValueError(f"{name}: {total} tokens cannot fill one window of train.seq_len+1 = "
                             f"{self.window} tokens; add data or shorten train.seq_len")
        if global_batch % process_count:
            raise ValueError(f"train.global_batch={global_batch} is not divisible by {process_count} processes")
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        self.global_batch, self.seed, self.vocab_size, self.name = global_batch, seed, vocab_size, name
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        self.shuffle = shuffle
        self._perm_epoch, self._perm = -1, None

    def _window(self, i: int) -> np.ndarray:
        epoch, j = divmod(i, self.n)
        if self.shuffle:
            if epoch != self._perm_epoch:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n)
                self._perm_epoch = epoch
            j = int(self._perm[j])
        seg = int(np.searchsorted(self.starts, j, side="right") - 1)
        off = (j - int(self.starts[seg])) * self.window
        return np.asarray(self.segments[seg][off:off + self.window])

    def batch(self, position: int) -> np.ndarray:
        """This process's rows of the global batch that starts at sample `position`: [rows, seq+1]."""
        ids = range(position + self.rows.start, position + self.rows.stop)
        out = np.stack([self._window(i) for i in ids]).astype(np.int32)
        top = int(out.max())
        if top >= self.vocab_size or int(out.min()) < 0:
            raise ValueError(f"{self.name}: token id {top} is outside [0, model.vocab_size={self.vocab_size}); "
                             "the data was tokenized for a larger vocabulary: raise model.vocab_size "
                             "or check data.token_dtype")
        return out
