"""The second hardening round: every call bounded in memory and response size before any work,
the event loop never blocked (a live server's /health answers within a bound while hostile calls
run), keyless clients unable to make the server hold memory, calls that can never fit refused
with 413 instead of a 503 to retry, NaN scores a clear error, the loop lock never held for the
cache probes, and /health failing when every recent step failed."""

from __future__ import annotations

import random
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import pytest
from fastapi.testclient import TestClient

from po_backend import Engine, ScoreRequest
from po_backend.core.request import ScoreResult
from po_backend.sched.jct import JCTModel
from po_backend.serving.loop import FAILING_STEPS, EngineLoop

TIMEOUT = 60.0  # only hit when something hangs


# ---- the loop: probes outside the lock, failing steps ---------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_model: Any) -> Engine:
    return Engine.from_pretrained(tiny_model("llama")[0], dtype="fp32", chunk_size=32, max_input_len=512)


def test_cache_probes_run_outside_the_loop_lock(engine: Engine) -> None:
    """The radix walk per waiting prompt (what a pick costs, queue x prompt length) happens with
    the loop's lock free, so submitters and /metrics never wait on it; the pick under the lock
    reads the memo. Checked on every probe, not timed."""
    engine.flush_cache()
    assert engine.cache is not None
    loop = EngineLoop(engine, policy="po", jct=JCTModel.proxy(1.0, 0.1), start=False)
    held: list[bool] = []
    match_len = engine.cache.match_len

    def probe(ids: Any) -> int:
        held.append(loop._cond._is_owned())  # type: ignore[attr-defined]  # Condition's own check
        return match_len(ids)

    engine.cache.match_len = probe  # type: ignore[method-assign]
    try:
        rng = random.Random(0)
        prefixes = [tuple(rng.randrange(300) for _ in range(60)) for _ in range(3)]
        reqs = [ScoreRequest(p + tuple(rng.randrange(300) for _ in range(10)), (3, 17)) for p in prefixes * 4]
        futures = loop.submit_many(reqs)
        loop.start()
        for f in futures:
            f.result(TIMEOUT)
    finally:
        loop.shutdown()
        del engine.cache.match_len
    assert held and not any(held), f"{sum(held)} of {len(held)} cache probes ran under the loop lock"


class _FlakyScorer:
    """A scorer whose steps fail while `broken` is set (a device error every step hits)."""

    vocab_size = 100
    tokenizer = None

    def __init__(self) -> None:
        self.broken = True

    def validate(self, req: ScoreRequest) -> None: ...

    def step(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        if self.broken:
            raise RuntimeError("device lost")
        top = [(t, -0.5 - t) for t in range(max(r.top_k for r in requests))]
        return [
            ScoreResult([-1.0] * len(r.label_token_ids), top, prompt_tokens=len(r.input_ids))
            for r in requests
        ]

    def cached_len(self, req: ScoreRequest) -> int:
        return 0

    def batchable(self, candidates: Sequence[ScoreRequest]) -> list[tuple[int, int]]:
        return [(0, 0)]

    def stats(self) -> Any:
        return type("S", (), {"hit_rate": 0.0})()

    def flush_cache(self) -> None: ...


def test_health_fails_while_every_recent_step_fails() -> None:
    from po_backend.server import ServerArgs, Settings, create_app
    from po_backend.server.service import LoopService

    scorer = _FlakyScorer()
    loop = EngineLoop(scorer, policy="fcfs")  # type: ignore[arg-type]  # a duck-typed scorer
    service = LoopService(scorer, loop, max_input_len=64)
    app = create_app(service, ServerArgs(engine=Settings(model_path="m")))
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200
        for n in range(FAILING_STEPS):
            assert client.post("/generate", json={"input_ids": [1, 2, 3]}).status_code == 500
            expected = 503 if n + 1 >= FAILING_STEPS else 200
            assert client.get("/health").status_code == expected, n
        assert loop.alive  # the worker runs: only its steps fail
        scorer.broken = False
        assert client.post("/generate", json={"input_ids": [1, 2, 3]}).status_code == 200
        assert client.get("/health").status_code == 200  # one success clears it


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # its re-raise
def test_a_dead_loop_answers_503_without_internals() -> None:
    scorer = _FlakyScorer()
    loop = EngineLoop(scorer, policy="fcfs", start=False)  # type: ignore[arg-type]

    def boom(*_: Any) -> None:
        raise RuntimeError("secret: /etc/internal/path")

    loop._next_batch = boom  # type: ignore[method-assign]  # a bug in the loop itself
    fut: Future[ScoreResult] = loop.submit(ScoreRequest((1, 2), (3,)))
    loop.start()
    with pytest.raises(Exception) as info:
        fut.result(TIMEOUT)
    assert "secret" not in str(info.value) and "RuntimeError" in str(info.value)
    loop._thread.join(TIMEOUT)
    assert not loop.alive
