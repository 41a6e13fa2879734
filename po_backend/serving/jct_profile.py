"""Fitting the JCT model on an engine: time a grid of synthetic steps (`profile`), and keep the fit
per model / dtype / device / machine so later starts reuse it (`load_or_profile`).

The model itself (`po_backend.sched.jct`) is numpy only; this half needs the engine and torch.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from po_backend.core.cpu import cpu_model
from po_backend.core.request import ScoreRequest
from po_backend.engine.engine import Engine
from po_backend.engine.models.loader import cache_root
from po_backend.sched.jct import PROFILE_VERSION, JCTModel, JCTSample

log = logging.getLogger(__name__)

# Where profiles live: `$PREFILLONLY_JCT_CACHE`, else `jct/` under the cache root. Its own setting
# so that test runs keep their throwaway profiles apart while sharing the root's GGUF conversion
# and kernel build.
JCT_CACHE_ENV = "PREFILLONLY_JCT_CACHE"

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


def _rand_ids(gen: torch.Generator, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab, (n,), generator=gen).tolist())


def profile_limit(engine: Engine) -> int:
    """The longest single prompt one step can hold."""
    return min(engine.config.max_input_len, engine.config.max_batch_tokens)


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
        samples.append(timed([ScoreRequest(base, labels, cache_prefix_len=max(cuts, default=0))]))
        for c in cuts:
            tail = _rand_ids(gen, vocab, n - c)
            if tail[0] == base[c]:  # the match would run one token past the cut
                tail = ((tail[0] + 1) % vocab, *tail[1:])
            ids = base[:c] + tail
            samples.append(timed([ScoreRequest(ids, labels, cache_prefix_len=c)]))  # stores nothing new

    engine.flush_cache()
    timed([ScoreRequest(_rand_ids(gen, vocab, min(64, limit)), labels, cache_prefix_len=0)])  # warm-up
    for n in grid.dense_lengths(limit):
        one_length(n, grid.cached_fractions)
    longest_fraction = [max(grid.cached_fractions)] if grid.cached_fractions else []
    for n in sorted(grid.long_lengths(limit)):
        one_length(n, longest_fraction)
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


# ---- persistence ----------------------------------------------------------------------------


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


def profile_dir() -> Path:
    env = os.environ.get(JCT_CACHE_ENV)
    return Path(env) if env else cache_root() / "jct"


def profile_path(key: dict[str, Any], root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root or profile_dir()) / f"{digest}.json"


def save_model(model: JCTModel, path: Path, samples: Sequence[JCTSample] = ()) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(model.to_json(samples), indent=1))
    tmp.replace(path)  # atomic: a concurrent start never reads half a file


def load_model(path: Path) -> JCTModel:
    return JCTModel.from_json(json.loads(path.read_text()))


def load_or_profile(
    engine: Engine, grid: ProfileGrid = DEFAULT_GRID, *, refresh: bool = False, root: Path | None = None
) -> JCTModel:
    """The persisted JCT model for this engine and machine, or a fresh profile (saved when the
    fit is good enough to trust on later starts)."""
    key = profile_key(engine, grid)
    path = profile_path(key, root)
    if not refresh and path.is_file():
        try:
            model = load_model(path)
            if model.key == key:
                log.info("JCT profile loaded from %s (r=%s)", path, model.quality and model.quality.pearson_r)
                return model
        except (OSError, ValueError, KeyError, TypeError) as e:
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
        "JCT profile: %d steps up to %d tokens in %.1f s, held-out r=%.3f, median error %.1f ms (%.0f%%)",
        len(samples),
        max(key["lengths"], default=0),
        time.perf_counter() - t,
        q.pearson_r if q else math.nan,
        1e3 * q.median_abs_error_s if q else math.nan,
        100 * q.median_rel_error if q else math.nan,
    )
    if q is None or not q.pearson_r >= MIN_PERSIST_R:
        # Most likely something else was using the machine while we timed: use this fit now,
        # but do not make every later start inherit it.
        log.warning("JCT profile fit is poor (held-out r=%s): not saved, will profile again", q)
        return model
    try:
        save_model(model, path, samples)
    except OSError as e:  # a read-only home must not stop the server
        log.warning("could not save the JCT profile to %s: %s", path, e)
    else:
        log.info("JCT profile saved to %s", path)
    return model
