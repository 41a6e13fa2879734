"""Job-completion-time model: predicted seconds of one engine step from its token counts.

Prefill-only jobs produce one token, so a step's time is a function of what it computes. Per item
of a step, with new = n_input - n_cached tokens to compute:

    seconds = c_step + c_item * items + c_new * sum(new) + c_attn * sum(new * n_input)
              + c_cached * sum(n_cached)

the linear layers cost per new token, attention per (new token, attended token) pair, a cached
prefix costs its gather, and a step / an item a fixed overhead. The coefficients come from timed
steps: a few short ones at start (seconds) or a full grid (minutes), persisted per model / dtype /
device / machine (both in `po_backend.serving.jct_profile`, which needs the engine). Online,
`CalibratedJCT` corrects them from measured step times (a running factor) and, when asked to,
refits them on the real steps it has seen (`refine_every`). This module is the model alone: numpy
only, so the scheduler, the simulator and a router use it without torch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FEATURES = ("step", "items", "new_ktok", "attn_mtok2", "cached_ktok")
PROFILE_VERSION = 2  # bump when the grid or the features change: old profiles are ignored
# Where a model's coefficients came from: the full profile grid, a start-up estimate of a few short
# steps, that estimate (or a loaded profile) refitted on real steps, or no measurement at all.
SOURCES = ("grid", "quick", "refined", "proxy")


# ---- samples and fitting --------------------------------------------------------------------


@dataclass(frozen=True)
class JCTSample:
    """One measured step: (n_input, n_cached) of each item and the step's wall seconds."""

    items: tuple[tuple[int, int], ...]
    seconds: float

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError("a step has at least one item")
        if not all(0 <= c < n for n, c in self.items):
            raise ValueError(f"need 0 <= n_cached < n_input: {self.items}")


