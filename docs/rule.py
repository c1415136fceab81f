"""The decision rule of docs/results.md#primary, in code: an estimate with its intervals for every
comparison, and the one-sided p-values and Holm's procedure that judge each paper's primary claim
(bench.py's PRIMARY, through bench.primary_claims and judge below). tests/test_bench.py checks each
by hand.

scipy is imported inside the functions that need it, not here: bench.py imports this file, and
docs/gpu_check.py imports bench.py on a GPU machine that may have no scipy (docs/README.md#gpu)."""
import functools

import numpy as np

# the paired bootstrap takes every one of the n^n resamples of n pairs when there are no more than
# this many (n <= 7; 46,656 at six pairs), so that its intervals and p's are exact: the same to the
# digit on every machine and under any numpy seed. Past it, 10,000 resamples drawn with numpy seed 0
EVERY = 10 ** 6
SUBSCRIPTS = {"1": "₁", "2": "₂", "3": "₃"}  # p1 as the pages print it, p₁


def paired(values, base):
    """The paired differences values - base over the seeds both have (NaN: none)."""
    d = np.subtract(values, base, dtype=float)
    return d[~np.isnan(d)]


def resampled_means(d):
    """The means of the paired bootstrap's resamples of the differences d, each resample n draws of
    the n pairs with replacement: every ordered resample once (all equally likely) when n^n <=
    EVERY, else 10,000 of them drawn with numpy seed 0."""
    n = len(d)
    if n ** n <= EVERY:
        # the sums of every ordered draw of n: an n-fold outer sum, one entry per resample
        return functools.reduce(np.add.outer, [d] * n).ravel() / n
    return np.random.default_rng(0).choice(d, (10000, n)).mean(axis=1)


def estimate(values, base, spec):
    """A table cell: the mean of values - base over the paired seeds, its 90 % paired-bootstrap
    interval (the 5th and 95th percentiles of resampled_means, each the least mean with at least
    that share of the resamples at or below it: a mean some resample has) and its 90 % paired
    t-interval, mean +- t_(0.95, n-1) sd / sqrt(n); an estimate, no verdict; '-': no pair."""
    import scipy.stats
    d = paired(values, base)
    n = len(d)
    if not n:
        return "-"
    low, high = np.percentile(resampled_means(d), [5, 95], method="inverted_cdf")
    half = scipy.stats.t.ppf(0.95, n - 1) * d.std(ddof=1) / np.sqrt(n) if n > 1 else np.nan
    diff = d.mean()
    return (f"{diff:+{spec}} [{low:+{spec}}, {high:+{spec}}], t [{diff - half:+{spec}}, "
            f"{diff + half:+{spec}}]")


def p_parts(d, bound):
    """(the paired t-test's, the paired bootstrap's) one-sided p that the mean of the paired
    differences d is not below `bound`: the t distribution's CDF at (mean - bound) / (sd /
    sqrt(n)), and the share of resampled_means at or above it."""
    import scipy.stats
    if d.std() == 0:  # every seed alike: the t-test's p is 0 or 1
        t_p = float(d.mean() >= bound)
    else:
        t_p = scipy.stats.ttest_1samp(d, bound, alternative="less").pvalue
    return float(t_p), float(np.mean(resampled_means(d) >= bound))


def p_below(d, bound):
    """The one-sided p that the mean of the paired differences d is not below `bound`: the larger
    of p_parts (1 with fewer than 2 pairs). docs/results.md#primary"""
    if len(d) < 2:
        return 1.0
    return max(p_parts(d, bound))


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


def power(d, shift, alpha):
    """The one-sided paired t-test's power at level alpha over len(d) pairs with d's sd, when the
    true mean lies `shift` past the tested bound: the share of the noncentral t distribution (n - 1
    degrees of freedom, noncentrality shift / (sd / sqrt(n))) above the test's critical value."""
    import scipy.stats
    n = len(d)
    if np.ptp(d) == 0:  # every seed alike: the test's p is 0 past the bound
        return float(shift > 0)
    noncentrality = shift / (d.std(ddof=1) / np.sqrt(n))
    return float(scipy.stats.nct.sf(scipy.stats.t.ppf(1 - alpha, n - 1), n - 1, noncentrality))


def judge(pairs, margin, alpha, least):
    """{name: its claim, a dict} from {name: (the primary metric's paired differences, the
    accuracy's)}, method - ablation (docs/results.md#primary):
      p1, p2: the p that the metric did not fall, that the accuracy fell by `margin` or more;
      holds: max(p1, p2) passes Holm over the claims at `alpha` (the rule fixed before the runs);
      p3, fails: the p that the accuracy did not fall by more than `margin`, and Holm over the
        claims' p3 at the same `alpha` (the third outcome, added after the runs on 2026-12-01);
      rests: the p the verdict rests on and the test that gave it, e.g. 'p₂, t-test';
      power: the t-test's power for p2 at a true difference of 0 (the chance to show it kept);
      n: the pairs. With fewer than `least` pairs Holm counts the claim's p as 1: no verdict."""
    found = {}
    for name, (fall, kept) in pairs.items():
        n = min(len(fall), len(kept))
        # each p's two parts, (t-test, bootstrap); one pair or none: no test, p = 1
        parts = {"p1": p_parts(fall, 0.0), "p2": p_parts(-kept, margin),
                 "p3": p_parts(kept, -margin)} if n > 1 else {}
        claim = {key: max(parts[key]) if parts else 1.0 for key in ("p1", "p2", "p3")}
        claim.update(n=n, parts=parts, power=power(-kept, margin, alpha) if parts else np.nan)
        found[name] = claim
    # the family is every claim, one with fewer than `least` pairs at p = 1
    counted = {name: c["n"] >= least for name, c in found.items()}
    holds = holm({name: max(c["p1"], c["p2"]) if counted[name] else 1.0
                  for name, c in found.items()}, alpha)
    fails = holm({name: c["p3"] if counted[name] else 1.0 for name, c in found.items()}, alpha)
    for name, claim in found.items():
        claim.update(holds=holds[name], fails=fails[name])
        # the verdict's p: p3 when the accuracy fell, else the claim's, the larger of p1 and p2
        key = "p3" if claim["fails"] else max(("p1", "p2"), key=claim.get)
        t_p, boot_p = claim["parts"].get(key, (np.nan, np.nan))
        test = "t-test" if t_p >= boot_p else "bootstrap"
        claim["rests"] = f"p{SUBSCRIPTS[key[1]]}, {test}" if counted[name] else "-"
    return found


def verdict(claim, least):
    """The verdict words of a claim from judge: 'on this toy' stands in every one (the chains task's
    1.0M-parameter model on a 2-core CPU, docs/results.md#rule), and none before `least` pairs."""
    if claim["n"] < least:
        return f"no verdict: {claim['n']} of {least} pairs"
    if claim["holds"]:
        return "holds on this toy"
    if claim["fails"]:
        return "fails on this toy"
    return f"not shown at {claim['n']} seeds on this toy"
