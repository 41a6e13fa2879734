"""`po_backend.launch_cluster`: two workers behind the real SGLang router on loopback answer as one
server does, a worker killed mid-burst loses no request, SIGTERM stops every process."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from po_backend.launch_cluster import wait_until
from tests.server_utils import REPO_ROOT, ServerProcess, free_port

pytest.importorskip("sglang_router")

QUERY = {"query": "which pets like to play", "documents": ["cats like to play", "tax news", "dogs play"]}


@pytest.fixture(scope="module")
def cluster(tokenized_llama: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    cmd = [sys.executable, "-m", "po_backend.launch_cluster", "--model-path", str(tokenized_llama)]
    cmd += ["--workers", "2", "--port", str(port), "--dtype", "fp32", "--max-input-len", "256"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(url + "/get_model_info", [proc], 180)
        yield url, proc
    finally:
        if proc.poll() is None:  # a test failed before its SIGTERM: leave no worker behind
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()


def scores(resp: httpx.Response) -> list[tuple[int, float]]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    rows: list[dict[str, Any]] = body["results"] if isinstance(body, dict) else body
    return sorted((r["index"], round(float(r.get("relevance_score", r.get("score", 0.0))), 4)) for r in rows)


def test_cluster_answers_like_one_server(
    cluster: tuple[str, subprocess.Popen[bytes]], tokenized_llama: Path
) -> None:
    url, _ = cluster
    single = ServerProcess(
        ["--model-path", str(tokenized_llama), "--dtype", "fp32", "--max-input-len", "256"]
    )
    single.start()
    try:
        single.wait_ready()
        assert scores(httpx.post(url + "/v1/rerank", json=QUERY, timeout=60)) == scores(
            httpx.post(single.url + "/v1/rerank", json=QUERY, timeout=60)
        )
    finally:
        single.stop()


def test_a_killed_worker_loses_nothing_and_sigterm_stops_all(
    cluster: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, proc = cluster
    workers = [c for c in psutil.Process(proc.pid).children() if "launch_server" in " ".join(c.cmdline())]
    assert len(workers) == 2

    async def burst() -> list[Any]:
        async with httpx.AsyncClient(timeout=120) as client:

            def send(i: int) -> asyncio.Future[Any]:
                body = {**QUERY, "query": f"{QUERY['query']} {i}"}  # distinct prefixes: both workers
                return asyncio.ensure_future(client.post(url + "/v1/rerank", json=body))

            tasks = [send(i) for i in range(200)]
            await asyncio.sleep(0.05)
            workers[0].kill()  # SIGKILL mid-burst: no drain, no goodbye
            tasks += [send(i) for i in range(200, 240)]  # after the death: the router routes around it
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(burst())
    assert len(results) == 240
    failed = [r if isinstance(r, BaseException) else (r.status_code, r.text[:200]) for r in results
              if isinstance(r, BaseException) or r.status_code != 200]  # fmt: skip
    assert not failed, failed[:3]
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]
