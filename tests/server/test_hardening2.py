"""The second hardening round: every call bounded in memory and response size before any work,
the event loop never blocked (a live server's /health answers within a bound while hostile calls
run), keyless clients unable to make the server hold memory, calls that can never fit refused
with 413 instead of a 503 to retry, NaN scores a clear error, the loop lock never held for the
cache probes, and /health failing when every recent step failed."""

from __future__ import annotations

import json
import os
import random
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from fastapi.testclient import TestClient

from po_backend import Engine, ScoreRequest
from po_backend.core.request import ScoreResult
from po_backend.sched.jct import JCTModel
from po_backend.serving.loop import FAILING_STEPS, EngineLoop
from tests.server_utils import REPO_ROOT, FakeService, ServerProcess, error_message, probed_while

TIMEOUT = 60.0  # only hit when something hangs
T = TypeVar("T")


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

    def step(self, requests: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> list[ScoreResult]:
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

    def cache_changes(self) -> list[tuple[int, ...]]:
        return []

    def stats(self) -> Any:
        return type("S", (), {"hit_rate": 0.0})()

    def flush_cache(self) -> None: ...

    def cache_pool(self) -> None:
        return None


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


# ---- a live server against hostile clients --------------------------------------------------------

HEALTH_BOUND_S = 0.1
ATTEMPTS = 3
MAX_QUEUE = 16
MAX_LOGPROBS = 4096


@pytest.fixture(scope="module")
def server(tokenized_llama: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        [
            "--model-path", str(tokenized_llama), "--dtype", "fp32", "--max-input-len", "256",
            "--max-queue", str(MAX_QUEUE), "--max-logprobs-per-request", str(MAX_LOGPROBS),
            "--max-label-tokens", "16", "--log-level", "warning",
        ]
    )  # fmt: skip
    with proc:
        yield proc


def while_health_probed(url: str, call: Callable[[], T]) -> tuple[T, float]:
    """`call()`'s result, and the slowest /health answer seen while it ran."""
    result, (slowest,) = probed_while(url, call, [lambda c: c.get("/health")], timeout=30)
    return result, slowest


def _post(url: str, path: str, body: Any) -> httpx.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=data, headers={"content-type": "application/json"}, timeout=120)


