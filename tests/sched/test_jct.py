"""JCT model: the fit, its held-out quality, persistence, online calibration, and the profiler."""

from __future__ import annotations

import json
import logging
import math
import random
import threading
import time

import numpy as np
import pytest

from po_backend import Engine
from po_backend.sched.jct import CalibratedJCT, JCTModel, JCTSample, features
from po_backend.serving import jct_profile as jct_mod
from po_backend.serving import jct_store
from po_backend.serving.jct_profile import ProfileGrid, load_or_profile, profile
from po_backend.serving.jct_store import load_jct_model, save_model

TRUE = (0.004, 0.0015, 0.8, 0.05, 0.01)  # seconds per FEATURES unit


def _synthetic(n: int, noise: float, seed: int = 0) -> list[JCTSample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.choice([1, 1, 1, 2, 4, 8])
        items = []
        for _ in range(k):
            total = rng.randint(16, 4096)
            items.append((total, rng.randint(0, total - 1)))
        t = float(features(items) @ np.array(TRUE))
        out.append(JCTSample(tuple(items), t * (1 + noise * rng.gauss(0, 1))))
    return out


def test_fit_recovers_known_coefficients() -> None:
    model = JCTModel.fit(_synthetic(40, noise=0.0))
    assert np.allclose(model.coef, TRUE, rtol=1e-6, atol=1e-9), model.coef
    q = model.quality
    assert q is not None and q.pearson_r > 0.9999 and q.median_rel_error < 1e-6
    assert q.samples == 40


def test_fit_with_noise_and_held_out_quality() -> None:
    model = JCTModel.fit(_synthetic(60, noise=0.03))
    assert model.coef[2] == pytest.approx(TRUE[2], rel=0.1), model.coef  # per new token: dominant
    fresh = _synthetic(30, noise=0.0, seed=1)  # predictions on unseen shapes within a few %
    rel = [abs(model.predict_items(s.items) / s.seconds - 1) for s in fresh]
    assert max(rel) < 0.06, rel
    q = model.quality
    assert q is not None and q.pearson_r > 0.98 and q.median_rel_error < 0.05, q


def test_coefficients_never_negative() -> None:
    """Pure per-token cost plus noise: a free fit would find small negative terms."""
    rng = random.Random(3)
    samples = [JCTSample(((n, 0),), n * 1e-3 * (1 + 0.05 * rng.gauss(0, 1))) for n in range(50, 3000, 97)]
    model = JCTModel.fit(samples)
    assert all(c >= 0 for c in model.coef)
    assert model.predict(1000, 0) == pytest.approx(1.0, rel=0.1)


def test_predict_shapes() -> None:
    m = JCTModel(TRUE)
    assert m.predict(1000, 900) < m.predict(1000, 0)  # a cached prefix is cheaper
    assert m.predict(1000, 500, n_items=4) == pytest.approx(m.predict_items([(1000, 500)] * 4))
    assert m.predict(100, 100) == pytest.approx(m.predict(100, 99))  # the last token is computed
    assert JCTModel.proxy(2.0).predict(1500, 500) == pytest.approx(2.0)


def test_persistence_round_trip(tmp_path) -> None:
    samples = _synthetic(20, noise=0.01)
    model = JCTModel.fit(samples, key={"model_path": "x", "dtype": "torch.float32"})
    path = tmp_path / "jct" / "p.json"
    save_model(model, path, samples)
    back = load_jct_model(path)
    assert back == model
    assert len(json.loads(path.read_text())["samples"]) == 20


def test_calibration_moves_toward_measured() -> None:
    cal = CalibratedJCT(JCTModel.proxy(1.0), alpha=0.2)
    items = [(1000, 0)]
    assert cal.factor == 1.0 and cal.predict(1000, 0) == pytest.approx(1.0)
    factors = [cal.observe(items, 2.0) for _ in range(30)]  # the machine is 2x slower than profiled
    assert all(b > a for a, b in zip(factors, factors[1:], strict=False))
    assert cal.factor == pytest.approx(2.0, rel=0.01)
    assert cal.predict(1000, 0) == pytest.approx(2.0, rel=0.01)
    before = cal.factor
    cal.observe(items, 1000.0)  # one outlier moves it by a bounded amount (clamped ratio)
    assert cal.factor <= before * 4.0**0.2 + 1e-9
    assert cal.model.predict(1000, 0) == pytest.approx(1.0)  # the fitted model itself is frozen


@pytest.fixture(scope="module")
def tiny_engine(tiny_model) -> Engine:
    path, _ = tiny_model("llama")
    return Engine.from_pretrained(path, dtype="fp32", chunk_size=64, max_input_len=512)


SMALL_GRID = ProfileGrid(
    lengths=(32, 96, 256), cached_fractions=(0.5, 0.9), batches=((4, 96, 32), (3, 0, 48))
)


def test_profile_builds_the_cached_states(tiny_engine: Engine) -> None:
    samples = profile(tiny_engine, SMALL_GRID)
    singles = [s.items[0] for s in samples if len(s.items) == 1]
    for n in (32, 96, 256):
        assert (n, 0) in singles
        assert (n, round(0.5 * n)) in singles and (n, round(0.9 * n)) in singles
    batches = [s.items for s in samples if len(s.items) > 1]
    assert ((128, 96),) * 4 in batches and ((48, 0),) * 3 in batches
    assert all(s.seconds > 0 for s in samples)
    assert tiny_engine.cache is not None and tiny_engine.cache.stats().cached_tokens == 0  # flushed


def test_load_or_profile_persists_per_engine(tiny_engine: Engine, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFILLONLY_JCT_CACHE", str(tmp_path / "jct"))
    # Timings of a tiny model are noise: profile with synthetic steps, not the wall clock.
    monkeypatch.setattr(jct_mod, "profile", lambda engine, grid: _synthetic(20, noise=0.01))
    first = load_or_profile(tiny_engine, SMALL_GRID)
    files = list((tmp_path / "jct").glob("*.json"))
    assert len(files) == 1 and first.key["machine"] and first.key["dtype"] == "torch.float32"
    assert first.quality is not None and first.quality.samples == 20

    def no_profile(*a, **k):
        raise AssertionError("a persisted profile must be reused")

    monkeypatch.setattr(jct_mod, "profile", no_profile)
    assert load_or_profile(tiny_engine, SMALL_GRID) == first
    other = ProfileGrid(lengths=(64,), cached_fractions=(0.5,), batches=())
    with pytest.raises(AssertionError, match="reused"):
        load_or_profile(tiny_engine, other)  # a different grid is a different key


def test_a_poor_fit_is_used_but_not_saved(tiny_engine: Engine, tmp_path, monkeypatch) -> None:
    rng = random.Random(5)
    junk = [JCTSample(((rng.randint(10, 500), 0),), rng.uniform(0.1, 1.0)) for _ in range(12)]
    monkeypatch.setattr(jct_mod, "profile", lambda engine, grid: junk)
    model = load_or_profile(tiny_engine, SMALL_GRID, root=tmp_path)
    assert model.quality is not None and model.quality.pearson_r < jct_mod.MIN_PERSIST_R
    assert not list(tmp_path.glob("*.json"))


def test_min_merge_keeps_the_faster_timing_of_each_point() -> None:
    a = [JCTSample(((100, 0),), 1.0), JCTSample(((200, 0),), 2.0), JCTSample(((300, 150),), 3.0)]
    b = [JCTSample(((100, 0),), 1.5), JCTSample(((200, 0),), 1.8), JCTSample(((300, 0),), 5.0)]
    merged = jct_mod.min_merge(a, b)
    assert [s.seconds for s in merged] == [1.0, 1.8, 3.0, 5.0]  # differing shapes: both kept


def test_grid_reaches_the_longest_prompt(tiny_engine: Engine) -> None:
    """The profile times the engine's longest prompt (and its half), not only the dense part:
    the attention term is fitted where long prompts live instead of extrapolated."""
    grid = ProfileGrid()
    assert grid.long_lengths(8192) == [8192, 4096] and grid.long_lengths(2048) == []
    assert ProfileGrid(long_points=1).long_lengths(32768) == [32768]
    small = ProfileGrid(lengths=(32, 96), cached_fractions=(0.5, 0.9), batches=())
    singles = [s.items[0] for s in profile(tiny_engine, small) if len(s.items) == 1]
    limit = tiny_engine.config.max_input_len  # 512
    for n in (limit, limit // 2):
        assert (n, 0) in singles and (n, round(0.9 * n)) in singles  # cold and mostly cached
        assert (n, round(0.5 * n)) not in singles  # long points skip the other fractions
    assert jct_mod.profile_key(tiny_engine, small)["lengths"] == [32, 96, 256, 512]


# ---- start-up estimate, online refinement, sharing between workers ---------------------------


def _startup(engine: Engine, policy: str = "po"):
    return jct_mod.startup_jct(engine, policy)


def test_quick_estimate_fits_sane_coefficients(tiny_engine: Engine, tmp_path, monkeypatch) -> None:
    """No profile yet: a few short steps are timed for real and fitted (the full grid is not run)."""
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.setenv("PREFILLONLY_JCT_CACHE", str(tmp_path / "jct"))
    grids = []
    real_profile = jct_mod.profile

    def spy(engine, grid):
        grids.append(grid)
        return real_profile(engine, grid)

    monkeypatch.setattr(jct_mod, "profile", spy)
    cal = _startup(tiny_engine)
    assert isinstance(cal, CalibratedJCT) and cal.refine_every > 0
    assert grids == [jct_mod.QUICK_GRID]  # once: no second pass, it is refined online
    m = cal.model
    assert m.source == "quick" and all(math.isfinite(c) and c >= 0 for c in m.coef), m.coef
    assert m.coef[2] > 0 or m.coef[3] > 0, m.coef  # computing tokens costs something
    assert 0 < m.predict(32, 0) <= m.predict(512, 0) and m.predict(512, 448) <= m.predict(512, 0)
    lengths = {n for s in cal.anchors for n, _ in s.items}
    assert max(lengths) <= max(jct_mod.QUICK_GRID.lengths)  # short steps only
    assert len(list((tmp_path / "jct").glob("*.json"))) == 1


def test_quick_estimate_without_a_prefix_cache(tiny_model, tmp_path, monkeypatch) -> None:
    """Too few distinct shapes to fit every coefficient: the new-token proxy, scaled by what was
    measured, then refined online like any start-up model."""
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.setenv("PREFILLONLY_JCT_CACHE", str(tmp_path / "jct"))
    path, _ = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=64, max_input_len=300, enable_cache=False)
    cal = _startup(engine)
    assert isinstance(cal, CalibratedJCT) and cal.refine_every > 0
    assert cal.model.source == "proxy" and cal.model.coef[2] > 0 and sum(cal.model.coef) == cal.model.coef[2]


def test_fcfs_and_lpm_measure_nothing(tiny_engine: Engine, monkeypatch) -> None:
    def no_profile(*a, **k):
        raise AssertionError("no JCT model is needed: nothing may be measured")

    monkeypatch.setattr(jct_mod, "profile", no_profile)
    assert _startup(tiny_engine, "fcfs") is None and _startup(tiny_engine, "lpm") is None


# attention weighs more at long prompts than TRUE's, as on a CPU at 8k tokens
TRUE_LONG = (0.004, 0.0015, 0.8, 0.2, 0.01)


def _mix(n: int, seed: int, longest: int = 8192) -> list[JCTSample]:
    """Traffic with long prompts: what a start-up estimate timed on short steps has not seen."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.choice([1, 1, 2, 4])
        items = []
        for _ in range(k):
            total = int(math.exp(rng.uniform(math.log(64), math.log(longest // k))))
            items.append((total, rng.choice([0, 0, rng.randint(0, total - 1)])))
        t = float(features(items) @ np.array(TRUE_LONG))
        out.append(JCTSample(tuple(items), t * math.exp(0.05 * rng.gauss(0, 1))))
    return out


def test_refinement_reduces_error_on_real_steps() -> None:
    """A quick estimate fitted on short steps misses the attention cost of long prompts. The
    running factor alone cannot fix a wrong shape; refitting on the real steps does."""
    short = [s for s in _mix(400, seed=7) if max(n for n, _ in s.items) <= 1024][:10]
    # what a short-step fit extrapolates to: little attention cost, the per-token cost a bit high
    quick = JCTModel((0.004, 0.0015, 1.0, 0.02, 0.01), source="quick")
    steps = _mix(400, seed=11)
    factor_only = CalibratedJCT(quick)
    refined = CalibratedJCT(quick, refine_every=16, anchors=short)
    for s in steps:
        factor_only.observe(s.items, s.seconds)
        refined.observe(s.items, s.seconds)
    held = steps[200:]  # each was predicted before it was observed
    f_q = jct_mod_quality(factor_only, held)
    r_q = jct_mod_quality(refined, held)
    assert refined.refits == 400 // 16 and refined.model.source == "refined"
    assert r_q.median_rel_error < 0.08 and r_q.pearson_r > 0.99, r_q
    assert r_q.median_rel_error < 0.5 * f_q.median_rel_error, (r_q, f_q)
    assert refined.model.coef[3] == pytest.approx(TRUE_LONG[3], rel=0.15), refined.model.coef
    # a refit model's quality is its online (held-out) quality
    assert refined.quality is not None and refined.quality.samples == len(steps)


def jct_mod_quality(cal: CalibratedJCT, held: list[JCTSample]):
    """The online quality of the predictions made for the `held` steps (the latest ones)."""
    online = list(cal._online)[-len(held) :]
    assert [m for _, m in online] == [s.seconds for s in held]
    from po_backend.sched.jct import prediction_quality

    return prediction_quality([p for p, _ in online], [m for _, m in online])


def test_refinement_takes_fully_cached_items() -> None:
    """The scheduler may price an item as wholly cached; refinement records its last token as
    computed instead of raising on the engine loop's thread."""
    cal = CalibratedJCT(JCTModel(TRUE), refine_every=4)
    for n in (100, 200, 300, 400, 500, 600, 700, 800):
        cal.observe([(n, n)], JCTModel(TRUE).predict(n, n))
    assert cal.refits == 1  # at 8 steps; at 4 there were too few to fit
    assert all(c == n - 1 for s in cal.samples() for n, c in s.items)


def test_refinement_keeps_anchors_bounded() -> None:
    anchors = _synthetic(40, noise=0.0)
    cal = CalibratedJCT(JCTModel(TRUE), refine_every=8, anchors=anchors, window=16)
    assert len(cal.anchors) == 16 and cal.anchors == tuple(anchors[-16:])
    for s in _synthetic(50, noise=0.0, seed=2):
        cal.observe(s.items, s.seconds)
    assert len(cal.samples()) == 32 and np.allclose(cal.model.coef, TRUE, rtol=1e-6, atol=1e-9)


def test_concurrent_starts_measure_once(tiny_engine: Engine, tmp_path, monkeypatch) -> None:
    """Two workers starting together: one measures under the file lock, the other waits for it
    and loads what it saved. The second is let go only once it logged that it waits."""
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.setenv("PREFILLONLY_JCT_CACHE", str(tmp_path / "jct"))
    calls, measuring, release, waiting = [], threading.Event(), threading.Event(), threading.Event()

    def slow_profile(engine, grid):
        calls.append(grid)
        measuring.set()
        assert release.wait(60), "the test never released the measuring worker"
        return _synthetic(12, noise=0.0)

    class Waiting(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waiting" in record.getMessage():
                waiting.set()

    handler = Waiting()
    logger = logging.getLogger("po_backend.core.fs")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    monkeypatch.setattr(jct_mod, "profile", slow_profile)
    out: dict[str, object] = {}
    try:
        a = threading.Thread(target=lambda: out.__setitem__("a", _startup(tiny_engine)))
        a.start()
        assert measuring.wait(60)
        b = threading.Thread(target=lambda: out.__setitem__("b", _startup(tiny_engine)))
        b.start()
        assert waiting.wait(60), "the second worker did not wait on the lock"
        release.set()
        a.join(60)
        b.join(60)
    finally:
        release.set()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert len(calls) == 1
    ma, mb = out["a"], out["b"]
    assert isinstance(ma, CalibratedJCT) and isinstance(mb, CalibratedJCT)
    assert ma.model == mb.model and mb.anchors == ma.anchors


def test_next_start_loads_the_persisted_and_then_the_refined_profile(
    tiny_engine: Engine, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.setenv("PREFILLONLY_JCT_CACHE", str(tmp_path / "jct"))
    monkeypatch.setattr(jct_mod, "profile", lambda engine, grid: _synthetic(12, noise=0.0))
    first = _startup(tiny_engine)
    assert isinstance(first, CalibratedJCT) and first.model.source == "quick"

    def no_profile(*a, **k):
        raise AssertionError("a persisted profile must be reused")

    monkeypatch.setattr(jct_mod, "profile", no_profile)
    second = _startup(tiny_engine)
    assert isinstance(second, CalibratedJCT) and second.model == first.model
    # Real steps refine it; at the first PERSIST_AT mark the refined model is saved for the next start.
    for s in _mix(jct_store.PERSIST_AT[0], seed=3):
        second.observe(s.items, s.seconds)
    path = jct_store.profile_path(jct_mod.profile_key(tiny_engine, jct_mod.QUICK_GRID))
    deadline = time.monotonic() + 60
    while json.loads(path.read_text()).get("source") != "refined":  # written by a thread
        assert time.monotonic() < deadline, "the refined profile was never saved"
        time.sleep(0.05)
    third = _startup(tiny_engine)
    assert isinstance(third, CalibratedJCT) and third.model.source == "refined"
    assert third.model.coef == second.model.coef
    assert len(third.anchors) == 12 + jct_store.PERSIST_AT[0]  # its anchors: the steps it was fitted on


def test_a_full_grid_profile_is_used_when_there_is_one(tiny_engine: Engine, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.setenv("PREFILLONLY_JCT_CACHE", str(tmp_path / "jct"))
    monkeypatch.setattr(jct_mod, "profile", lambda engine, grid: _synthetic(20, noise=0.0))
    full = load_or_profile(tiny_engine)
    monkeypatch.setattr(jct_mod, "profile", lambda *a, **k: pytest.fail("must load the full profile"))
    assert _startup(tiny_engine) == full and full.source == "grid"
