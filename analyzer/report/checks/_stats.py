"""The three statistics the checks need, on numpy and the standard library only.

``scipy.stats`` takes ~2 s to import on this project's machines and ``scipy.special`` ~0.25 s,
longer than a whole report on a small run; these match ``scipy.stats.linregress`` /
``binomtest(alternative="greater")`` / ``spearmanr`` (tests pin them against scipy.stats). Both
p-values are regularized incomplete beta functions, computed by its continued fraction.
"""
from __future__ import annotations

import math
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
        # two-sided Student t tail: P(|T| > |t|) = I_{df / (df + t^2)}(df / 2, 1 / 2)
        p = _betainc(df / 2.0, 0.5, df / (df + float(t) * float(t)))
    return Fit(float(slope), float(y.mean() - slope * x.mean()), r, p)


def binom_sf(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p): the one-sided ("greater") binomial test's p-value."""
    if k <= 0:
        return 1.0
    if k > n:
        return 0.0
    if p <= 0.0 or p >= 1.0:
        return 1.0 if p >= 1.0 else 0.0
    return _betainc(float(k), float(n - k + 1), p)  # P(X >= k) = I_p(k, n - k + 1)


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b), to about 1e-14 (Lentz's continued fraction)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only: use the symmetry
        return 1.0 - front * _beta_fraction(b, a, 1.0 - x) / b
    return front * _beta_fraction(a, b, x) / a


def _beta_fraction(a: float, b: float, x: float) -> float:
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < eps:
            break
    return h


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
