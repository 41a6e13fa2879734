"""Calibration as per-label log-prob offsets: `probs = softmax(scores + offsets)`.

Small models rank far better than they threshold (they favour one label whatever the input), so
two corrections are offered, both additive in log space:
- content-free (Zhao et al. 2021, "Calibrate before use"): offsets = -log p(label | an input with
  the content replaced by "N/A"), i.e. divide by the label prior the prompt alone induces;
- fitted: offsets that maximise the log-likelihood of a few labeled rows (a multinomial logistic
  fit with only a bias per label), solved by Newton's method.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationReport:
    n: int  # labeled rows that were scored
    failed: int  # rows whose scoring failed (left out of the fit)
    accuracy_before: float
    accuracy_after: float
    nll_before: float  # mean negative log-likelihood of the gold label
    nll_after: float
    offsets: dict[str, float]  # the fitted per-label log-prob offsets now applied


def log_softmax(xs: Sequence[float]) -> list[float]:
    m = max(xs)
    log_z = m + math.log(math.fsum(math.exp(x - m) for x in xs))
    return [x - log_z for x in xs]


def softmax(xs: Sequence[float]) -> list[float]:
    return [math.exp(x) for x in log_softmax(xs)]


def content_free_offsets(cf_scores: Sequence[float]) -> tuple[float, ...]:
    """Offsets that make the content-free input uniform over the labels."""
    return tuple(-x for x in log_softmax(cf_scores))


def accuracy(scores: Sequence[Sequence[float]], gold: Sequence[int], offsets: Sequence[float]) -> float:
    hits = sum(
        _argmax([s + b for s, b in zip(row, offsets, strict=True)]) == g
        for row, g in zip(scores, gold, strict=True)
    )
    return hits / len(gold) if gold else math.nan


def mean_nll(scores: Sequence[Sequence[float]], gold: Sequence[int], offsets: Sequence[float]) -> float:
    total = math.fsum(
        -log_softmax([s + b for s, b in zip(row, offsets, strict=True)])[g]
        for row, g in zip(scores, gold, strict=True)
    )
    return total / len(gold) if gold else math.nan


def fit_offsets(
    scores: Sequence[Sequence[float]], gold: Sequence[int], *, l2: float = 1e-2, iters: int = 50
) -> tuple[float, ...]:
    """Per-label offsets b minimising mean NLL(softmax(scores + b), gold) + l2/2 * |b|^2.

    Convex, so Newton's method with backtracking converges in a few steps. The small L2 term keeps
    b finite when the rows cannot pin it (e.g. every gold label is the same) and picks the
    zero-sum solution of the shift-invariant softmax.
    """
    if not scores:
        raise ValueError("fit_offsets needs at least one labeled row")
    k = len(scores[0])
    b = [0.0] * k

    def objective(b: Sequence[float]) -> float:
        return mean_nll(scores, gold, b) + 0.5 * l2 * math.fsum(x * x for x in b)

    f = objective(b)
    n = len(scores)
    for _ in range(iters):
        grad = [l2 * x for x in b]
        hess = [[l2 if i == j else 0.0 for j in range(k)] for i in range(k)]
        for row, g in zip(scores, gold, strict=True):
            p = softmax([s + x for s, x in zip(row, b, strict=True)])
            for i in range(k):
                grad[i] += (p[i] - (i == g)) / n
                for j in range(k):
                    hess[i][j] += ((p[i] if i == j else 0.0) - p[i] * p[j]) / n
        if max(abs(x) for x in grad) < 1e-10:
            break
        step = _solve(hess, grad)
        t = 1.0
        while t > 1e-8:
            cand = [x - t * s for x, s in zip(b, step, strict=True)]
            fc = objective(cand)
            if fc <= f:
                break
            t /= 2
        else:
            break
        b, f = cand, fc
    return tuple(b)


def _solve(a: list[list[float]], y: list[float]) -> list[float]:
    """Solve a x = y by Gaussian elimination with partial pivoting (a is small and SPD)."""
    k = len(y)
    m = [row[:] + [y[i]] for i, row in enumerate(a)]
    for c in range(k):
        p = max(range(c, k), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, k):
            f = m[r][c] / m[c][c]
            for j in range(c, k + 1):
                m[r][j] -= f * m[c][j]
    x = [0.0] * k
    for r in range(k - 1, -1, -1):
        x[r] = (m[r][k] - sum(m[r][j] * x[j] for j in range(r + 1, k))) / m[r][r]
    return x


def _argmax(xs: Sequence[float]) -> int:
    return max(range(len(xs)), key=lambda i: xs[i])
