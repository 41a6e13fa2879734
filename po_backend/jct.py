"""Job-completion-time model: predicted seconds of one engine step from its token counts.

Prefill-only jobs produce one token, so a step's time is a function of what it computes. Per item
of a step, with new = n_input - n_cached tokens to compute:

    seconds = c_step + c_item * items + c_new * sum(new) + c_attn * sum(new * n_input)
              + c_cached * sum(n_cached)

the linear layers cost per new token, attention per (new token, attended token) pair, a cached
prefix costs its gather, and a step / an item a fixed overhead. The coefficients are fitted at
start on a small grid of timed steps (`profile`), persisted per model / dtype / device / machine
(`load_or_profile`), and corrected online by `CalibratedJCT` from measured step times.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from po_backend.config import cpu_model
from po_backend.engine import Engine, ScoreRequest
from po_backend.models.loader import cache_root

log = logging.getLogger(__name__)

FEATURES = ("step", "items", "new_ktok", "attn_mtok2", "cached_ktok")
PROFILE_VERSION = 1  # bump when the grid or the features change: old profiles are ignored
MIN_PERSIST_R = 0.97  # a worse held-out fit was measured on a busy machine: not worth keeping


# ---- samples and fitting --------------------------------------------------------------------


@dataclass(frozen=True)
class JCTSample:
    """One measured step: (n_input, n_cached) of each item and the step's wall seconds."""

    items: tuple[tuple[int, int], ...]
    seconds: float

    def __post_init__(self) -> None:
        assert self.items, "a step has at least one item"
        assert all(0 <= c < n for n, c in self.items), f"need 0 <= n_cached < n_input: {self.items}"


def features(items: Sequence[tuple[int, int]]) -> np.ndarray:
    """The regression features of one step (see the module docstring), in FEATURES order."""
    new = sum(n - c for n, c in items)
    attn = sum((n - c) * n for n, c in items)
    cached = sum(c for _, c in items)
    return np.array([1.0, float(len(items)), new / 1e3, attn / 1e6, cached / 1e3])


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


def _fit_coef(samples: Sequence[JCTSample]) -> np.ndarray:
    x = np.stack([features(s.items) for s in samples])
    y = np.array([s.seconds for s in samples])
    assert (y > 0).all(), "step times must be positive"
    # Relative error, not absolute: a 50 ms step mispredicted by 50 ms matters as much to the
    # ordering as a 5 s one mispredicted by 5 s. Divide each row by its target.
    return _nonneg_lstsq(x / y[:, None], np.ones(len(y)))


@dataclass(frozen=True)
class JCTModel:
    """Frozen coefficients (seconds per FEATURES unit) and the fit's held-out quality."""

    coef: tuple[float, ...]
    quality: FitQuality | None = None
    key: dict[str, Any] = field(default_factory=dict)  # what the profile was measured on

    def __post_init__(self) -> None:
        assert len(self.coef) == len(FEATURES), f"need {len(FEATURES)} coefficients, got {len(self.coef)}"
        assert all(c >= 0 for c in self.coef), f"coefficients must be >= 0: {self.coef}"

    @classmethod
    def proxy(cls, seconds_per_ktok: float = 1.0, attn_per_mtok2: float = 0.0) -> JCTModel:
        """A model without profiling: JCT proportional to the new tokens (the paper's r=0.987
        proxy n_input - n_cached), plus optional attention cost. For tests and fallbacks."""
        return cls((0.0, 0.0, seconds_per_ktok, attn_per_mtok2, 0.0))

    def predict_items(self, items: Sequence[tuple[int, int]]) -> float:
        """Predicted seconds of one step over items (n_input, n_cached)."""
        return float(features(items) @ np.asarray(self.coef))

    def predict(self, n_input: int, n_cached: int, n_items: int = 1) -> float:
        """Predicted seconds of a step of `n_items` items, each n_input tokens with n_cached cached."""
        assert 0 <= n_cached <= n_input and n_items >= 1, (
            f"bad shape n_input={n_input} n_cached={n_cached} n_items={n_items}"
        )
        # A fully cached prompt still computes its last token (engine.match_limit).
        return self.predict_items([(n_input, min(n_cached, n_input - 1))] * n_items)

    @classmethod
    def fit(cls, samples: Sequence[JCTSample], key: dict[str, Any] | None = None) -> JCTModel:
        """Fit on all samples; quality from leave-one-out predictions (each sample predicted by
        a model fitted without it)."""
        assert len(samples) >= len(FEATURES) + 1, (
            f"need more than {len(FEATURES)} samples to fit and validate, got {len(samples)}"
        )
        coef = _fit_coef(samples)
        held = []
        for i in range(len(samples)):
            c = _fit_coef([s for j, s in enumerate(samples) if j != i])
            held.append(float(features(samples[i].items) @ c))
        measured = [s.seconds for s in samples]
        err = np.abs(np.array(held) - np.array(measured))
        quality = FitQuality(
            pearson_r=pearson_r(held, measured),
            median_abs_error_s=float(np.median(err)),
            median_rel_error=float(np.median(err / np.array(measured))),
            samples=len(samples),
        )
        return cls(tuple(float(c) for c in coef), quality, dict(key or {}))

    # ---- persistence ------------------------------------------------------------------------

    def to_json(self, samples: Sequence[JCTSample] = ()) -> dict[str, Any]:
        return {
            "version": PROFILE_VERSION,
            "features": list(FEATURES),
            "coef": list(self.coef),
            "quality": asdict(self.quality) if self.quality else None,
            "key": self.key,
            "samples": [{"items": [list(it) for it in s.items], "seconds": s.seconds} for s in samples],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JCTModel:
        assert data.get("version") == PROFILE_VERSION and data.get("features") == list(FEATURES), (
            f"JCT profile version {data.get('version')} / features {data.get('features')} are not "
            f"{PROFILE_VERSION} / {list(FEATURES)}"
        )
        q = data.get("quality")
        return cls(tuple(float(c) for c in data["coef"]), FitQuality(**q) if q else None, data.get("key", {}))

    def save(self, path: Path, samples: Sequence[JCTSample] = ()) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(samples), indent=1))
        tmp.replace(path)  # atomic: a concurrent start never reads half a file

    @classmethod
    def load(cls, path: Path) -> JCTModel:
        return cls.from_json(json.loads(path.read_text()))