HOSTILE = [
    # (what, path, body, status, text in the message)
    ("logit_bias over the cap", "/generate",
     {"input_ids": [5, 6, 7], "sampling_params": {"logit_bias": {str(i): 1.0 for i in range(301)}}},
     400, "--max-logit-bias"),
    ("labels x items over the cap", "/v1/score",
     {"query": [5, 6], "items": [[7]] * 8, "label_token_ids": list(range(3, 3 + MAX_LOGPROBS // 8 + 1))},
     413, "--max-logprobs-per-request"),
    ("prompt log-probs over the cap", "/generate",
     {"input_ids": [[5 + i % 200 for i in range(250)]] * 8, "return_logprob": True, "logprob_start_len": 0,
      "top_logprobs_num": 20},
     413, "--max-logprobs-per-request"),
    ("completions echo over the cap", "/v1/completions",
     {"prompt": [[5 + i % 200 for i in range(250)]] * 8, "echo": True, "logprobs": 5, "max_tokens": 0},
     413, "--max-logprobs-per-request"),
    ("prefills that never fit the queue", "/v1/classify",
     {"prompt": [f"Post {i}: hello\nAnswer:" for i in range(5)],
      "labels": ["strongly agree", "mildly disagree", "no opinion at all", "cannot say"]},
     413, "--max-queue"),
    ("a label over the token limit", "/v1/classify",
     {"prompt": "Answer:", "labels": ["yes", "hello world " * 20]}, 400, "--max-label-tokens"),
    ("a label far over it, refused before tokenizing", "/v1/classify",
     {"prompt": "Answer:", "labels": ["yes", "x" * 1_000_000]}, 400, "--max-label-tokens"),
    ("a body of ids with a lone surrogate at its end", "/generate",
     b'{"input_ids": [' + b"12345, " * 30_000 + b'1], "rid": "\\ud800"}', 400, "rid contains a lone"),
    ("a body of ids", "/generate", {"input_ids": [12345] * 30_000}, 400, "max_input_len"),
    ("JSON nested deeper than the parser goes", "/generate", b"[" * 100_000 + b"]" * 100_000,
     400, "nested too deeply"),
    ("a body far over --max-body-bytes", "/v1/score", {"query": "x" * (3 << 20), "items": ["a"]},
     413, "--max-body-bytes"),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("what", "path", "body", "status", "text"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_call_is_refused_and_health_stays_fast(
    server: ServerProcess, what: str, path: str, body: Any, status: int, text: str
) -> None:
    # A handler that blocks the event loop does so on every attempt; a loaded machine's scheduling
    # hiccup does not: the bound holds on the best of a few attempts.
    slowest = []
    for _ in range(ATTEMPTS):
        r, worst = while_health_probed(server.url, lambda: _post(server.url, path, body))
        assert r.status_code == status, r.text[:300]
        assert text in error_message(r), error_message(r)
        slowest.append(worst)
        if worst < HEALTH_BOUND_S:
            break
    assert min(slowest) < HEALTH_BOUND_S, (
        f"/health took {[round(x * 1e3) for x in slowest]} ms during: {what}"
    )
    ok = _post(server.url, "/generate", {"input_ids": [5, 6, 7]})
    assert ok.status_code == 200  # the server answers as before


def _raw(port: int, request: bytes) -> bytes:
    """One request's raw answer (the status line and what follows), the body never sent."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(request)
        s.settimeout(10)  # well under --timeout-request-read: an answer proves nothing waited for the body
        return s.recv(4096)


@pytest.mark.slow
def test_wrong_methods_and_open_paths_never_read_a_body(server: ServerProcess) -> None:
    big = b"Content-Type: application/json\r\nContent-Length: 60000000\r\n\r\n"
    assert _raw(server.port, b"POST /health HTTP/1.1\r\nHost: x\r\n" + big).startswith(b"HTTP/1.1 405")
    assert _raw(server.port, b"PUT /generate HTTP/1.1\r\nHost: x\r\n" + big).startswith(b"HTTP/1.1 405")
    assert _raw(server.port, b"POST /generate HTTP/1.1\r\nHost: x\r\n" + big).startswith(b"HTTP/1.1 413")
    r = httpx.get(server.url + "/flush_cache")  # what a cross-site page can send
    assert r.status_code == 405 and "error" in r.json()
    r = httpx.get(server.url + "/no_such_route")
    assert r.status_code == 404 and error_message(r)  # our shape, not {"detail"}


@pytest.mark.slow
def test_keyless_clients_are_refused_before_any_body_is_read(tokenized_llama: Path) -> None:
    proc = ServerProcess(
        ["--model-path", str(tokenized_llama), "--dtype", "fp32", "--log-level", "warning"],
        env={"PREFILLONLY_API_KEY": "sekrit"},
    )
    proc.start()
    try:
        proc.wait_ready(headers={"Authorization": "Bearer sekrit"})
        big = b"Content-Type: application/json\r\nContent-Length: 60000000\r\n\r\n"
        for line in (b"OPTIONS /generate", b"POST /health", b"POST /metrics", b"POST /generate"):
            answer = _raw(proc.port, line + b" HTTP/1.1\r\nHost: x\r\n" + big)
            assert answer.startswith(b"HTTP/1.1 401"), (line, answer[:80])
        assert httpx.get(proc.url + "/health").status_code == 200  # GET stays open for probes
    finally:
        proc.stop()


# ---- in process: NaN scores, the Host check, error shapes -----------------------------------------


def _nan(req: ScoreRequest) -> ScoreResult:
    nan = float("nan")
    return ScoreResult(
        [nan] * len(req.label_token_ids),
        [(t, nan) for t in range(max(req.top_k, 1))],
        input_token_logprobs=[nan] * max(len(req.input_ids) - max(req.logprob_start_len, 0) - 1, 0),
        prompt_tokens=len(req.input_ids),
    )


NAN_CALLS = [
    ("/generate", {"input_ids": [5, 6, 7]}),
    ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 1, "logprobs": 2}),
    ("/v1/score", {"query": [5, 6], "items": [[7], [8]], "label_token_ids": [9, 10]}),
    ("/generative_scoring", {"query": [5, 6], "items": [[7]], "label_token_ids": [9, 10]}),
    ("/v1/classify", {"prompt": "Answer:", "labels": ["yes", "no"]}),
    ("/v1/classify", {"prompt": "Answer:", "labels": ["strongly agree", "mildly disagree"]}),
    ("/v1/rerank", {"query": "cats", "documents": ["a cat", "a dog"]}),
]


@pytest.mark.parametrize(("path", "body"), NAN_CALLS, ids=[f"{p} {i}" for i, (p, _) in enumerate(NAN_CALLS)])
def test_nan_scores_are_a_clear_error_on_every_route(tokenized_llama: Path, path: str, body: Any) -> None:
    from transformers import AutoTokenizer

    from po_backend.server import ServerArgs, Settings, create_app

    tok = AutoTokenizer.from_pretrained(tokenized_llama)
    service = FakeService(answer=_nan, tokenizer=tok, vocab_size=len(tok), dtype="fp16")
    service.max_input_len = 512  # the rerank template alone is longer than the fake's default
    app = create_app(service, ServerArgs(engine=Settings(model_path="m")))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post(path, json=body)
    assert r.status_code == 500, r.text
    assert "NaN" in error_message(r) and "fp16" in error_message(r)


def test_host_check_and_our_error_shape_for_what_the_framework_answers() -> None:
    from po_backend.server import ServerArgs, Settings, create_app

    answer = lambda r: ScoreResult([-1.0], [(1, -0.5)], prompt_tokens=len(r.input_ids))  # noqa: E731
    args = ServerArgs(engine=Settings(model_path="m"), allowed_hosts=("localhost", "127.0.0.1"))
    app = create_app(FakeService(answer=answer), args)
    with TestClient(app, base_url="http://localhost:30000", raise_server_exceptions=False) as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"host": "127.0.0.1:30000"}).status_code == 200
        # A name that a rebinding attacker's page resolves to 127.0.0.1 is still its own name.
        assert client.get("/health", headers={"host": "evil.example:30000"}).status_code == 400
        r = client.post(
            "/generate", content=b"[" * 5000 + b"]" * 5000, headers={"content-type": "application/json"}
        )
        assert r.status_code == 400 and "nested too deeply" in error_message(r)
        r = client.get("/generate")
        assert r.status_code == 405 and "POST" in r.headers["allow"] and error_message(r)
    with pytest.raises(ValueError, match="allowed_hosts"):
        ServerArgs(engine=Settings(model_path="m"), allowed_hosts=("a.*.com",))


# ---- launch_cluster: one key for the data plane, another for the router's control plane -----------


@pytest.mark.slow
def test_cluster_keys_reach_router_and_workers_by_environment_only(tokenized_llama: Path) -> None:
    import psutil

    from po_backend.entrypoints import spawn

    key, admin = "data-key-123", "admin-key-456"
    port = spawn.free_port()
    cmd = [
        sys.executable,
        "-m",
        "po_backend.entrypoints.launch_cluster",
        "--model-path",
        str(tokenized_llama),
    ]
    cmd += ["--port", str(port), "--workers", "1", "--dtype", "fp32", "--max-input-len", "256"]
    env = {**os.environ, "PREFILLONLY_API_KEY": key, "PREFILLONLY_ROUTER_ADMIN_KEY": admin}
    launcher = spawn.ServerProcess(
        cmd, f"http://127.0.0.1:{port}", env=env, cwd=REPO_ROOT, health_path="/get_model_info"
    )
    launcher.start()
    assert launcher.proc is not None
    try:
        # The start-up wait through the router sends the key too (it would never answer 200 without).
        launcher.wait_ready(240, headers={"Authorization": f"Bearer {key}"})
        url = launcher.url
        children = psutil.Process(launcher.proc.pid).children(recursive=True)
        lines = [" ".join(c.cmdline()) for c in children]
        assert lines and not any(key in x or admin in x for x in lines), lines  # `ps` shows no key
        data = {"Authorization": f"Bearer {key}"}
        body = {"input_ids": [5, 6, 7]}
        assert httpx.post(url + "/generate", json=body, timeout=60).status_code == 401
        assert httpx.post(url + "/generate", json=body, headers=data, timeout=60).status_code == 200
        # The control plane takes the admin key only, not the data plane's.
        for headers in ({}, data):
            r = httpx.post(url + "/workers", json={"url": "http://127.0.0.1:1"}, headers=headers, timeout=30)
            assert r.status_code in (401, 403), (headers, r.status_code, r.text)
            assert httpx.post(url + "/flush_cache", headers=headers, timeout=30).status_code in (401, 403)
        r = httpx.post(url + "/flush_cache", headers={"Authorization": f"Bearer {admin}"}, timeout=30)
        assert r.status_code == 200, r.text
    finally:
        for child in psutil.Process(launcher.proc.pid).children(recursive=True):
            child.kill()
        launcher.proc.kill()
        launcher.proc.wait()
