"""Fitting the JCT model on an engine: time synthetic steps (`profile`), keep the fit per model /
dtype / device / machine so later starts reuse it, and pick the model a server starts with
(`startup_jct`: a persisted profile, else a few seconds of timing refined from real steps).

Processes of one machine share the persisted files: measuring one takes an OS file lock, so
concurrent workers (launch_cluster) measure once and the others load it. The model itself
(`po_backend.sched.jct`) is numpy only; this half needs the engine and torch.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from po_backend.core.cpu import cpu_model
from po_backend.core.request import ScoreRequest
from po_backend.engine.engine import Engine
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import FEATURES, PROFILE_VERSION, CalibratedJCT, JCTModel, JCTSample, features
from po_backend.serving.jct_store import (
    Persister,
    load_samples,
    profile_lock,
    profile_path,
    save_quietly,
    try_load,
)

log = logging.getLogger(__name__)


MIN_PERSIST_R = 0.97  # a worse held-out fit was measured on a busy machine: not worth keeping


@dataclass(frozen=True)
class ProfileGrid:
    """What `profile` times. Every length runs cold and with the given fractions cached; each
    batch is (items, shared cached prefix tokens, tokens per item), prefix 0 = unrelated items.

    `lengths` is the dense part; `long_points` more lengths reach the engine's longest prompt
    (its limit, then halvings of it while above the dense part), so the attention term is fitted
    where long prompts live instead of extrapolated. A long point runs cold and with the largest
    fraction cached only: that sample computes a few new tokens against a long context, the
    others would cost seconds each on a CPU and add little to the fit."""

    lengths: tuple[int, ...] = (128, 512, 1024, 2048)
    cached_fractions: tuple[float, ...] = (0.5, 0.9)
    batches: tuple[tuple[int, int, int], ...] = ((4, 1024, 128), (8, 512, 64), (4, 0, 256))
    long_points: int = 2

    def __post_init__(self) -> None:
        if self.long_points < 0:
            raise ValueError(f"long_points must be >= 0, got {self.long_points}")
        if not all(0 < f < 1 for f in self.cached_fractions):
            raise ValueError(f"cached_fractions must be in (0, 1), got {self.cached_fractions}")

    def dense_lengths(self, limit: int) -> list[int]:
        return sorted({min(n, limit) for n in self.lengths if n >= 2})

    def long_lengths(self, limit: int) -> list[int]:
        """The lengths beyond the dense part, longest first."""
        top = max(self.lengths, default=0)
        out: list[int] = []
        n = limit
        while n > top and len(out) < self.long_points:
            out.append(n)
            n //= 2
        return out


DEFAULT_GRID = ProfileGrid()
# The start-up estimate: short steps only (seconds on a CPU), cold and mostly cached, and one
# batch with a shared prefix, so every coefficient has a sample that moves it. Long prompts are
# extrapolated until real ones refine the fit (`startup_jct`).
QUICK_GRID = ProfileGrid(
    lengths=(128, 256, 512, 1024),
    cached_fractions=(0.875,),
    batches=((4, 256, 64), (4, 0, 128)),
    long_points=0,
)


def _rand_ids(gen: torch.Generator, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab, (n,), generator=gen).tolist())


def profile_limit(engine: Engine) -> int:
    """The longest single prompt one step can hold."""
    return min(engine.config.input_len, engine.config.batch_tokens)


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
    pool = engine.task.pooled  # a classifier or embedder answers pooled requests only
    labels = () if pool else (0,)
    limit = profile_limit(engine)
    samples: list[JCTSample] = []

    def timed(reqs: list[ScoreRequest]) -> JCTSample:
        t = timer()
        results = engine.step(reqs)
        return JCTSample(tuple((r.prompt_tokens, r.cached_tokens) for r in results), timer() - t)

    def one_length(n: int, fractions: Sequence[float]) -> None:
        engine.flush_cache()
        base = _rand_ids(gen, vocab, n)
        cuts = sorted({min(n - 1, round(f * n)) for f in fractions} - {0})
        if engine.cache is None:
            cuts = []
        # The cold sample caches the longest cut; shorter cuts match part of it (a node split).
        samples.append(timed([ScoreRequest(base, labels, pool=pool, cache_prefix_len=max(cuts, default=0))]))
        for c in cuts:
            tail = _rand_ids(gen, vocab, n - c)
            if tail[0] == base[c]:  # the match would run one token past the cut
                tail = ((tail[0] + 1) % vocab, *tail[1:])
            ids = base[:c] + tail
            samples.append(
                timed([ScoreRequest(ids, labels, pool=pool, cache_prefix_len=c)])
            )  # stores nothing new

    batches = [
        (k, prefix, item)
        for k, prefix, item in grid.batches
        if k * item <= cfg.batch_tokens and prefix + item <= cfg.input_len
    ]
    lengths = grid.dense_lengths(limit)
    longs = sorted(grid.long_lengths(limit))
    shapes, t0 = len(lengths) + len(longs) + len(batches), time.perf_counter()

    def done(i: int, what: str) -> None:
        log.info(
            "JCT profile %d/%d: %s (%d steps, %.1f s)",
            i,
            shapes,
            what,
            len(samples),
            time.perf_counter() - t0,
        )

    engine.flush_cache()
    timed(
        [ScoreRequest(_rand_ids(gen, vocab, min(64, limit)), labels, pool=pool, cache_prefix_len=0)]
    )  # warm-up
    for i, n in enumerate(lengths, 1):
        one_length(n, grid.cached_fractions)
        done(i, f"{n} tokens")
    longest_fraction = [max(grid.cached_fractions)] if grid.cached_fractions else []
    for i, n in enumerate(longs, len(lengths) + 1):
        one_length(n, longest_fraction)
        done(i, f"{n} tokens")
    for i, (k, prefix, item) in enumerate(batches, len(lengths) + len(longs) + 1):
        engine.flush_cache()
        shared = _rand_ids(gen, vocab, prefix)
        if prefix and engine.cache is not None:
            samples.append(
                timed(
                    [
                        ScoreRequest(
                            shared + _rand_ids(gen, vocab, item), labels, pool=pool, cache_prefix_len=prefix
                        )
                    ]
                )
            )
        reqs = [
            ScoreRequest(shared + _rand_ids(gen, vocab, item), labels, pool=pool, cache_prefix_len=prefix)
            for _ in range(k)
        ]
        samples.append(timed(reqs))
        done(i, f"batch of {k} x {prefix}+{item} tokens")
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


# ---- the key a profile is kept under ----------------------------------------------------------


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def profile_key(engine: Engine, grid: ProfileGrid = DEFAULT_GRID) -> dict[str, Any]:
    """What a step's speed depends on: architecture (not weight values), dtype, device, machine,
    threads, chunking, torch version, and the grid as this engine runs it (its lengths follow
    max_input_len)."""
    cfg = engine.config
    limit = profile_limit(engine)
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
        "lengths": grid.dense_lengths(limit) + sorted(grid.long_lengths(limit)),
        "version": PROFILE_VERSION,
    }


def _fit(samples: Sequence[JCTSample], key: dict[str, Any], source: str) -> JCTModel:
    """The fit, or with too few samples to fit every coefficient (an engine without a prefix
    cache, a short max_input_len), the new-token proxy scaled by the measured steps."""
    if len(samples) > len(FEATURES):
        return JCTModel.fit(samples, key, source)
    per_ktok = float(np.median([s.seconds / (features(s.items)[2] or 1e-3) for s in samples]))
    return JCTModel((0.0, 0.0, per_ktok, 0.0, 0.0), None, key, "proxy")


def measure(
    engine: Engine,
    grid: ProfileGrid,
    source: str,
    key: dict[str, Any] | None = None,
    *,
    retry: bool = True,
) -> tuple[JCTModel, list[JCTSample]]:
    """Time `grid` on `engine` and fit (nothing read or saved: `load_or_profile` and `startup_jct`
    add the persisted profile); the samples too. `key`: the profile's key (`profile_key` when
    None); with `retry`, a poor fit times the grid once more and keeps each point's faster run."""
    key = key if key is not None else profile_key(engine, grid)
    t = time.perf_counter()
    samples = profile(engine, grid)
    model = _fit(samples, key, source)
    q = model.quality
    if retry and (q is None or not q.pearson_r >= MIN_PERSIST_R):
        # Another process stealing the CPU only ever makes a step slower: time the grid once
        # more and keep each point's faster run (costs a second pass only on a poor first fit).
        log.info("JCT profile fit is poor (held-out r=%.3f): timing the grid once more", q and q.pearson_r)
        samples = min_merge(samples, profile(engine, grid))
        model = _fit(samples, key, source)
        q = model.quality
    log.info(
        "JCT profile (%s): %d steps up to %d tokens in %.1f s, held-out r=%.3f, median error %.1f ms (%.0f%%)",
        source,
        len(samples),
        max(key["lengths"], default=0),
        time.perf_counter() - t,
        q.pearson_r if q else math.nan,
        1e3 * q.median_abs_error_s if q else math.nan,
        100 * q.median_rel_error if q else math.nan,
    )
    return model, samples