# ---- continuous calibration -----------------------------------------------------------------


class CalibratedJCT:
    """A JCTModel times an online correction factor: the EWMA of log(measured / predicted) step
    time. It absorbs what the profile could not see (another process sharing the CPU, thermal
    state, a different mix of batch shapes). Updated by the engine loop's thread only; one instance
    may outlive a loop, so a restarted loop keeps what was learned.

    Measured (bench_schedule, 1655 steps): raw r 0.975, calibrated 0.989. The profile's shape
    drifts too (cold steps ran ~13% over it, cached ones ~33%), but the EWMA follows the mix of
    the moment; refitting per-feature gains online on a window of steps gave the same r (0.989)
    and was dropped."""

    def __init__(self, model: JCTModel, alpha: float = 0.2, clamp: tuple[float, float] = (0.25, 4.0)) -> None:
        assert 0 < alpha <= 1, f"alpha must be in (0, 1], got {alpha}"
        self.model = model
        self.alpha = alpha
        self.clamp = clamp
        self._log_factor = 0.0
        self.observations = 0

    @property
    def factor(self) -> float:
        return math.exp(self._log_factor)

    @property
    def quality(self) -> FitQuality | None:
        return self.model.quality

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
        lo, hi = self.clamp
        ratio = min(max(seconds / raw, lo), hi)
        self._log_factor += self.alpha * (math.log(ratio) - self._log_factor)
        self.observations += 1
        return self.factor


# ---- profiling on an engine -----------------------------------------------------------------


@dataclass(frozen=True)
class ProfileGrid:
    """What `profile` times. Every length runs cold and with the given fractions cached; each
    batch is (items, shared cached prefix tokens, tokens per item), prefix 0 = unrelated items."""

    lengths: tuple[int, ...] = (128, 512, 1024, 2048)
    cached_fractions: tuple[float, ...] = (0.5, 0.9)
    batches: tuple[tuple[int, int, int], ...] = ((4, 1024, 128), (8, 512, 64), (4, 0, 256))


DEFAULT_GRID = ProfileGrid()


def _rand_ids(gen: torch.Generator, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab, (n,), generator=gen).tolist())


