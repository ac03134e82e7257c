"""Deterministic, stateless batch loaders over one or more token arrays, and mixtures of them.

A loader serves *samples*: sample i of the run is unit order_e[i mod n] of epoch e = i // n, with
order_e a permutation of the n units seeded by (seed, e) (`data.shuffle`: the stateless Feistel
permutation of boost_jax/data/shuffle.py, or the materialised numpy permutation that checkpoints
written before `data.shuffle` used). A batch is therefore a pure function of its position (samples
consumed so far): resuming needs one integer, and every process computes its own rows of the same
global batch. A unit, by `data.batching` (each loader's docstring has the details):

- stream (`TokenLoader`): a window of seq_len+1 tokens of the concatenated stream, int32 [rows, seq_len+1];
- document (`DocumentLoader`): one document, truncated and padded: {"tokens", "lengths"};
- packed (`PackedLoader`): a row of whole documents: {"tokens", "segments", "positions"}.

A mixture (`MixtureLoader`) keeps the pure-function property: which source sample i comes from, and
that source's own sample index, are pure functions of i.
"""

from __future__ import annotations

import functools

import numpy as np

from boost_jax.data.shuffle import Permutation

PACK_BLOCK = 64  # packed: documents per packing block (the packing never looks further ahead)


class Loader:
    """What every loader shares: the process's rows of a batch, the vocabulary check, the order."""

    batching = "stream"

    def __init__(
        self,
        n: int,
        *,
        seq_len: int,
        global_batch: int,
        seed,
        vocab_size: int,
        name: str,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
        order: str = "feistel",
    ):
        if global_batch % process_count:
            raise ValueError(f"train.global_batch={global_batch} is not divisible by {process_count} processes")
        self.n, self.seq_len, self.window = n, seq_len, seq_len + 1
        self.global_batch, self.seed, self.vocab_size, self.name = global_batch, seed, vocab_size, name
        self.rows = slice(
            process_index * global_batch // process_count,  # this process's rows of a batch
            (process_index + 1) * global_batch // process_count,
        )
        self.shuffle, self.order = shuffle, order
        self._perm_epoch, self._perm = -1, None

    def units(self, ids) -> np.ndarray:
        """The unit (window, document, packed row) that samples `ids` of the run read."""
        ids = np.asarray(ids, np.int64)
        epoch, j = np.divmod(ids, self.n)
        if not self.shuffle:
            return j
        out = np.empty_like(j)
        for e in np.unique(epoch):
            at = epoch == e
            out[at] = self._permutation(int(e))(j[at])
        return out

    def _permutation(self, epoch: int):
        if epoch != self._perm_epoch:
            seed = [*np.atleast_1d(self.seed), epoch]
            if self.order == "numpy":
                table = np.random.default_rng(seed).permutation(self.n)
                self._perm = table.__getitem__
            else:
                self._perm = Permutation(self.n, tuple(int(s) for s in seed))
            self._perm_epoch = epoch
        return self._perm

    def check_ids(self, tokens: np.ndarray) -> np.ndarray:
        top = int(tokens.max()) if tokens.size else 0
        if top >= self.vocab_size or (tokens.size and int(tokens.min()) < 0):
            raise ValueError(
                f"{self.name}: token id {top} is outside [0, model.vocab_size={self.vocab_size}); "
                "the data was tokenized for a larger vocabulary: raise model.vocab_size "
                "or check data.token_dtype"
            )
        return tokens

    def samples(self, ids) -> dict:
        """Samples `ids` of the run: {"tokens": int32 [k, seq_len+1], ...} (see the module docstring)."""
        raise NotImplementedError

    def batch(self, position: int):
        """This process's rows of the global batch that starts at sample `position`."""
        rows = self.samples(range(position + self.rows.start, position + self.rows.stop))
        return rows["tokens"] if self.batching == "stream" else rows

    def windows(self, ids) -> np.ndarray:
        """The tokens of samples `ids` (int32 rows of seq_len+1)."""
        return self.samples(ids)["tokens"]

    def source_tokens(self, position: int) -> dict:
        """Tokens trained on per source by `position` (only mixtures have several sources)."""
        return {}

    def unit_tokens(self, units) -> int:
        """Input tokens that are not padding in `units` (what train.eval_tokens counts)."""
        raise NotImplementedError

    def readable_once(self) -> tuple[int, int]:
        """(the samples from sample 0 before any unit is read twice, the input tokens that are not
        padding in them): all that an evaluation may read without wrapping round. Samples 0..n-1
        read every unit once, in whatever order."""
        return self.n, int(self.input_tokens())


