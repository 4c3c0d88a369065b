"""The three statistics the checks need, on numpy + ``scipy.special`` only.

``scipy.stats`` takes ~2 s to import on this project's machines, longer than a whole report on
a small run; these match ``scipy.stats.linregress`` / ``binomtest(alternative="greater")`` /
``spearmanr`` (tests pin them against scipy.stats).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Fit", "linregress", "binom_sf", "spearman"]


class Fit(NamedTuple):
    slope: float
    intercept: float
    rvalue: float
    pvalue: float  # two-sided, H0: slope == 0 (t-test with n-2 degrees of freedom)


def linregress(x, y) -> Fit:
    """Least-squares line through (x, y) with the two-sided p-value of its slope."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    n = x.size
    xm, ym = x - x.mean(), y - y.mean()
    sxx, syy, sxy = (xm * xm).sum(), (ym * ym).sum(), (xm * ym).sum()
    if n < 3 or sxx == 0:
        return Fit(0.0, float(y.mean()) if n else 0.0, 0.0, 1.0)
    slope = sxy / sxx
    r = 0.0 if syy == 0 else float(np.clip(sxy / np.sqrt(sxx * syy), -1.0, 1.0))
    df = n - 2
    if abs(r) >= 1.0:
        p = 0.0
    else:
        t = r * np.sqrt(df / ((1.0 - r) * (1.0 + r)))
        from scipy import special  # NB: ~0.25 s to import; only a fit that needs its p-value pays it

        p = float(2 * special.stdtr(df, -abs(t)))
    return Fit(float(slope), float(y.mean() - slope * x.mean()), r, p)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): the one-sided ("greater") binomial test's p-value."""
    if k <= 0:
        return 1.0
    from scipy import special  # as in linregress

    return float(special.bdtrc(k - 1, n, p))


def _ranks(a: np.ndarray) -> np.ndarray:
    order = np.argsort(a, kind="mergesort")
    ranks = np.empty(a.size, float)
    ranks[order] = np.arange(a.size)
    _, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return (sums / counts)[inv]  # ties get their average rank


def spearman(x, y) -> float:
    """Spearman rank correlation of x and y."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if x.size < 3:
        return 0.0
    return linregress(_ranks(x), _ranks(y)).rvalue
