"""The statistics of `minigpt ablate`: Student-t quantiles, the interval of a known sample, paired and Welch
differences, and the resolved / equal / unresolved verdicts."""
import math

import pytest

from minigpt.analysis.ablate.stats import (
    EQUAL,
    RESOLVED_BETTER,
    RESOLVED_WORSE,
    UNRESOLVED,
    Interval,
    classify,
    describe,
    difference_interval,
    mean_interval,
    seeds_to_resolve,
    student_t_cdf,
    t_quantile,
)

# t_{0.975, df} from the standard tables (e.g. NIST/SEMATECH e-Handbook, table 1.3.6.7.2)
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 30: 2.042, 100: 1.984}


def test_t_quantiles_match_the_tables():
    for df, t in T975.items():
        assert t_quantile(0.975, df) == pytest.approx(t, abs=6e-4), df
        assert student_t_cdf(t_quantile(0.975, df), df) == pytest.approx(0.975, abs=1e-9)
    assert t_quantile(0.5, 3) == pytest.approx(0.0, abs=1e-9)
    assert t_quantile(0.025, 4) == pytest.approx(-2.776, abs=6e-4)
    assert student_t_cdf(0.0, 7) == 0.5 and student_t_cdf(1e9, 2) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        student_t_cdf(1.0, 0)


def test_t_distribution_matches_scipy():
    stats = pytest.importorskip("scipy.stats", reason="scipy cross-check")
    for df in (1, 2, 3, 6, 11, 40):
        for t in (-7.0, -1.3, 0.2, 2.5, 9.0):
            assert student_t_cdf(t, df) == pytest.approx(stats.t.cdf(t, df), abs=1e-12)
        for p in (0.9, 0.975, 0.995):
            assert t_quantile(p, df) == pytest.approx(stats.t.ppf(p, df), abs=1e-8)


def test_interval_of_a_known_sample():
    # mean 2.0, sample sd 1.0 (values 1, 2, 3), n = 3: half-width = t_{0.975,2} * 1 / sqrt(3) = 2.4842
    iv = mean_interval([1.0, 2.0, 3.0])
    assert iv.mean == 2.0 and iv.n == 3 and iv.df == 2
    assert iv.se == pytest.approx(1 / math.sqrt(3))
    assert iv.half == pytest.approx(4.302653 / math.sqrt(3), abs=1e-6)
    assert (iv.low, iv.high) == pytest.approx((2.0 - 2.484138, 2.0 + 2.484138), abs=1e-6)
    assert iv.text() == "2.0000 ± 2.4841"
    one = mean_interval([3.5])
    assert math.isnan(one.half) and one.text() == "3.5000 (1 seed)"


def test_difference_is_paired_by_seed_and_welch_otherwise():
    base = {1: 3.00, 2: 3.10, 3: 2.90}
    variant = {1: 3.02, 2: 3.12, 3: 2.93}  # a shift that the seeds share: paired, it is resolved
    d = difference_interval(variant, base)
    assert d.mean == pytest.approx(0.0233333, abs=1e-6) and d.n == 3
    paired = mean_interval([0.02, 0.02, 0.03])
    assert (d.half, d.se) == pytest.approx((paired.half, paired.se))
    assert classify(d, bound=0.01) == RESOLVED_WORSE
    # without the pairing (a seed missing) the seed-to-seed spread swamps the shift: Welch, unresolved
    w = difference_interval({1: 3.02, 2: 3.12}, base)
    assert w.mean == pytest.approx(3.07 - 3.0)
    va, vb = 0.005 / 2, 0.01 / 3
    assert w.se == pytest.approx(math.sqrt(va + vb))
    df = (va + vb) ** 2 / (va ** 2 / 1 + vb ** 2 / 2)
    assert w.df == pytest.approx(df) and w.half == pytest.approx(t_quantile(0.975, math.floor(df)) * w.se)
    assert classify(w, bound=0.01) == UNRESOLVED


def test_resolved_equal_and_unresolved():
    iv = lambda mean, half: Interval(mean, half, half / 4.3, 3, 2)
    assert classify(iv(0.05, 0.02), 0.01) == RESOLVED_WORSE  # [0.03, 0.07] excludes 0, higher bpb
    assert classify(iv(-0.05, 0.02), 0.01) == RESOLVED_BETTER
    assert classify(iv(0.05, 0.02), 0.01, lower_is_better=False) == RESOLVED_BETTER
    assert classify(iv(0.002, 0.005), 0.01) == EQUAL  # [-0.003, 0.007] inside +-0.01
    assert classify(iv(0.002, 0.012), 0.01) == UNRESOLVED  # straddles 0, wider than the bound
    assert classify(iv(0.0, 0.01), 0.01) == EQUAL  # the bound is inclusive
    assert classify(Interval(0.5, math.nan, math.nan, 1, 0), 0.01) == UNRESOLVED  # one seed proves nothing
    assert describe(iv(0.05, 0.02), 0.01) == "+0.0500 ± 0.0200 bpb: worse (resolved)"
    assert describe(iv(0.002, 0.005), 0.01) == "+0.0020 ± 0.0050 bpb: equal within ±0.0100 bpb"
    assert describe(iv(0.002, 0.012), 0.01).startswith("+0.0020 ± 0.0120 bpb: unresolved")


def test_seeds_to_resolve_follows_the_t_interval():
    d = mean_interval([0.01, 0.03, -0.01])  # mean 0.01, sd 0.02: unresolved with 3 seeds
    assert classify(d, 0.001) == UNRESOLVED
    n = seeds_to_resolve(d)
    sd = 0.02
    assert t_quantile(0.975, n - 1) * sd / math.sqrt(n) < 0.01 <= t_quantile(0.975, n - 2) * sd / math.sqrt(n - 1)
    assert seeds_to_resolve(mean_interval([0.1])) is None
