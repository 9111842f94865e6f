"""Two-sample tests for the side-channel benchmark, with no dependency beyond the standard library
(scipy is not on every GPU machine; tests/bench compare these with scipy's where it is).

- `mann_whitney`: U statistic, two-sided p from the normal approximation with tie correction and
  continuity correction (scipy's `mannwhitneyu(method="asymptotic")`), and the common-language
  effect size P(x > y) + P(x = y) / 2 (0.5: neither sample tends to be larger).
- `ks_distance`: the Kolmogorov-Smirnov statistic D, the largest gap between the two empirical
  distribution functions (scipy's `ks_2samp` statistic), a descriptive distance.
"""

from __future__ import annotations

import bisect
import math
import statistics


def mann_whitney(x: list[float], y: list[float]) -> dict:
    n1, n2 = len(x), len(y)
    if n1 < 2 or n2 < 2:
        raise ValueError(f"need at least 2 values per sample, got {n1} and {n2}")
    ranks, ties = _ranks(list(x) + list(y))
    u1 = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    n = n1 + n2
    mu = n1 * n2 / 2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    z = 0.0 if sigma == 0 else max(0.0, abs(u1 - mu) - 0.5) / sigma
    return {"u": u1, "p": min(1.0, math.erfc(z / math.sqrt(2))), "effect_size": u1 / (n1 * n2)}


def ks_distance(x: list[float], y: list[float]) -> float:
    xs, ys = sorted(x), sorted(y)
    return max(abs(bisect.bisect_right(xs, v) / len(xs) - bisect.bisect_right(ys, v) / len(ys)) for v in xs + ys)


def summary(values: list[float]) -> dict:
    """Median, quartiles, mean and spread of one sample (seconds)."""
    q = statistics.quantiles(values, n=4)
    return {"n": len(values), "median": statistics.median(values), "q1": q[0], "q3": q[2],
            "mean": statistics.fmean(values), "stdev": statistics.stdev(values),
            "min": min(values), "max": max(values)}


def _ranks(values: list[float]) -> tuple[list[float], float]:
    """Average ranks (1-based) and the tie term sum(t^3 - t) over groups of equal values."""
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks, ties, i = [0.0] * len(values), 0.0, 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t ** 3 - t
        i = j + 1
    return ranks, ties

