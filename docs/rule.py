"""The decision rule of docs/results.md#primary, in code: an estimate with its intervals for every
comparison, and the one-sided p-values and Holm's procedure that judge each paper's primary claim
(bench.py's PRIMARY, through bench.primary_claims). tests/test_bench.py checks each by hand."""
import numpy as np
import scipy.stats


def paired(values, base):
    """The paired differences values - base over the seeds both have (NaN: none)."""
    d = np.subtract(values, base, dtype=float)
    return d[~np.isnan(d)]


def estimate(values, base, spec):
    """A table cell: the mean of values - base over the paired seeds, its 90 % paired-bootstrap
    interval (10,000 resamples of the seeds, numpy seed 0) and its 90 % paired t-interval, mean +-
    t_(0.95, n-1) sd / sqrt(n); an estimate, no verdict; '-': no pair."""
    d = paired(values, base)
    n = len(d)
    if not n:
        return "-"
    means = np.random.default_rng(0).choice(d, (10000, n)).mean(axis=1)
    low, high = np.percentile(means, [5, 95])
    half = scipy.stats.t.ppf(0.95, n - 1) * d.std(ddof=1) / np.sqrt(n) if n > 1 else np.nan
    diff = d.mean()
    return (f"{diff:+{spec}} [{low:+{spec}}, {high:+{spec}}], t [{diff - half:+{spec}}, "
            f"{diff + half:+{spec}}]")


def p_below(d, bound):
    """The one-sided p that the mean of the paired differences d is not below `bound`: the larger
    of the paired t-test's and the paired bootstrap's (the share of 10,000 resampled means at or
    above it, numpy seed 0). docs/results.md#primary"""
    if len(d) < 2:
        return 1.0
    means = np.random.default_rng(0).choice(d, (10000, len(d))).mean(axis=1)
    if d.std() == 0:  # every seed alike: the t-test's p is 0 or 1
        t_p = float(d.mean() >= bound)
    else:
        t_p = scipy.stats.ttest_1samp(d, bound, alternative="less").pvalue
    return max(t_p, np.mean(means >= bound))


def holm(p, alpha):
    """{name: passed} of Holm's step-down procedure over the family {name: p}: the k-th smallest p
    (k from 0) against alpha / (m - k), m the family's size; after the first that fails, none
    passes. docs/results.md#primary"""
    passed = {}
    failed = False
    for k, name in enumerate(sorted(p, key=p.get)):
        failed = failed or p[name] > alpha / (len(p) - k)
        passed[name] = not failed
    return passed
