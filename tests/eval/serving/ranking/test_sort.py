"""Multi-pivot quicksort: agreement with `sorted` on adversarial shapes, counts against the cost recurrence."""

import math

import numpy as np
import pytest

from eval.serving.ranking import multipivot as mp


def _inputs(n: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "random": rng.random(n),
        "sorted": np.arange(n, dtype=float),
        "reversed": np.arange(n, dtype=float)[::-1].copy(),
        "duplicates": rng.integers(0, 3, n).astype(float),
        "organ_pipe": np.concatenate([np.arange(n // 2), np.arange(n - n // 2)[::-1]]).astype(float),
    }


@pytest.mark.parametrize("pivots", mp.PIVOTS)
@pytest.mark.parametrize("cutoff", [1, 3, 16])
def test_counted_sorts_agree_with_sorted(pivots, cutoff):
    for seed, n in enumerate([0, 1, 2, 3, 4, 5, 7, 17, 64, 333, 1000]):
        for shape, keys in _inputs(n, seed).items():
            order, stats = mp.count_costs(keys, pivots, cutoff, seed=seed + 1)
            expected = sorted(range(n), key=lambda i, keys=keys: (keys[i], i))
            assert order.tolist() == expected, (shape, n)
            assert stats.comparisons >= (n - 1 if n else 0)


@pytest.mark.parametrize("pivots", mp.PIVOTS)
def test_argsort_is_stable_argsort(pivots):
    for shape, keys in _inputs(3000, pivots).items():
        assert np.array_equal(mp.argsort(keys, pivots), np.argsort(keys, kind="stable")), shape


def test_compiled_and_pure_paths_do_the_same_work():
    keys = np.random.default_rng(3).random(3000)
    for k in mp.PIVOTS:
        pure, _ = mp.count_costs(keys, k, 16, seed=9)
        assert np.array_equal(mp.argsort(keys, k, 16, seed=9), pure)


def test_comparisons_within_ten_percent_of_theory_at_1e5():
    n = 100_000
    keys = np.random.default_rng(0).random(n)
    for k in mp.PIVOTS:
        _, stats = mp.count_costs(keys, k, cutoff=16)
        theory = mp.expected_comparisons(n, k, cutoff=16)
        assert abs(stats.comparisons / theory - 1) < 0.10, (k, stats.comparisons, theory)


def test_recurrence_matches_exact_quicksort_and_insertion_formulas():
    # 1-pivot, no cutoff, m - 1 partition comparisons: the classic C_n = 2 (n+1) H_n - 4n
    n = 500
    harmonic = sum(1 / i for i in range(1, n + 1))
    assert mp.expected_comparisons(n, 1, cutoff=1) == pytest.approx(2 * (n + 1) * harmonic - 4 * n, rel=1e-9)
    assert mp.expected_comparisons(10, 2, cutoff=10) == pytest.approx(
        10 * 13 / 4 - sum(1 / i for i in range(1, 11))
    )
    # the leading constants appear as n grows
    for k, (lead, _, _) in mp.LITERATURE.items():
        big, small = 200_000, 100_000
        slope = (mp.expected_comparisons(big, k, 1) - 2 * mp.expected_comparisons(small, k, 1)) / (
            big * math.log(2)
        )
        assert slope == pytest.approx(lead, rel=0.02)


def test_cache_simulation_counts_misses_and_keeps_order():
    keys = np.random.default_rng(1).random(4096)
    misses = {}
    for k in mp.PIVOTS:
        order, stats = mp.count_costs(keys, k, 16, cache=(16, 8))
        assert np.array_equal(order, np.argsort(keys, kind="stable"))
        misses[k] = stats.cache_misses
        assert stats.cache_misses >= 4096 // 16  # every block is read at least once
    assert misses[3] < misses[1]


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="pivots=4"):
        mp.argsort([1.0], pivots=4)
    with pytest.raises(ValueError, match="cutoff=0"):
        mp.count_costs([1.0], cutoff=0)


def test_compiled_argsort_breaks_ties_by_position_like_the_python_comparator():
    keys = np.random.default_rng(5).integers(0, 40, 5000).astype(float)  # many ties
    for k in mp.PIVOTS:
        expected = mp.count_costs(keys, k)[0]  # the Python comparator path
        assert np.array_equal(mp.argsort(keys, k), expected)
        assert np.array_equal(expected, np.argsort(keys, kind="stable"))