def profile(
    engine: Engine,
    grid: ProfileGrid = DEFAULT_GRID,
    *,
    seed: int = 0,
    timer: Callable[[], float] = time.perf_counter,
) -> list[JCTSample]:
    """Time `engine.step` on synthetic requests over `grid` (flushes the cache: run it before
    serving). Cached states are built by the cold run of the same tokens, and each sample records
    the cached tokens the engine actually served, so a pool too small to hold a prefix gives
    honest (uncached) samples instead of wrong ones."""
    cfg = engine.config
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.vocab_size
    labels = (0,)
    limit = min(cfg.max_input_len, cfg.max_batch_tokens)
    samples: list[JCTSample] = []

    def timed(reqs: list[ScoreRequest]) -> JCTSample:
        t = timer()
        results = engine.step(reqs)
        return JCTSample(tuple((r.prompt_tokens, r.cached_tokens) for r in results), timer() - t)

    engine.flush_cache()
    timed([ScoreRequest(_rand_ids(gen, vocab, min(64, limit)), labels, cache_prefix_len=0)])  # warm-up
    for n in sorted({min(n, limit) for n in grid.lengths if n >= 2}):
        engine.flush_cache()
        base = _rand_ids(gen, vocab, n)
        cuts = sorted({min(n - 1, round(f * n)) for f in grid.cached_fractions if 0 < f < 1} - {0})
        if engine.cache is None:
            cuts = []
        # The cold sample caches the longest cut; shorter cuts match part of it (a node split).
        samples.append(timed([ScoreRequest(base, labels, cache_prefix_len=max(cuts, default=0))]))
        for c in cuts:
            tail = _rand_ids(gen, vocab, n - c)
            if tail[0] == base[c]:  # the match would run one token past the cut
                tail = ((tail[0] + 1) % vocab, *tail[1:])
            ids = base[:c] + tail
            samples.append(timed([ScoreRequest(ids, labels, cache_prefix_len=c)]))  # stores nothing new
    for k, prefix, item in grid.batches:
        if k * item > cfg.max_batch_tokens or prefix + item > cfg.max_input_len:
            continue
        engine.flush_cache()
        shared = _rand_ids(gen, vocab, prefix)
        if prefix and engine.cache is not None:
            samples.append(
                timed([ScoreRequest(shared + _rand_ids(gen, vocab, item), labels, cache_prefix_len=prefix)])
            )
        reqs = [
            ScoreRequest(shared + _rand_ids(gen, vocab, item), labels, cache_prefix_len=prefix)
            for _ in range(k)
        ]
        samples.append(timed(reqs))
    engine.flush_cache()
    return samples


def min_merge(a: Sequence[JCTSample], b: Sequence[JCTSample]) -> list[JCTSample]:
    """Point by point the faster of two timings of the same grid (same shapes in the same order;
    a point whose shapes differ, e.g. a prefix the pool could not hold once, keeps both)."""
    out: list[JCTSample] = []
    for x, y in zip(a, b, strict=True):
        if x.items == y.items:
            out.append(x if x.seconds <= y.seconds else y)
        else:
            out += [x, y]
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def profile_key(engine: Engine, grid: ProfileGrid = DEFAULT_GRID) -> dict[str, Any]:
    """What a step's speed depends on: architecture (not weight values), dtype, device, machine,
    threads, chunking, torch version, grid."""
    cfg = engine.config
    return {
        "model_path": str(engine.model_path),
        "arch": hashlib.sha256(repr(engine.model_config).encode()).hexdigest()[:16],
        "dtype": str(cfg.dtype),
        "device": str(cfg.device),
        "machine": _device_name(cfg.device),
        "threads": torch.get_num_threads(),
        "chunk_size": cfg.chunk_size,
        "prefill_mode": cfg.prefill_mode,
        "torch": torch.__version__,
        "grid": repr(grid),
        "version": PROFILE_VERSION,
    }


def profile_path(key: dict[str, Any], root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root or cache_root() / "jct") / f"{digest}.json"


def load_or_profile(
    engine: Engine, grid: ProfileGrid = DEFAULT_GRID, *, refresh: bool = False, root: Path | None = None
) -> JCTModel:
    """The persisted JCT model for this engine and machine, or a fresh profile (then saved)."""
    key = profile_key(engine, grid)
    path = profile_path(key, root)
    if not refresh and path.is_file():
        try:
            model = JCTModel.load(path)
            if model.key == key:
                log.info("JCT profile loaded from %s (r=%s)", path, model.quality and model.quality.pearson_r)
                return model
        except (OSError, ValueError, AssertionError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable JCT profile %s: %s", path, e)
    t = time.perf_counter()
    samples = profile(engine, grid)
    model = JCTModel.fit(samples, key)
    q = model.quality
    if q is None or not q.pearson_r >= MIN_PERSIST_R:
        # Another process stealing the CPU only ever makes a step slower: time the grid once
        # more and keep each point's faster run (costs a second pass only on a poor first fit).
        log.info("JCT profile fit is poor (held-out r=%.3f): timing the grid once more", q and q.pearson_r)
        samples = min_merge(samples, profile(engine, grid))
        model = JCTModel.fit(samples, key)
        q = model.quality
    log.info(
        "JCT profile: %d steps in %.1f s, held-out r=%.3f, median error %.1f ms (%.0f%%); saved to %s",
        len(samples),
        time.perf_counter() - t,
        q.pearson_r if q else math.nan,
        1e3 * q.median_abs_error_s if q else math.nan,
        100 * q.median_rel_error if q else math.nan,
        path,
    )
    if q is None or not q.pearson_r >= MIN_PERSIST_R:
        # Most likely something else was using the machine while we timed: use this fit now,
        # but do not make every later start inherit it.
        log.warning("JCT profile fit is poor (held-out r=%s): not saved, will profile again", q)
        return model
    try:
        model.save(path, samples)
    except OSError as e:  # a read-only home must not stop the server
        log.warning("could not save the JCT profile to %s: %s", path, e)
    return model
