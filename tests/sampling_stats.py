"""Goodness-of-fit helpers for the statistical tests of speculative sampling (test-only).

A test counts what the verifier committed over many runs and compares the counts with the target's exact
distribution, in float64. Outcomes the target gives probability 0 (outside the top-p nucleus) must never
occur. Each test also shows its own power: the same counts are rejected against a distribution that is
only a little wrong.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

ALPHA = 1e-3                          # a fit is rejected below this p-value


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit of integer counts to probs (float64, renormalised); cells with expected
    count < 5 are merged into one. An outcome that probs gives probability 0 is an outright rejection (0.0)."""
    counts = np.asarray(counts, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts.shape != probs.shape:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} must have one cell each")
    probs = probs / probs.sum()
    if counts[probs == 0].any():
        return 0.0
    possible = probs > 0
    expected = probs[possible] * counts.sum()
    counts = counts[possible]
    small = expected < 5
    obs, exp = counts[~small], expected[~small]
    if small.any():
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, expected[small].sum())
    return float(stats.chisquare(obs, exp).pvalue)


def assert_fits(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    """counts are draws from probs: none where probs is 0, and the chi-square test does not reject."""
    probs = np.asarray(probs, dtype=np.float64)
    impossible = np.flatnonzero((probs == 0) & (np.asarray(counts) > 0))
    assert impossible.size == 0, f"{what}: outcomes {impossible.tolist()} have target probability 0"
    p = chi2_pvalue(counts, probs)
    assert p > ALPHA, f"{what}: chi-square p = {p:.2e} (counts do not follow the target)"


def assert_rejects(counts: np.ndarray, wrong: np.ndarray, what: str) -> None:
    """Power: the same counts do not fit `wrong`, a distribution a little off the target."""
    p = chi2_pvalue(counts, wrong)
    assert p < ALPHA, f"{what}: chi-square p = {p:.2e} against a wrong distribution; the test lacks power"


def skewed(probs: np.ndarray, by: float) -> np.ndarray:
    """probs with every cell scaled by a factor in [1 - by, 1 + by] (a fixed pattern), renormalised; zero
    cells stay zero."""
    probs = np.asarray(probs, dtype=np.float64)
    out = probs * (1 + by * np.cos(np.arange(probs.size) * 2.4))
    return out / out.sum()
