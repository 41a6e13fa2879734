"""The server against hostile or unlucky clients: limits checked before any tokenizing, health
that tells the truth, slow senders cut off, SIGTERM that answers every accepted request (200, or
503 with Retry-After), and 500s that leak nothing. Each case leaves the server answering as before."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from po_backend.entrypoints.launch_server import DrainingServer, uvicorn_config
from po_backend.server import ServerArgs, Settings, create_app
from tests.conftest import TINY_BASE
from tests.server_utils import FakeService, ServerProcess, error_message

pytestmark = pytest.mark.slow  # real servers in subprocesses


MAX_INPUT_LEN = 256
BODY = {
    "text": "User profile:\nlikes cats\nPost: a cat video\nAnswer:",
    "sampling_params": {"max_new_tokens": 1},
}


@pytest.fixture(scope="module")
def server(tokenized_llama: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(
        [
            "--model-path", str(tokenized_llama), "--dtype", "fp32", "--max-input-len", str(MAX_INPUT_LEN),
            "--max-items-per-request", "8", "--max-labels", "4", "--timeout-request-read", "1",
            "--max-body-bytes", "64M",  # the text guard below is tested on a 12 MB body
            "--log-level", "warning",
        ]
    )  # fmt: skip
    with proc:
        yield proc


def answer(url: str) -> Any:
    r = httpx.post(url + "/generate", json=BODY, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def test_limits_are_checked_before_tokenizing(server: ServerProcess) -> None:
    url = server.url
    before = answer(url)
    t0 = time.monotonic()
    r = httpx.post(url + "/generate", json={"text": "hello " * 2_000_000}, timeout=30)
    assert r.status_code == 400 and "before tokenizing" in error_message(r)
    assert time.monotonic() - t0 < 10  # a length check, not minutes of tokenizer time
    r = httpx.post(
        url + "/v1/score", json={"query": "a", "items": ["b"] * 9, "label_token_ids": [5]}, timeout=30
    )
    assert r.status_code == 413 and "--max-items-per-request" in error_message(r)
    r = httpx.post(url + "/generate", json={"input_ids": [[5, 6]] * 9}, timeout=30)
    assert r.status_code == 413 and "9 prompts" in error_message(r)
    r = httpx.post(url + "/v1/rerank", json={"query": "q", "documents": ["d"] * 9}, timeout=30)
    assert r.status_code == 413
    r = httpx.post(url + "/v1/classify", json={"prompt": "x", "labels": list("abcde")}, timeout=30)
    assert r.status_code == 400 and "--max-labels" in error_message(r)
    assert httpx.get(url + "/health").status_code == 200
    assert answer(url) == before


def test_health_and_ready(server: ServerProcess) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/ready").status_code == 200


def test_slow_sender_is_disconnected(server: ServerProcess) -> None:
    before = answer(server.url)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n")  # headers never end
        s.settimeout(10)
        t0 = time.monotonic()
        assert s.recv(1024) == b""  # closed by the server, not by our timeout
        assert time.monotonic() - t0 < 8
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
        )
        s.settimeout(10)
        assert s.recv(1024) == b""  # the body never completes
    assert answer(server.url) == before


def test_sigterm_answers_every_accepted_request(tokenized_llama: Path) -> None:
    """A burst that needs longer than --shutdown-timeout, then SIGTERM once the server holds every
    request: each gets 200, or 503 with Retry-After; never a 500, never a dropped connection."""
    # The longest prompts the tiny model takes, one per step (fcfs): the engine falls behind the
    # burst, so the queue still holds most of it when the signal comes.
    max_len = int(TINY_BASE["max_position_embeddings"])
    proc = ServerProcess(
        [
            "--model-path", str(tokenized_llama), "--dtype", "fp32", "--max-input-len", str(max_len),
            "--max-batch-tokens", str(max_len), "--schedule-policy", "fcfs", "--shutdown-timeout", "0.2",
            "--log-level", "warning",
        ]
    )  # fmt: skip
    proc.start()
    proc.wait_ready()
    n = 150

    def loop_stats() -> dict[str, Any]:
        # One snapshot under the loop's lock: `submitted` counts every request the server took.
        return dict(httpx.get(proc.url + "/server_info", timeout=30).json()["internal_states"][0])

    before = loop_stats()

    async def burst() -> tuple[list[Any], dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=n)) as client:

            async def one(i: int) -> Any:
                ids = [(i * 7 + j) % 250 + 3 for j in range(max_len - 1)]  # no shared prefix
                return await client.post(proc.url + "/generate", json={"input_ids": ids})

            tasks = [asyncio.ensure_future(one(i)) for i in range(n)]
            # SIGTERM closes the listening socket: a request not yet read would be refused. Wait
            # until the server has taken all of them (the tasks send while this thread polls).
            deadline = time.monotonic() + 120
            while (at_signal := await asyncio.to_thread(loop_stats))["submitted"] - before["submitted"] < n:
                assert time.monotonic() < deadline, f"the server took {at_signal} of {n} requests"
                assert not any(t.done() and t.exception() for t in tasks), [t.exception() for t in tasks]
                await asyncio.sleep(0.02)
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks, return_exceptions=True), at_signal

    try:
        results, at_signal = asyncio.run(burst())
    finally:
        code = proc.proc.wait(timeout=60) if proc.proc else None
        proc.stop()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    statuses = [r.status_code for r in results]
    assert set(statuses) <= {200, 503}, statuses
    assert all(r.headers.get("retry-after") for r in results if r.status_code == 503)
    # Every request done before the signal, and the one running at the deadline, is answered 200.
    assert statuses.count(200) >= at_signal["completed"] - before["completed"]
    assert statuses.count(200) > 0
    # How many of the queued requests the 0.2 s drain still runs depends on the machine's speed, so
    # the split between 200 and 503 is reported, not asserted; the deadline's 503 path is tested
    # deterministically in test_drain_deadline_answers_what_is_still_queued_503.
    # uvicorn re-raises the signal once its graceful shutdown is done: a clean exit by SIGTERM.
    assert code in (0, -signal.SIGTERM)
    at = {k: at_signal[k] for k in ("completed", "running", "queued")}
    print(f"SIGTERM burst: {statuses.count(200)} x 200, {statuses.count(503)} x 503; at the signal {at}")


def test_500_body_carries_an_id_not_the_exception() -> None:
    service = FakeService(refuse=RuntimeError("secret: /etc/internal/path"))
    app = create_app(service, ServerArgs(engine=Settings(model_path="m")))
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/generate", json={"input_ids": [1, 2, 3]})
        assert r.status_code == 500
        message = error_message(r)
        assert "secret" not in r.text and "error id" in message
        r = client.post("/v1/completions", json={"prompt": [1, 2, 3]})
        assert r.status_code == 500 and r.json()["object"] == "error" and "secret" not in r.text


def test_drain_deadline_answers_what_is_still_queued_503() -> None:
    """The shutdown deadline (what SIGTERM arms) fails every queued request with a 503 that
    carries Retry-After, so clients and the router retry elsewhere; nothing is dropped."""
    backend = FakeService()  # takes every request and never runs it
    args = ServerArgs(engine=Settings(model_path="m"))
    app = create_app(backend, args)
    with TestClient(app, raise_server_exceptions=False) as client, ThreadPoolExecutor(2) as pool:
        calls = [pool.submit(client.post, "/generate", json={"input_ids": [1, 2, 3]}) for _ in range(2)]
        deadline = time.monotonic() + 60
        while len(backend.pending) < 2:  # both calls queued
            assert time.monotonic() < deadline, "the calls never reached the backend"
            time.sleep(0.01)
        server = DrainingServer(uvicorn_config(app, args), app.state.runtime, args.shutdown_timeout)
        server._deadline()
        for call in calls:
            r = call.result(timeout=60)
            assert r.status_code == 503, r.text
            assert r.headers.get("retry-after")
            assert "shutting down" in error_message(r)
