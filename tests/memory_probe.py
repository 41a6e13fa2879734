"""Peak-memory measurements that run in a fresh interpreter.

On a CPU a peak is the process's RSS high-water mark: it counts everything the process does while
it is measured. In a test worker that includes what earlier tests left behind (a heap fragmented
by other models' forwards, a thread an earlier test left running), so the same forward's peak
moved with the order the suite ran in, far enough to fail a budget check in CI that the forward
passes on its own. A fresh interpreter has one history: the engine's own start-up (its
profile run included) and then the forward, as a server's first long request. The probes run
here in that interpreter; `in_fresh_process` starts it and returns what the probe measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.server_utils import REPO_ROOT

_MARK = "MEMORY-PROBE "


def in_fresh_process(probe: str, memory_cache: Path, **kwargs: Any) -> dict[str, Any]:
    """`probe(**kwargs)` of this module in a new interpreter whose engines profile their memory
    into `memory_cache` (a fresh folder: the budget is measured there, like the peaks it bounds)."""
    code = (
        "import json, sys; from tests import memory_probe as m; "
        f"print({_MARK!r} + json.dumps(getattr(m, sys.argv[1])(**json.loads(sys.argv[2]))))"
    )
    from po_backend.engine.memory import MEMORY_CACHE_ENV

    env = {**os.environ, MEMORY_CACHE_ENV: str(memory_cache)}
    out = subprocess.run(
        [sys.executable, "-c", code, probe, json.dumps(kwargs)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, f"{probe} failed:\n{out.stderr[-4000:]}"
    lines = [line for line in out.stdout.splitlines() if line.startswith(_MARK)]
    assert lines, f"{probe} printed no result:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1][len(_MARK) :])
    return result


# ---- probes (run in the fresh interpreter) -------------------------------------------------------


def _ids(n: int, vocab: int) -> tuple[int, ...]:
    import torch

    return tuple(int(t) for t in torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(0)))


def request_peak(
    model: str, n: int, prefix_len: int, fill_pool: bool = False, **engine_kwargs: Any
) -> dict[str, Any]:
    """Build the engine (its profile run sizes the budget), warm up on 256 tokens, then the peak of
    one `n`-token request that stores `prefix_len` tokens in the pool. With `fill_pool`, first the
    peak of every pool page made resident plus a full-length forward that stores nothing."""
    import torch

    from po_backend import Engine, ScoreRequest
    from po_backend.engine.memory import PeakMemory

    eng = Engine.from_pretrained(model, **engine_kwargs)
    ids = _ids(n, eng.vocab_size)
    eng.run([ScoreRequest(ids[:256], (1,), cache_prefix_len=0)])  # warm-up; stores nothing
    pool = eng.cache.pool
    out: dict[str, Any] = {"budget": eng.activation_budget, "pool_nbytes": pool.nbytes}
    out["bound"] = eng.runner.activation_bound(n)
    if fill_pool:
        with PeakMemory(torch.device("cpu")) as whole:
            # Measured, not the arithmetic the pool was sized by: torch.empty leaves its pages
            # unmapped until written.
            pool.k.fill_(0)
            pool.v.fill_(0)
            eng.run([ScoreRequest(ids, (1,), cache_prefix_len=0)])
        out["whole_peak"] = whole.peak
    with PeakMemory(torch.device("cpu")) as pm:
        eng.run([ScoreRequest(ids, (1,), cache_prefix_len=prefix_len)])
    m = eng.model_config
    out["peak"] = pm.peak
    out["pool_written"] = prefix_len * pool.bytes_per_slot(
        m.num_layers, m.num_kv_heads, m.head_dim, torch.float32
    )
    return out


def forward_peaks(model: str, lengths: list[int], **engine_kwargs: Any) -> dict[str, Any]:
    """Build the engine, then the peak of one runner forward at each of `lengths` (each warmed up
    at its size first): the activations alone, nothing stored."""
    import torch

    from po_backend import Engine
    from po_backend.engine.memory import PeakMemory
    from po_backend.engine.runner import SeqPlan

    eng = Engine.from_pretrained(model, **engine_kwargs)
    peaks = []
    for n in lengths:
        ids = torch.randint(0, eng.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        plan = SeqPlan(token_ids=ids, logit_offsets=torch.tensor([n - 1]))
        eng.runner.forward([plan])  # warm-up at this size
        with PeakMemory(torch.device("cpu")) as pm:
            eng.runner.forward([plan])
        peaks.append(pm.peak)
    return {"peaks": peaks, "budget": eng.activation_budget}