def feature_values(items: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """The regression features of one step (see the module docstring), in FEATURES order, as plain
    floats: pricing one request this way costs less than building an array."""
    new = sum(n - c for n, c in items)
    attn = sum((n - c) * n for n, c in items)
    cached = sum(c for _, c in items)
    return (1.0, float(len(items)), new / 1e3, attn / 1e6, cached / 1e3)


def _dot(values: Sequence[float], coef: Sequence[float]) -> float:
    """A step's predicted seconds from its `feature_values`: five products, cheaper in plain Python
    than through an array."""
    return float(sum(v * c for v, c in zip(values, coef, strict=True)))


def features(items: Sequence[tuple[int, int]]) -> np.ndarray:
    """`feature_values` as an array (fitting stacks them)."""
    return np.array(feature_values(items))


@dataclass(frozen=True)
class FitQuality:
    """How well the model predicts steps it was not fitted on (leave-one-out over the profile)."""

    pearson_r: float
    median_abs_error_s: float
    median_rel_error: float
    samples: int


def pearson_r(xs: Sequence[float], ys: Sequence[float]) -> float:
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return math.nan
    return float(np.corrcoef(x, y)[0, 1])


def prediction_quality(predicted: Sequence[float], measured: Sequence[float]) -> FitQuality:
    """r and median errors of predictions against measured seconds (held out by the caller)."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    if len(p) == 0:
        return FitQuality(math.nan, math.nan, math.nan, 0)
    err = np.abs(p - m)
    return FitQuality(
        pearson_r=pearson_r(predicted, measured),
        median_abs_error_s=float(np.median(err)),
        median_rel_error=float(np.median(err / m)),
        samples=len(p),
    )


def _nonneg_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Least squares with coefficients >= 0: a negative cost is noise fitted, and would let a
    longer request be predicted faster. Active set: drop the most negative, refit."""
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        del active[int(np.argmin(sol))]
    return coef


def _fit_coef(samples: Sequence[JCTSample], weights: Sequence[float] | None = None) -> np.ndarray:
    x = np.stack([features(s.items) for s in samples])
    y = np.array([s.seconds for s in samples])
    if not (y > 0).all():
        raise ValueError("step times must be positive")
    # Relative error, not absolute: a 50 ms step mispredicted by 50 ms matters as much to the
    # ordering as a 5 s one mispredicted by 5 s. Divide each row by its target.
    a, b = x / y[:, None], np.ones(len(y))
    if weights is not None:
        w = np.sqrt(np.asarray(weights, dtype=float))
        a, b = a * w[:, None], b * w
    return _nonneg_lstsq(a, b)


@dataclass(frozen=True)
class JCTModel:
    """Frozen coefficients (seconds per FEATURES unit) and the fit's held-out quality."""

    coef: tuple[float, ...]
    quality: FitQuality | None = None
    key: dict[str, Any] = field(default_factory=dict)  # what the profile was measured on
    source: str = "grid"  # one of SOURCES

    def __post_init__(self) -> None:
        if len(self.coef) != len(FEATURES):
            raise ValueError(f"need {len(FEATURES)} coefficients, got {len(self.coef)}")
        if not all(c >= 0 for c in self.coef):
            raise ValueError(f"coefficients must be >= 0: {self.coef}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")

    @classmethod
    def proxy(cls, seconds_per_ktok: float = 1.0, attn_per_mtok2: float = 0.0) -> JCTModel:
        """A model without profiling: JCT proportional to the new tokens (the paper's r=0.987
        proxy n_input - n_cached), plus optional attention cost. For tests and fallbacks."""
        return cls((0.0, 0.0, seconds_per_ktok, attn_per_mtok2, 0.0), source="proxy")

    def predict_items(self, items: Sequence[tuple[int, int]]) -> float:
        """Predicted seconds of one step over items (n_input, n_cached)."""
        return _dot(feature_values(items), self.coef)

    def predict(self, n_input: int, n_cached: int, n_items: int = 1) -> float:
        """Predicted seconds of a step of `n_items` items, each n_input tokens with n_cached cached.
        The scheduler prices every waiting request with this before every step: no list, no array."""
        if not (0 <= n_cached <= n_input and n_items >= 1):
            raise ValueError(f"bad shape n_input={n_input} n_cached={n_cached} n_items={n_items}")
        # A fully cached prompt still computes its last token (ScoreRequest.reusable_len).
        c = min(n_cached, n_input - 1)
        new = n_items * (n_input - c)
        k0, k1, k2, k3, k4 = self.coef  # FEATURES order, as feature_values
        return k0 + k1 * n_items + k2 * (new / 1e3) + k3 * (new * n_input / 1e6) + k4 * (n_items * c / 1e3)

    @classmethod
    def fit(
        cls, samples: Sequence[JCTSample], key: dict[str, Any] | None = None, source: str = "grid"
    ) -> JCTModel:
        """Fit on all samples; quality from leave-one-out predictions (each sample predicted by
        a model fitted without it)."""
        if len(samples) < len(FEATURES) + 1:
            raise ValueError(
                f"need more than {len(FEATURES)} samples to fit and validate, got {len(samples)}"
            )
        coef = _fit_coef(samples)
        held = []
        for i in range(len(samples)):
            c = _fit_coef([s for j, s in enumerate(samples) if j != i])
            held.append(float(features(samples[i].items) @ c))
        quality = prediction_quality(held, [s.seconds for s in samples])
        return cls(tuple(float(c) for c in coef), quality, dict(key or {}), source)

    # ---- serialisation (files: jct_store.save_model / load_jct_model) ---------------------------

    def to_json(self, samples: Sequence[JCTSample] = ()) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "features": list(FEATURES),
            "coef": list(self.coef),
            "quality": asdict(self.quality) if self.quality else None,
            "key": self.key,
            "source": self.source,
            "samples": [{"items": [list(it) for it in s.items], "seconds": s.seconds} for s in samples],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JCTModel:
        if data.get("version") != PROFILE_VERSION or data.get("features") != list(FEATURES):
            raise ValueError(
                f"JCT profile version {data.get('version')} / features {data.get('features')} are not "
                f"{PROFILE_VERSION} / {list(FEATURES)}"
            )
        q = data.get("quality")
        return cls(
            tuple(float(c) for c in data["coef"]),
            FitQuality(**q) if q else None,
            data.get("key", {}),
            data.get("source", "grid"),
        )

    @staticmethod
    def samples_from_json(data: dict[str, Any]) -> list[JCTSample]:
        """The timed steps a persisted profile was fitted on (what `to_json` wrote)."""
        return [
            JCTSample(tuple((int(n), int(c)) for n, c in s["items"]), float(s["seconds"]))
            for s in data.get("samples", [])
        ]


# ---- continuous calibration -----------------------------------------------------------------


class CalibratedJCT:
    """A JCTModel times an online correction factor, and optionally refitted on real steps.

    The factor is the EWMA of log(measured / predicted) step time. It absorbs what the profile
    could not see (another process sharing the CPU, thermal state, a different mix of batch
    shapes). Updated by the engine loop's thread only; one instance may outlive a loop, so a
    restarted loop keeps what was learned.

    refine_every > 0 also refits the coefficients every that many observed steps, on the real
    steps of a bounded window plus `anchors` (the timed steps the model was fitted on). A start-up
    estimate timed on a few short steps extrapolates to long prompts; the real steps fix that
    where the traffic lives, and the anchors, kept at `anchor_share` of the fit's weight, hold
    the shapes the traffic has not shown yet. After a refit the factor is recomputed over the
    latest steps against the new coefficients (they already carry the machine's level).
    `on_refit(self)` runs after each refit (on the observing thread: keep it short).

    Measured from a full profile (bench_schedule): raw r 0.975, calibrated 0.989; refitting on
    top gave the same r, so a full-grid profile needs no refinement. A start-up estimate does."""

    def __init__(
        self,
        model: JCTModel,
        alpha: float = 0.2,
        clamp: tuple[float, float] = (0.25, 4.0),
        *,
        refine_every: int = 0,
        anchors: Sequence[JCTSample] = (),
        window: int = 512,
        anchor_share: float = 0.2,
        on_refit: Callable[[CalibratedJCT], None] | None = None,
    ) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if refine_every < 0 or window < len(FEATURES) + 1:
            raise ValueError(f"need refine_every >= 0 and window > {len(FEATURES)}")
        if not 0 <= anchor_share < 1:
            raise ValueError(f"anchor_share must be in [0, 1), got {anchor_share}")
        self.model = model
        self.alpha = alpha
        self.clamp = clamp
        self.refine_every = refine_every
        self.anchors = tuple(anchors)[-window:]  # a profile refined over many runs stays bounded
        self.anchor_share = anchor_share
        self.on_refit = on_refit
        self._log_factor = 0.0
        self.observations = 0
        self.refits = 0
        self._window: deque[JCTSample] = deque(maxlen=window)
        # (prediction made before the step was seen, measured): held out by construction
        self._online: deque[tuple[float, float]] = deque(maxlen=window)

    @property
    def factor(self) -> float:
        return math.exp(self._log_factor)

    @property
    def quality(self) -> FitQuality | None:
        return self.model.quality

    def online_quality(self) -> FitQuality:
        """How the calibrated predictions did on the recent steps, each predicted before it ran."""
        return prediction_quality([p for p, _ in self._online], [m for _, m in self._online])

    def samples(self) -> list[JCTSample]:
        """What a refit uses (and a persisted refined profile keeps): anchors, then real steps."""
        return [*self.anchors, *self._window]

    def predict_items(self, items: Sequence[tuple[int, int]]) -> float:
        return self.model.predict_items(items) * self.factor

    def predict(self, n_input: int, n_cached: int, n_items: int = 1) -> float:
        return self.model.predict(n_input, n_cached, n_items) * self.factor

    def observe(self, items: Sequence[tuple[int, int]], seconds: float) -> float:
        """Fold one measured step in; returns the new factor. One outlier (a step that shared the
        CPU with something else) moves the factor by at most alpha * log(clamp)."""
        raw = self.model.predict_items(items)
        if raw <= 0 or seconds <= 0 or not math.isfinite(seconds):
            return self.factor
        self._online.append((raw * self.factor, seconds))
        self._fold(raw, seconds)
        self.observations += 1
        if self.refine_every and all(n >= 1 for n, _ in items):
            # a fully cached prompt still computes its last token (as `JCTModel.predict` prices it)
            self._window.append(JCTSample(tuple((n, min(max(c, 0), n - 1)) for n, c in items), seconds))
            if self.observations % self.refine_every == 0:
                self.refit()
        return self.factor

    def _fold(self, raw: float, seconds: float) -> None:
        lo, hi = self.clamp
        ratio = min(max(seconds / raw, lo), hi)
        self._log_factor += self.alpha * (math.log(ratio) - self._log_factor)

    def refit(self) -> bool:
        """Refit the coefficients on anchors + the real steps seen (see the class docstring);
        False when there are too few steps or the fit is degenerate (the model is kept)."""
        window = list(self._window)
        if len(window) < len(FEATURES) + 1:
            return False
        w_anchor = 1.0
        if self.anchors:
            # anchors hold anchor_share of the weight once the window outweighs them
            w_anchor = max(1.0, self.anchor_share / (1 - self.anchor_share) * len(window) / len(self.anchors))
        coef = _fit_coef([*self.anchors, *window], [w_anchor] * len(self.anchors) + [1.0] * len(window))
        if not coef.any():
            return False
        self.model = JCTModel(tuple(float(c) for c in coef), self.online_quality(), self.model.key, "refined")
        # Replay the latest steps so the factor is relative to the new coefficients.
        self._log_factor = 0.0
        for s in window[-math.ceil(3 / self.alpha) :]:
            raw = self.model.predict_items(s.items)
            if raw > 0:
                self._fold(raw, s.seconds)
        self.refits += 1
        if self.on_refit is not None:
            self.on_refit(self)
        return True