class TokenLoader(Loader):
    """data.batching=stream: non-overlapping windows of seq_len+1 tokens of the concatenated segments."""

    def __init__(self, segments: list[np.ndarray], *, seq_len: int, name: str, **kw):
        window = seq_len + 1
        self.segments = [s for s in segments if len(s) >= window]
        counts = np.array([len(s) // window for s in self.segments], dtype=np.int64)
        n = int(counts.sum())
        if n == 0:
            total = sum(len(s) for s in segments)
            raise ValueError(
                f"{name}: {total} tokens cannot fill one window of train.seq_len+1 = "
                f"{window} tokens; add data or shorten train.seq_len"
            )
        self.starts = np.concatenate([[0], np.cumsum(counts)])
        super().__init__(n, seq_len=seq_len, name=name, **kw)

    def samples(self, ids) -> dict:
        units = self.units(ids)
        seg = np.searchsorted(self.starts, units, side="right") - 1
        off = (units - self.starts[seg]) * self.window
        rows = [np.asarray(self.segments[s][o : o + self.window]) for s, o in zip(seg.tolist(), off.tolist())]
        return {"tokens": self.check_ids(np.stack(rows).astype(np.int32))}

    def input_tokens(self) -> int:
        """Tokens the model reads in one pass over the units (what train.eval_tokens counts)."""
        return self.n * self.seq_len

    def unit_tokens(self, units) -> int:
        return len(units) * self.seq_len


class _Documents:
    """Document j of the concatenated segments, from each segment's document end offsets."""

    def __init__(self, segments: list[np.ndarray], ends: list[np.ndarray], name: str):
        keep = [k for k, s in enumerate(segments) if len(s)]
        self.segments, self.ends = [segments[k] for k in keep], [ends[k] for k in keep]
        self.first = np.concatenate([[0], np.cumsum([len(e) for e in self.ends])]).astype(np.int64)
        self.count = int(self.first[-1])
        if self.count == 0:
            raise ValueError(f"{name}: no documents")

    def span(self, j: int) -> tuple[int, int, int]:
        """(segment, start, end) of document j."""
        s = int(np.searchsorted(self.first, j, side="right") - 1)
        k = j - int(self.first[s])
        ends = self.ends[s]
        return s, (int(ends[k - 1]) if k else 0), int(ends[k])

    def lengths(self, segment: int) -> np.ndarray:
        ends = np.asarray(self.ends[segment], np.int64)
        return np.diff(ends, prepend=0)


class DocumentLoader(Loader):
    """data.batching=document: one document per row (CoLA's recipe): the whole document if it fits in
    seq_len tokens, else its first seq_len-1 tokens and then its EOS (`eos_id`; as CoLA's T5 tokenizer
    call with truncation=True, max_length=seq_len makes the row; a document that does not end with the
    tokenizer's EOS, or a tokenizer without one, keeps its first seq_len tokens), then padding. A batch
    is {"tokens": [rows, seq_len+1], "lengths": [rows]}; position t holds a token iff t < length."""

    batching = "document"

    def __init__(self, segments, ends, *, seq_len: int, name: str, eos_id: int | None = None, **kw):
        self.docs = _Documents(segments, ends, name)
        self.eos_id = eos_id
        super().__init__(self.docs.count, seq_len=seq_len, name=name, **kw)

    def samples(self, ids) -> dict:
        units = self.units(ids)
        tokens = np.zeros((len(units), self.window), np.int32)
        lengths = np.zeros(len(units), np.int32)
        for row, j in enumerate(units.tolist()):
            s, lo, hi = self.docs.span(j)
            data = self.docs.segments[s]
            piece = np.asarray(data[lo : min(hi, lo + self.seq_len)])
            if hi - lo > self.seq_len and self.eos_id is not None and int(data[hi - 1]) == self.eos_id:
                piece = piece.copy()
                piece[-1] = self.eos_id  # CoLA's truncation: the first seq_len-1 ids, then </s>
            tokens[row, : len(piece)] = piece
            lengths[row] = len(piece)
        return {"tokens": self.check_ids(tokens), "lengths": lengths}

    def input_tokens(self) -> int:
        return int(sum(np.minimum(self.docs.lengths(s), self.seq_len).sum() for s in range(len(self.docs.ends))))

    def unit_tokens(self, units) -> int:
        lengths = np.concatenate([self.docs.lengths(s) for s in range(len(self.docs.ends))])
        return int(np.minimum(lengths[np.asarray(units, np.int64)], self.seq_len).sum())


OPEN_ROWS = 16  # packed: rows of a block that are still open to a document's last piece


def pack_rows(lengths, seq_len: int, open_rows: int = OPEN_ROWS) -> list[list[tuple[int, int, int]]]:
    """Greedy packing of documents (in order) into rows of seq_len tokens. A document's whole pieces
    of seq_len tokens are rows of their own; its last piece goes into the first of the `open_rows`
    most recently opened rows with room for it (first fit), else starts a row, which replaces the
    fullest open row (an empty slot first). Each row: [(document, offset in it, length)]."""
    rows: list[list[tuple[int, int, int]]] = []
    slots: list[int] = []  # the open rows, by index into rows (at most open_rows)
    fill: list[int] = []
    for doc, length in enumerate(lengths.tolist() if hasattr(lengths, "tolist") else lengths):
        full, rest = divmod(int(length), seq_len)
        for k in range(full):
            rows.append([(doc, k * seq_len, seq_len)])
        if not rest:
            continue
        piece = (doc, full * seq_len, rest)
        for k, f in enumerate(fill):
            if f + rest <= seq_len:
                rows[slots[k]].append(piece)
                fill[k] = f + rest
                break
        else:
            rows.append([piece])
            if len(slots) < open_rows:  # an empty slot first
                slots.append(len(rows) - 1)
                fill.append(rest)
            else:  # else the fullest open row (the first of equals) is closed
                k = fill.index(max(fill))
                slots[k], fill[k] = len(rows) - 1, rest
    return rows


def count_packed_rows(lengths: np.ndarray, seq_len: int, open_rows: int = OPEN_ROWS) -> np.ndarray:
    """What `pack_rows` gives for each block of documents: lengths [blocks, K] -> rows [blocks],
    vectorised over the blocks (K steps of numpy, whatever the number of blocks)."""
    blocks = len(lengths)
    rows = np.zeros(blocks, np.int64)
    fill = np.full((blocks, open_rows), -1, np.int64)  # -1: an empty slot
    at = np.arange(blocks)
    for col in np.asarray(lengths, np.int64).T:
        full, rest = np.divmod(col, seq_len)
        rows += full
        fits = (fill >= 0) & (fill + rest[:, None] <= seq_len)
        has = fits.any(1) & (rest > 0)
        first = fits.argmax(1)
        fill[at[has], first[has]] += rest[has]
        new = ~fits.any(1) & (rest > 0)
        # An empty slot first (its fill -1 is the smallest), else the fullest (lowest index on ties).
        empty = fill < 0
        slot = np.where(empty.any(1), empty.argmax(1), fill.argmax(1))
        fill[at[new], slot[new]] = rest[new]
        rows += new
    return rows


class PackedLoader(Loader):
    """data.batching=packed: a row of seq_len tokens holding whole documents. Documents are packed
    greedily in corpus order within blocks of PACK_BLOCK documents (a document longer than a row is
    cut into row-sized pieces, each its own segment; a last piece goes into the first of the OPEN_ROWS
    latest rows with room), counted once when the loader starts (vectorised over the blocks) and laid
    out per block when a row is read; the rows are what is shuffled (as Levanter packs). A batch is
    {"tokens", "segments", "positions"}, each [rows, seq_len+1]: segment ids 1, 2, ... per piece (0:
    padding) and positions restarting at 0 in every piece. Row seq_len (the last column) is always
    padding: a row's targets stay inside its documents."""

    batching = "packed"

    def __init__(self, segments, ends, *, seq_len: int, name: str, block: int = PACK_BLOCK, **kw):
        self.docs = _Documents(segments, ends, name)
        self.block = block
        # Blocks never cross a segment: (segment, first document in it) of every block.
        counts, block_seg, block_first = [], [], []
        for s in range(len(self.docs.ends)):
            lengths = self.docs.lengths(s)
            nb = -(-len(lengths) // block)
            padded = np.zeros(nb * block, np.int64)
            padded[: len(lengths)] = lengths
            counts.append(count_packed_rows(padded.reshape(nb, block), seq_len))
            block_seg.append(np.full(nb, s, np.int64))
            block_first.append(np.arange(nb, dtype=np.int64) * block)
        self.block_rows = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
        self.block_seg, self.block_first = np.concatenate(block_seg), np.concatenate(block_first)
        self.tokens_total = int(sum(int(np.asarray(e[-1])) if len(e) else 0 for e in self.docs.ends))
        super().__init__(int(self.block_rows[-1]), seq_len=seq_len, name=name, **kw)

    @functools.lru_cache(maxsize=256)
    def _packed(self, b: int) -> list[list[tuple[int, int]]]:
        """Block b's rows as [(start in the segment, length)] pieces."""
        s, first = int(self.block_seg[b]), int(self.block_first[b])
        ends = np.asarray(self.docs.ends[s][first : first + self.block], np.int64)
        starts = np.concatenate([[int(self.docs.ends[s][first - 1]) if first else 0], ends[:-1]])
        return [[(int(starts[d]) + off, n) for d, off, n in row] for row in pack_rows(ends - starts, self.seq_len)]

    def samples(self, ids) -> dict:
        units = self.units(ids)
        shape = (len(units), self.window)
        tokens, segments, positions = (np.zeros(shape, np.int32) for _ in range(3))
        blocks = np.searchsorted(self.block_rows, units, side="right") - 1
        for row, (r, b) in enumerate(zip(units.tolist(), blocks.tolist())):
            data, at = self.docs.segments[int(self.block_seg[b])], 0
            for k, (start, n) in enumerate(self._packed(b)[r - int(self.block_rows[b])]):
                tokens[row, at : at + n] = data[start : start + n]
                segments[row, at : at + n] = k + 1
                positions[row, at : at + n] = np.arange(n)
                at += n
        return {"tokens": self.check_ids(tokens), "segments": segments, "positions": positions}

    def input_tokens(self) -> int:
        return self.tokens_total

    def unit_tokens(self, units) -> int:
        blocks = np.searchsorted(self.block_rows, units, side="right") - 1
        return sum(
            n
            for r, b in zip(np.asarray(units).tolist(), blocks.tolist())
            for _, n in self._packed(b)[r - int(self.block_rows[b])]
        )


MIX_BLOCK = 1 << 16  # a mixture's schedule repeats its per-source quotas every MIX_BLOCK samples
_MIX_SALT = 0x6D6978  # keeps the mixture's random stream apart from the sources' permutations


class MixtureLoader:
    """Samples drawn from several loaders with fixed weights, deterministically.

    The run is cut into blocks of MIX_BLOCK samples. Source k owns q_k samples of every block (the
    weights apportioned by largest remainder, so its long-run fraction is q_k / MIX_BLOCK, within
    1/MIX_BLOCK of its weight) and gets the m-th of them at key (m + u) / q_k, u ~ U[0, 1) seeded by
    (seed, block); sorting the keys interleaves the sources, so every prefix of a block holds each
    source's share to within two samples (a batch: four). Source k's own sample index for its m-th
    slot of block b is b * q_k + m: a pure function of the global position, so resuming needs no
    extra state.
    """

    def __init__(
        self,
        loaders: list[Loader],
        weights,
        names: list[str],
        *,
        seed: int,
        global_batch: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        w = np.asarray(weights, dtype=np.float64)
        exact = w / w.sum() * MIX_BLOCK
        quota = np.floor(exact).astype(np.int64)
        quota[np.argsort(quota - exact, kind="stable")[: MIX_BLOCK - int(quota.sum())]] += 1
        if (quota == 0).any():
            raise ValueError(f"mixture weights {list(weights)}: each must be at least 1/{MIX_BLOCK} of the total")
        self.loaders, self.names, self.quota, self.seed = loaders, names, quota, seed
        self.batching, self.seq_len = loaders[0].batching, loaders[0].seq_len
        self.rows = slice(
            process_index * global_batch // process_count, (process_index + 1) * global_batch // process_count
        )
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

    def samples(self, ids) -> dict:
        parts = [self.loaders[k].samples([j]) for k, j in (self.sample(i) for i in ids)]
        return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}

    def batch(self, position: int):
        rows = self.samples(range(position + self.rows.start, position + self.rows.stop))
        return rows["tokens"] if self.batching == "stream" else rows

    def windows(self, ids) -> np.ndarray:
        return self.samples(ids)["tokens"]

    def input_tokens(self) -> int:
        return sum(loader.input_tokens() for loader in self.loaders)

    def _consumed(self, position: int) -> np.ndarray:
        """Samples of each source that the run's first `position` samples read (its samples
        0..count-1: a source's slots of a block come in rank order)."""
        b, r = divmod(position, MIX_BLOCK)
        return b * self.quota + np.bincount(self._block(b)[0][:r], minlength=len(self.quota))

    def readable_once(self) -> tuple[int, int]:
        """As Loader.readable_once: the most samples before any source reads a unit twice."""
        n = np.array([loader.n for loader in self.loaders])
        lo, hi = 0, int(n.sum()) + 1  # hi samples would read more than there are
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if (self._consumed(mid) <= n).all() else (lo, mid)
        used = self._consumed(lo)
        return lo, sum(
            int(loader.unit_tokens(loader.units(np.arange(c)))) if c else 0 for loader, c in zip(self.loaders, used)
        )

    def source_tokens(self, position: int) -> dict:
        """{"tokens/NAME": row slots (seq_len each) trained on from that source in the run's first
        `position` samples}."""
        b, r = divmod(position, MIX_BLOCK)
        samples = b * self.quota + np.bincount(self._block(b)[0][:r], minlength=len(self.quota))
        return {f"tokens/{name}": int(n) * self.seq_len for name, n in zip(self.names, samples)}
