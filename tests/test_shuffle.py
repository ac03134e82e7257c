"""The stateless permutation (boost_jax/data/shuffle.py): a bijection for every n and seed, repeatable,
seed-dependent, and uniform enough to shuffle with."""

import math

import numpy as np
import pytest

from boost_jax.data.shuffle import Permutation

SIZES = sorted(
    {1, 2, 3, 5, 7, 11, 13, 97, 251, 1009, 65521}
    | {m for k in range(1, 21) for m in (2**k - 1, 2**k, 2**k + 1)}
    | set(np.random.default_rng(0).integers(2, 200_000, 8).tolist())
)


def is_bijection(p: Permutation, n: int) -> bool:
    image = p(np.arange(n))
    return image.dtype == np.int64 and np.array_equal(np.sort(image), np.arange(n))


@pytest.mark.parametrize("n", SIZES)
def test_bijection_and_inverse(n):
    p = Permutation(n, (n, 3))
    assert is_bijection(p, n)
    x = np.arange(n)
    np.testing.assert_array_equal(p.inverse(p(x)), x)
    np.testing.assert_array_equal(p(p.inverse(x)), x)


def test_bijection_of_a_large_n():
    n = 3_000_017
    assert is_bijection(Permutation(n, (1, 0)), n)


def test_huge_n_needs_no_memory():
    n = 10**12
    p = Permutation(n, 5)
    x = np.array([0, 1, 2, n // 2, n - 1])
    y = p(x)
    assert y.dtype == np.int64 and ((0 <= y) & (y < n)).all() and len(set(y.tolist())) == len(x)
    np.testing.assert_array_equal(p.inverse(y), x)


def test_deterministic_and_independent_of_chunking():
    n, seed = 100_003, (7, 2)
    whole = Permutation(n, seed)(np.arange(n))
    again = Permutation(n, seed)
    np.testing.assert_array_equal(
        np.concatenate([again(np.arange(lo, min(lo + 999, n))) for lo in range(0, n, 999)]), whole
    )
    picks = np.random.default_rng(1).integers(0, n, 300)
    assert [int(again(int(i))) for i in picks] == whole[picks].tolist()
    assert again(np.array(5)).shape == () and again(picks.reshape(20, 15)).shape == (20, 15)
    np.testing.assert_array_equal(again(picks.reshape(20, 15)), whole[picks].reshape(20, 15))


def test_seeds_and_epochs_give_different_orders():
    n = 10_000
    x = np.arange(n)
    orders = [Permutation(n, s)(x) for s in [(0, 0), (0, 1), (1, 0), (0, 0, 0), 0, 1]]
    for i in range(len(orders)):
        for j in range(i):
            assert np.mean(orders[i] == orders[j]) < 0.01  # unrelated: ~1/n agree by chance
    assert not np.array_equal(orders[0], x)  # it does shuffle
    np.testing.assert_array_equal(Permutation(n, 3)(x), Permutation(n, (3,))(x))  # an int is a 1-tuple


def test_rejects_bad_input():
    p = Permutation(10, 0)
    for bad in (10, -1, np.array([3, 10])):
        with pytest.raises(IndexError):
            p(bad)
    with pytest.raises(TypeError):
        p(np.array([0.5]))
    with pytest.raises(ValueError):
        Permutation(0, 0)


def chi2_bound(dof: int, z: float = 6.0) -> float:
    """A bound a chi-square statistic with `dof` degrees of freedom exceeds with p ~ 1e-9 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def landing(rounds: int, n: int = 50, seeds: int = 20_000, idx=(0, 1, 37)) -> np.ndarray:
    """Where each of `idx` lands under `seeds` seeds: [seeds, len(idx)]."""
    return np.array([Permutation(n, (s, 11), rounds=rounds)(np.array(idx)) for s in range(seeds)])


def uniformity_failures(landed: np.ndarray, n: int = 50) -> list[str]:
    """What a chi-square test per index (p ~ 1e-9) and a 5-sigma test of P(perm(0) < perm(1)) = 1/2 reject."""
    seeds, bad = len(landed), []
    for col in range(landed.shape[1]):
        counts = np.bincount(landed[:, col], minlength=n)
        stat = float(((counts - seeds / n) ** 2 / (seeds / n)).sum())
        if stat > chi2_bound(n - 1):
            bad.append(f"index {col}: chi2 {stat:.0f} > {chi2_bound(n - 1):.0f}")
    frac = float(np.mean(landed[:, 0] < landed[:, 1]))
    if abs(frac - 0.5) > 5 * math.sqrt(0.25 / seeds):
        bad.append(f"P(perm(0) < perm(1)) = {frac:.4f}")
    return bad


def test_position_of_an_index_is_uniform_over_seeds():
    """Where fixed indices land over 20,000 seeds (n = 50: cycle-walking in a domain of 64)."""
    landed = landing(rounds=6)
    assert (landed[:, 0] != landed[:, 1]).all()
    assert uniformity_failures(landed) == []


def test_the_uniformity_test_can_fail():
    """A one-round Feistel network keeps index 0 in [0, 8): the same tests reject it."""
    assert uniformity_failures(landing(rounds=1, seeds=2_000)[:, :2])
    skewed = np.random.default_rng(0).integers(0, 50, (20_000, 2))
    skewed[:2_000, 0] = 0  # 10% of the seeds send index 0 to 0
    assert uniformity_failures(skewed)


def test_chi2_bound_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    assert scipy_stats.chi2.sf(chi2_bound(49), 49) < 1e-6