def load_or_profile(
    engine: Engine, grid: ProfileGrid = DEFAULT_GRID, *, refresh: bool = False, root: Path | None = None
) -> JCTModel:
    """The persisted full-grid JCT model for this engine and machine, or a fresh profile (saved
    when the fit is good enough to trust on later starts). Minutes on a CPU: `startup_jct` is
    what a server starts with; this is the reference it is measured against."""
    key = profile_key(engine, grid)
    path = profile_path(key, root)
    if not refresh and (model := try_load(path, key)) is not None:
        return model
    with profile_lock(path):
        if not refresh and (model := try_load(path, key)) is not None:
            return model  # measured by another process while we waited
        model, samples = measure(engine, grid, "grid", key)
        q = model.quality
        if q is None or not q.pearson_r >= MIN_PERSIST_R:
            # Most likely something else was using the machine while we timed: use this fit now,
            # but do not make every later start inherit it.
            log.warning("JCT profile fit is poor (held-out r=%s): not saved, will profile again", q)
            return model
        save_quietly(model, path, samples)
    return model


# ---- what a server starts with ----------------------------------------------------------------

REFINE_EVERY = 16  # real steps between refits of a start-up model (a refit costs well under 1 ms)


def startup_jct(engine: Engine, policy: str) -> JCTModel | CalibratedJCT | None:
    """The JCT model a server starts with, in seconds, never minutes:

    1. a policy that ranks without step times (fcfs, lpm) gets None: nothing is measured;
    2. else the profile persisted for this model / dtype / device / machine / threads / torch:
       the start-up profile (quick, or refined from real steps by an earlier run), else a
       full-grid one (`load_or_profile`: an earlier version's start, a benchmark);
    3. else a quick estimate: QUICK_GRID's short steps timed now (a few seconds) and fitted, and
       saved at once so the other workers of this machine load it instead of measuring on the
       same CPU (an OS file lock makes them wait for the one measuring);
    4. online, the model is refined from the real steps it serves (`CalibratedJCT`: the running
       factor, and a refit every REFINE_EVERY steps on those steps plus the timed anchors), and
       the refined model is saved at PERSIST_AT steps, so the next start loads it (rule 2)."""
    if not SchedulerConfig(policy).needs_jct:
        return None
    key = profile_key(engine, QUICK_GRID)
    path = profile_path(key)

    def online(model: JCTModel, samples: Sequence[JCTSample]) -> CalibratedJCT:
        return CalibratedJCT(model, refine_every=REFINE_EVERY, anchors=samples, on_refit=Persister(path))

    def loaded() -> CalibratedJCT | JCTModel | None:
        if (model := try_load(path, key)) is not None:
            return online(model, load_samples(path))
        grid_key = profile_key(engine, DEFAULT_GRID)
        return try_load(profile_path(grid_key), grid_key)  # a full profile needs no refinement

    if (found := loaded()) is not None:
        return found
    with profile_lock(path):
        if (found := loaded()) is not None:
            return found  # measured by another worker while we waited
        log.info("no JCT profile for this machine yet: timing short steps (seconds; refined from real steps)")
        # No second pass on a poor fit: real steps refine it within minutes, and on a busy
        # machine a second pass would double the wait for the first request.
        model, samples = measure(engine, QUICK_GRID, "quick", key, retry=False)
        save_quietly(model, path, samples)
    return online(model, samples)
