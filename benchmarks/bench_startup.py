"""Start-up time and the start-up JCT model's accuracy.

(a) `launch_server --model-path embedded` from launch to /health 200: first with a fresh
    PREFILLONLY_CACHE (GGUF conversion, kernel build, quick JCT estimate), then a later start on
    that cache; `--workers 2` boots that many servers at once on the fresh cache (what
    launch_cluster does on one machine) to show they convert and measure once.
(b) In one run on one engine: today's model (the full ProfileGrid profile, with the running
    calibration factor) and the new one (QUICK_GRID's estimate, calibrated and refined online)
    predict every real step before it runs; after `--warmup` steps, Pearson r and median relative
    error of each on the held-out steps that follow.

    python -m benchmarks.bench_startup --quick    # max_input_len 2048, fewer steps
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from pathlib import Path

from benchmarks.harness import RESULTS, our_server, save
from po_backend.core.cpu import cpu_model


def time_starts(workers: int, timeout: float) -> dict[str, object]:
    """Seconds from launch to /health 200: fresh cache (all workers at once), then a later start."""
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory(prefix="po-start-") as cache:
        env = {**os.environ, "PREFILLONLY_CACHE": cache}
        for phase, n in (("first", workers), ("later", 1)):
            # The default log level: the counts below read its INFO lines.
            servers = [our_server(env=env, log_level="info") for _ in range(n)]
            t0 = time.monotonic()
            ready = []
            try:
                for s in servers:
                    s.start()
                for s in servers:
                    s.wait_ready(timeout)
                    ready.append(round(time.monotonic() - t0, 1))
                logs = [s.log_text(200_000) for s in servers]
            finally:
                for s in servers:
                    s.stop()
            out[phase] = {
                "workers": n,
                "health_200_s": ready,
                "converted": sum("converted SmolLM2" in t for t in logs),
                "jct_measured": sum("JCT profile (quick):" in t for t in logs),
                "log_lines": [len(t.splitlines()) for t in logs],
                "log": logs[0].splitlines()[-40:],
            }
            print(phase, ready, flush=True)
    return out


def _traffic(engine, n: int, longest: int, seed: int):  # type: ignore[no-untyped-def]
    """Steps like a scoring server's: 1-4 items of log-uniform length, half sharing a user prefix."""
    from po_backend.core.request import ScoreRequest

    rng = random.Random(seed)
    users = [
        tuple(rng.randrange(engine.vocab_size) for _ in range(rng.randint(64, longest // 2)))
        for _ in range(6)
    ]
    for _ in range(n):
        k = rng.choice([1, 1, 2, 4])
        reqs = []
        for _ in range(k):
            total = int(math.exp(rng.uniform(math.log(64), math.log(longest // k))))
            prefix = rng.choice(users)[: total // 2] if rng.random() < 0.5 else ()
            ids = prefix + tuple(rng.randrange(engine.vocab_size) for _ in range(total - len(prefix)))
            reqs.append(ScoreRequest(ids, (0,), cache_prefix_len=len(prefix)))
        yield reqs


def accuracy(max_input_len: int, warmup: int, held: int) -> dict[str, object]:
    from po_backend.engine.engine import Engine
    from po_backend.sched.jct import CalibratedJCT, prediction_quality
    from po_backend.serving import jct_profile as jp

    engine = Engine.from_pretrained("embedded", max_input_len=max_input_len)
    t = time.perf_counter()
    grid, _ = jp._measure(engine, jp.DEFAULT_GRID, jp.profile_key(engine, jp.DEFAULT_GRID), "grid")
    grid_s = time.perf_counter() - t
    t = time.perf_counter()
    quick, anchors = jp._measure(
        engine, jp.QUICK_GRID, jp.profile_key(engine, jp.QUICK_GRID), "quick", retry=False
    )
    quick_s = time.perf_counter() - t
    models = {
        "today_grid_calibrated": CalibratedJCT(grid),
        "today_grid_raw": CalibratedJCT(grid, alpha=1e-9),
        "quick_calibrated_no_refit": CalibratedJCT(quick),
        "new_quick_refined": CalibratedJCT(quick, refine_every=jp.REFINE_EVERY, anchors=anchors),
    }
    preds: dict[str, list[float]] = {k: [] for k in models}
    measured: list[float] = []
    engine.flush_cache()
    for i, reqs in enumerate(_traffic(engine, warmup + held, max_input_len, seed=1)):
        t = time.perf_counter()
        results = engine.step(reqs)
        seconds = time.perf_counter() - t
        items = [(r.prompt_tokens, r.cached_tokens) for r in results]
        for k, m in models.items():
            preds[k].append(m.predict_items(items))  # before it sees this step
            m.observe(items, seconds)
        measured.append(seconds)
        if (i + 1) % 16 == 0:
            print(f"step {i + 1}/{warmup + held}", flush=True)
    out: dict[str, object] = {
        "max_input_len": max_input_len,
        "warmup_steps": warmup,
        "held_out_steps": held,
        "grid_profile_s": round(grid_s, 1),
        "quick_profile_s": round(quick_s, 1),
        "grid_fit_loo": grid.quality.__dict__ if grid.quality else None,
        "quick_fit_loo": quick.quality.__dict__ if quick.quality else None,
        "grid_coef": grid.coef,
        "quick_coef": quick.coef,
        "refined_coef": models["new_quick_refined"].model.coef,
        "refits": models["new_quick_refined"].refits,
    }
    for k in models:
        q = prediction_quality(preds[k][warmup:], measured[warmup:])
        out[k] = {"pearson_r": round(q.pearson_r, 4), "median_rel_error": round(q.median_rel_error, 4)}
        print(k, out[k], flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="max_input_len 2048, 48 + 48 steps")
    ap.add_argument("--workers", type=int, default=1, help="servers booted at once on the fresh cache")
    ap.add_argument("--skip-starts", action="store_true")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll otherwise
    import torch

    result: dict[str, object] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_avg_at_start": os.getloadavg(),
    }
    if not a.skip_starts:
        result["starts"] = time_starts(a.workers, a.timeout)
    if not a.skip_accuracy:
        length, warmup, held = (2048, 48, 48) if a.quick else (8192, 96, 96)
        result["accuracy"] = accuracy(length, warmup, held)
    result["load_avg_at_end"] = os.getloadavg()
    out = a.out or RESULTS / f"startup{'_quick' if a.quick else ''}.json"
    save(out, result)


if __name__ == "__main__":
    main()
