"""The confidence interval the benchmarks quote for a mean of paired ratios."""

from __future__ import annotations

import statistics

# Two-sided 95% Student t quantiles by degrees of freedom (above 30: 30's,
# slightly wide).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def ratio_interval(ratios: list[float]) -> tuple[float, float]:
    """95% confidence interval of the mean of paired ratios (each pair run
    back to back, so drift mostly cancels within it)."""
    n = len(ratios)
    mean = statistics.fmean(ratios)
    if n < 2:
        return mean, mean
    t = T95[max(d for d in T95 if d <= n - 1)]
    half = t * statistics.stdev(ratios) / n ** 0.5
    return mean - half, mean + half
