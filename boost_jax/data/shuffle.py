"""A stateless pseudo-random permutation of [0, n), evaluated per index in O(1) memory.

Why: a materialised `np.random` permutation costs 8 bytes and a shuffle step per sample, paid again
at every start and every epoch (gigabytes for a corpus of 1e11 tokens). `Permutation(n,
seed)(i)` instead computes where sample i goes with a keyed Feistel network over the smallest even
power of two >= n, walking the cycle (re-encrypting) until the result falls back into [0, n).

Guarantee: for every n >= 1 and every seed, `Permutation(n, seed)` is a bijection of [0, n) (a Feistel
network is invertible whatever its round function, and cycle-walking restricts a permutation of a
larger domain to a permutation of [0, n)). Round keys come from `np.random.SeedSequence(seed)`, so
different seeds ((run_seed, epoch), (run_seed, source, epoch), ...) give unrelated orders; `s` and
`(s,)` are one seed, `(s, 0)` another.
"""

from __future__ import annotations

import numpy as np

ROUNDS = 6
_M1 = np.uint64(0xFF51AFD7ED558CCD)  # murmur3's fmix64 multipliers
_M2 = np.uint64(0xC4CEB9FE1A85EC53)
_S = np.uint64(33)


def _mix(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finaliser: a bijection of uint64 in which every input bit reaches every output bit."""
    x = x ^ (x >> _S)
    x = x * _M1
    x = x ^ (x >> _S)
    x = x * _M2
    return x ^ (x >> _S)


class Permutation:
    """A bijection of [0, n) keyed by `seed` (an int or a tuple of ints); call it on indices."""

    def __init__(self, n: int, seed, rounds: int = ROUNDS):
        n = int(n)
        if not 1 <= n <= 1 << 62:
            raise ValueError(f"Permutation: n={n} is outside [1, 2**62]")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2  # each half of the even-width domain [0, 4**half)
        self._shift, self._mask = np.uint64(self.half), np.uint64((1 << self.half) - 1)
        seed = tuple(int(s) for s in np.atleast_1d(seed))
        # SeedSequence alone ignores trailing zeros ((s, 0) == s); the tuple's length keeps them apart
        self.keys = np.random.SeedSequence(seed, spawn_key=(len(seed),)).generate_state(rounds, dtype=np.uint64)

    def _round(self, r: np.ndarray, key: np.uint64) -> np.ndarray:
        return _mix(r + key) & self._mask

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._shift, x & self._mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self._shift) | right

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._shift, x & self._mask
        for key in self.keys[::-1]:
            left, right = right ^ self._round(left, key), left
        return (left << self._shift) | right

    def _walk(self, idx, step) -> np.ndarray:
        idx = np.asarray(idx)
        if not np.issubdtype(idx.dtype, np.integer):
            raise TypeError(f"Permutation: indices must be integers, not {idx.dtype}")
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.n):
            raise IndexError(f"Permutation: indices outside [0, {self.n})")
        x = idx.astype(np.uint64).reshape(-1)
        with np.errstate(over="ignore"):  # uint64 products wrap, as intended
            x = step(x)
            todo = np.flatnonzero(x >= self.n)
            while todo.size:  # cycle-walking: only the entries that left [0, n) are re-encrypted
                y = step(x[todo])
                x[todo] = y
                todo = todo[y >= self.n]
        return x.astype(np.int64).reshape(idx.shape)

    def __call__(self, idx) -> np.ndarray:
        """Where each index in [0, n) goes: an int64 array of idx's shape."""
        return self._walk(idx, self._encrypt)

    def inverse(self, idx) -> np.ndarray:
        """The index that `self` sends to each of `idx`: `inverse(self(x)) == x`."""
        return self._walk(idx, self._decrypt)
