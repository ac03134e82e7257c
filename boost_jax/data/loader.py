"""Deterministic, stateless batch loaders over one or more token arrays, and mixtures of them.

The stream is cut into non-overlapping windows of seq_len+1 tokens. Sample i of the run is window
perm_e[i mod n] of epoch e = i // n, with perm_e a permutation seeded by (seed, e). A batch is
therefore a pure function of its position (samples consumed so far): resuming needs one integer,
and every process computes its own rows of the same global batch. A mixture keeps that property:
which source sample i comes from, and that source's own sample index, are pure functions of i.
"""
from __future__ import annotations

import numpy as np


class TokenLoader:
    def __init__(self, segments: list[np.ndarray], *, seq_len: int, global_batch: int, seed: int | tuple,
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
                self._perm = np.random.default_rng([*np.atleast_1d(self.seed), epoch]).permutation(self.n)
                self._perm_epoch = epoch
            j = int(self._perm[j])
        seg = int(np.searchsorted(self.starts, j, side="right") - 1)
        off = (j - int(self.starts[seg])) * self.window
        return np.asarray(self.segments[seg][off:off + self.window])

    def windows(self, ids) -> np.ndarray:
        """Samples `ids` of the run as int32 rows of seq_len+1 tokens, checked against the vocabulary."""
        out = np.stack([self._window(i) for i in ids]).astype(np.int32)
        top = int(out.max())
        if top >= self.vocab_size or int(out.min()) < 0:
            raise ValueError(f"{self.name}: token id {top} is outside [0, model.vocab_size={self.vocab_size}); "
                             "the data was tokenized for a larger vocabulary: raise model.vocab_size "
                             "or check data.token_dtype")
        return out

    def batch(self, position: int) -> np.ndarray:
        """This process's rows of the global batch that starts at sample `position`: [rows, seq+1]."""
        return self.windows(range(position + self.rows.start, position + self.rows.stop))

    def source_tokens(self, position: int) -> dict:
        """Tokens trained on per source by `position` (only mixtures have several sources)."""
        return {}


MIX_BLOCK = 1 << 16  # a mixture's schedule repeats its per-source quotas every MIX_BLOCK samples
_MIX_SALT = 0x6D6978  # keeps the mixture's random stream apart from the sources' permutations


class MixtureLoader:
    """Samples drawn from several TokenLoaders with fixed weights, deterministically.

    The run is cut into blocks of MIX_BLOCK samples. Source k owns q_k samples of every block (the
    weights apportioned by largest remainder, so its long-run fraction is q_k / MIX_BLOCK, within
    1/MIX_BLOCK of its weight) and gets the m-th of them at key (m + u) / q_k, u ~ U[0, 1) seeded by
    (seed, block); sorting the keys interleaves the sources, so every prefix of a block holds each
    source's share to within two samples (a batch: four). Source k's own sample index for its m-th
    slot of block b is b * q_k + m: a pure function of the global position, so resuming needs no
    extra state.
    """

    def __init__(self, loaders: list[TokenLoader], weights, names: list[str], *, seed: int, global_batch: int,
                 process_index: int = 0, process_count: int = 1):
        w = np.asarray(weights, dtype=np.float64)
        exact = w / w.sum() * MIX_BLOCK
        quota = np.floor(exact).astype(np.int64)
        quota[np.argsort(quota - exact, kind="stable")[: MIX_BLOCK - int(quota.sum())]] += 1
        if (quota == 0).any():
            raise ValueError(f"mixture weights {list(weights)}: each must be at least 1/{MIX_BLOCK} of the total")
        self.loaders, self.names, self.quota, self.seed = loaders, names, quota, seed
        self.seq_len = loaders[0].window - 1
        self.rows = slice(process_index * global_batch // process_count,
                          (process_index + 1) * global_batch // process_count)
        self._block_id, self._source, self._rank = -1, None, None

    def _block(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank within its source) of each sample of block b."""
        if b != self._block_id:
            m = np.concatenate([np.arange(q) for q in self.quota])
            u = np.random.default_rng([self.seed, _MIX_SALT, b]).random(MIX_BLOCK)
            order = np.argsort((m + u) / np.repeat(self.quota, self.quota), kind="stable")
            self._source = np.repeat(np.arange(len(self.quota)), self.quota)[order]
            self._rank, self._block_id = m[order], b
        return self._source, self._rank

    def sample(self, i: int) -> tuple[int, int]:
        """(source, that source's sample index) of the run's sample i."""
        b, r = divmod(i, MIX_BLOCK)
        source, rank = self._block(b)
        k = int(source[r])
        return k, b * int(self.quota[k]) + int(rank[r])

    def batch(self, position: int) -> np.ndarray:
        picks = [self.sample(i) for i in range(position + self.rows.start, position + self.rows.stop)]
        return np.concatenate([self.loaders[k].windows([j]) for k, j in picks])

    def source_tokens(self, position: int) -> dict:
        """{"tokens/NAME": tokens trained on from that source in the run's first `position` samples}."""
        b, r = divmod(position, MIX_BLOCK)
        samples = b * self.quota + np.bincount(self._block(b)[0][:r], minlength=len(self.quota))
        return {f"tokens/{name}": int(n) * self.seq_len for name, n in zip(self.names, samples)}
