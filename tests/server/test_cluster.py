"""`po_backend.entrypoints.launch_cluster`: two workers behind the real SGLang router on loopback answer as one
server does, a worker killed mid-burst loses no request, SIGTERM stops every process; a worker
added at runtime through the router's worker API takes its share of the calls."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from po_backend.entrypoints import launch_cluster
from po_backend.entrypoints.launch_cluster import add_worker, visible_gpus, worker_env
from tests.deps import require
from tests.server_utils import (
    CLUSTER_WORKER_FLAGS,
    REPO_ROOT,
    ServerProcess,
    cluster_key,
    dead_url,
    launched_cluster,
    poll_until,
    worker_urls,
)

require("sglang_router", "pip install sglang-router")

QUERY = {"query": "which pets like to play", "documents": ["cats like to play", "tax news", "dogs play"]}


def routed_call(route: str, i: int, items: int = 1) -> dict[str, Any]:
    """A call on `route` whose text (what cache_aware routes by) differs with `i` from its first
    character: cache_aware sends a text that matches no worker's tree to the one with the least.
    /v1/score's `items` go as one routed /generate each (the gate's translation), which with one
    item lands on one worker; /generative_scoring's token ids as one batched /generate."""
    return {
        "/generate": {"text": f"{i} hello cats", "sampling_params": {"max_new_tokens": 0}},
        "/v1/completions": {"model": "m", "prompt": f"{i} hello dogs", "max_tokens": 1, "logprobs": 2},
        "/v1/rerank": {**QUERY, "query": f"{i} {QUERY['query']}"},
        "/v1/classify": {"model": "m", "input": [f"{i} cats play", f"{i} tax news"]},
        "/v1/embeddings": {"model": "m", "input": [f"{i} cats play", f"{i} tax news"]},
        "/v1/score": {
            "query": f"{i} Is it",
            "items": [" cats", " dogs", " fish"][:items],
            "label_token_ids": [5, 6],
        },
        "/generative_scoring": {
            "query": [i % 250 + 1, 7],
            "items": [[8, 9], [10]],
            "label_token_ids": [5, 6],
        },
    }[route]


# Every route family the router forwards, by the task the workers serve (one cluster each).
GENERATE_ROUTES = (
    "/generate",
    "/v1/completions",
    "/v1/rerank",
    "/v1/classify",
    "/v1/score",
    "/generative_scoring",
)
EMBED_ROUTES = ("/v1/embeddings",)


class Clusters:
    """The module's 2-worker cluster, started once for the tests that share it. A test that ends
    it (SIGTERM) takes it instead (`take`): no later test can get a cluster that is gone, a later
    `shared()` starts a fresh one. What is still running at the end of the module is killed."""

    def __init__(self, model: Path, stack: contextlib.ExitStack) -> None:
        self.model, self.stack = model, stack
        self.running: tuple[str, subprocess.Popen[bytes]] | None = None

    def shared(self) -> tuple[str, subprocess.Popen[bytes]]:
        if self.running is None:
            launcher = self.stack.enter_context(launched_cluster(self.model, ["--workers", "2"]))
            assert launcher.proc is not None
            self.running = launcher.url, launcher.proc
        return self.running

    def take(self) -> tuple[str, subprocess.Popen[bytes]]:
        running = self.shared()
        self.running = None
        return running


@pytest.fixture(scope="module")
def clusters(tokenized_llama: Path) -> Iterator[Clusters]:
    with contextlib.ExitStack() as stack:
        yield Clusters(tokenized_llama, stack)


@pytest.fixture
def cluster(clusters: Clusters) -> tuple[str, subprocess.Popen[bytes]]:
    return clusters.shared()


@pytest.fixture(scope="module")
def single(tokenized_llama: Path) -> Iterator[ServerProcess]:
    """One server with the workers' flags: the reference a cluster must answer like, and the worker
    added at runtime (joining a router changes nothing in it; its calls are counted as deltas)."""
    proc = ServerProcess(["--model-path", str(tokenized_llama), *CLUSTER_WORKER_FLAGS]).start()
    try:
        yield proc
    finally:
        proc.stop()


def scores(resp: httpx.Response) -> list[tuple[int, float]]:
    assert resp.status_code == 200, resp.text
    body = resp.json()
    rows: list[dict[str, Any]] = body["results"] if isinstance(body, dict) else body
    return sorted((r["index"], round(float(r.get("relevance_score", r.get("score", 0.0))), 4)) for r in rows)


@pytest.mark.slow
def test_cluster_answers_like_one_server(
    single: ServerProcess, cluster: tuple[str, subprocess.Popen[bytes]]
) -> None:
    """`single` first: it boots while the cluster does."""
    url, _ = cluster
    single.wait_ready()
    assert scores(httpx.post(url + "/v1/rerank", json=QUERY, timeout=60)) == scores(
        httpx.post(single.url + "/v1/rerank", json=QUERY, timeout=60)
    )


@pytest.mark.slow
def test_answers_through_the_gate_carry_one_date_and_one_server_header(
    cluster: tuple[str, subprocess.Popen[bytes]],
) -> None:
    """The router's answers pass the public port's HTTP server, which writes its own `date` and
    `server`: the router's are dropped, so a client sees one of each (answers the router builds,
    those a worker built, a 404, the gate's own liveness probe alike)."""
    url, _ = cluster
    with httpx.Client(base_url=url, timeout=60) as client:
        for method, path, body in (
            ("GET", "/v1/models", None), ("POST", "/v1/rerank", QUERY), ("POST", "/generate", routed_call("/generate", 0)),
            ("GET", "/no/such/route", None), ("GET", "/health", None),
        ):  # fmt: skip
            r = client.request(method, path, json=body)
            assert r.status_code in (200, 404), (path, r.status_code, r.text[:200])
            assert len(r.headers.get_list("date")) == 1, (path, r.headers)
            assert len(r.headers.get_list("server")) == 1, (path, r.headers)


def rerank_calls(worker_url: str) -> int:
    """/v1/rerank calls the worker answered 200 (its po_http_requests counter)."""
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "po_http_requests_total"
        and sample.labels == {"endpoint": "/v1/rerank", "status": "200"}
    )


@pytest.mark.slow
def test_a_hot_users_burst_spreads_over_the_workers(cluster: tuple[str, subprocess.Popen[bytes]]) -> None:
    """One user's calls all match one worker's cache; cache_aware keeps them there until that
    worker has --balance-abs-threshold (ours: 32) more outstanding than the other. With the
    router's default 64 a burst of this size never spreads (a prefill-only worker rarely holds
    that many)."""
    url, _ = cluster
    workers = worker_urls(url)
    before = [rerank_calls(w) for w in workers]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*(client.post(url + "/v1/rerank", json=QUERY) for _ in range(60)))

    assert all(r.status_code == 200 for r in asyncio.run(burst()))
    spread = [rerank_calls(w) - b for w, b in zip(workers, before, strict=True)]
    print("60-call burst split", spread)
    assert sum(spread) == 60 and min(spread) > 0, spread


def submitted(worker_url: str, key: str) -> int:
    """Prompts the worker's scheduling loop has taken (its /server_info, with the worker key the
    router sends it)."""
    r = httpx.get(worker_url + "/server_info", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return int(r.json()["internal_states"][0]["submitted"])


@pytest.mark.slow
def test_a_killed_worker_loses_nothing_and_sigterm_stops_all(clusters: Clusters) -> None:
    """Calls in flight on a worker that is SIGKILLed, on every route family of the generate task,
    are answered by the other one. The test ends the cluster with SIGTERM: it takes the shared one,
    which no later test gets."""
    url, proc = clusters.take()
    workers = worker_procs(proc)
    assert len(workers) == 2
    victim = workers[0]
    victim_url = url_of(victim)
    assert victim_url in worker_urls(url)
    key = cluster_key(url, "worker")
    before = submitted(victim_url, key)

    async def burst() -> list[Any]:
        async with httpx.AsyncClient(timeout=120) as client:

            def send(i: int) -> asyncio.Future[Any]:
                route = GENERATE_ROUTES[i % len(GENERATE_ROUTES)]  # distinct texts: both workers
                return asyncio.ensure_future(client.post(url + route, json=routed_call(route, i, items=3)))

            tasks = [send(i) for i in range(100)]
            # Mid-burst: once the victim holds some of the burst (the tasks send meanwhile).
            await asyncio.to_thread(
                poll_until, lambda: submitted(victim_url, key) > before, "the victim worker has requests"
            )
            victim.kill()  # SIGKILL: no drain, no goodbye
            tasks += [send(i) for i in range(100, 120)]  # after the death: the router routes around it
            return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(burst())
    assert len(results) == 120
    failed = [r if isinstance(r, BaseException) else (r.status_code, r.text[:200]) for r in results
              if isinstance(r, BaseException) or r.status_code != 200]  # fmt: skip
    assert not failed, failed[:3]
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=90) == 0
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [p.cmdline() for p in alive]


def refuses(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=5)
    except httpx.TransportError:
        return True
    return False


def worker_procs(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """The launcher's workers."""
    return [c for c in psutil.Process(proc.pid).children() if "launch_server" in " ".join(c.cmdline())]


def url_of(worker: psutil.Process) -> str:
    cmdline = worker.cmdline()
    return f"http://127.0.0.1:{cmdline[cmdline.index('--port') + 1]}"


@pytest.mark.slow
@pytest.mark.parametrize("task", ["generate", "embed"])
def test_a_lone_call_routed_to_a_killed_worker_is_answered(tokenized_llama: Path, task: str) -> None:
    """The router's retries reach the other worker. cache_aware sends a text to the worker it sent
    that text before, dead or not, until that worker's circuit breaker opens: a call arriving alone
    just after the kill (no calls in flight whose failures open the breaker first) spends its
    attempts there, and with no more attempts than the breaker's threshold it got a 500."""
    routes = GENERATE_ROUTES if task == "generate" else EMBED_ROUTES
    with launched_cluster(tokenized_llama, ["--workers", "2", "--task", task]) as launcher:
        url, proc = launcher.url, launcher.proc
        workers = {url_of(w): w for w in worker_procs(proc)}
        key = cluster_key(url, "worker")
        # The victim: the worker the router sends the first call to; then, for every route, a
        # call it sends there (cache_aware sends a text matching no worker's tree to the worker
        # with the least; which that is, is the router's business).
        on_victim: list[tuple[str, dict[str, Any]]] = []
        victim_url = ""
        with httpx.Client(timeout=60) as client:
            for route in routes:
                for i in range(12):
                    before = {w: submitted(w, key) for w in workers}
                    resp = client.post(url + route, json=routed_call(route, i))
                    assert resp.status_code == 200, (route, resp.status_code, resp.text[:200])
                    [took] = [w for w in workers if submitted(w, key) > before[w]]
                    victim_url = victim_url or took
                    if took == victim_url:
                        on_victim.append((route, routed_call(route, i)))
                        break
            assert [r for r, _ in on_victim] == list(routes), f"calls on the victim: {on_victim}"
            victim = workers[victim_url]
            victim.kill()
            poll_until(lambda: refuses(victim_url), "the killed worker's port refuses connections")
            answers = [(route, client.post(url + route, json=body)) for route, body in on_victim]
        failed = [(route, r.status_code, r.text[:200]) for route, r in answers if r.status_code != 200]
        assert not failed, failed


@pytest.mark.slow
def test_a_worker_added_at_runtime_takes_calls(tokenized_llama: Path, single: ServerProcess) -> None:
    extra = single
    flags = ["--workers", "1", "--router-policy", "round_robin"]
    with launched_cluster(tokenized_llama, flags) as launcher:
        url = launcher.url
        [first] = worker_urls(url)
        extra.wait_ready()
        # The reference: the new worker on its own (a single server), before it joins.
        bodies = [{**QUERY, "query": f"{QUERY['query']} {i}"} for i in range(8)]
        want = [scores(httpx.post(extra.url + "/v1/rerank", json=b, timeout=60)) for b in bodies]

        cli = [
            sys.executable,
            "-m",
            "po_backend.entrypoints.launch_cluster",
            "add-worker",
            "--router",
            url,
        ]
        added = subprocess.run(
            [*cli, "--worker-url", extra.url, "--timeout", "60"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert added.returncode == 0, added.stderr
        assert worker_urls(url) == sorted([first, extra.url])

        before = rerank_calls(first), rerank_calls(extra.url)
        got = [scores(httpx.post(url + "/v1/rerank", json=b, timeout=60)) for b in bodies]
        after = rerank_calls(first), rerank_calls(extra.url)

        # Nothing listens there: a clear error once our wait is over, not a hang.
        with dead_url() as nobody, pytest.raises(RuntimeError, match="has not taken"):
            add_worker(url, nobody, timeout=2)
    assert got == want
    on_first, on_extra = after[0] - before[0], after[1] - before[1]
    assert on_first + on_extra == len(bodies)
    assert on_extra > 0 and on_first > 0, (on_first, on_extra)  # round robin: both share the calls


def test_add_worker_clear_errors() -> None:
    with pytest.raises(ValueError, match="bad worker URL"):
        add_worker("http://127.0.0.1:1", "10.0.0.7:30001")
    with pytest.raises(ValueError, match="bad router URL"):
        add_worker("127.0.0.1:30000", "http://10.0.0.7:30001")


def test_each_worker_gets_one_gpu_where_there_are_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU logic, run on CPU: one device per worker in turn, the user's CUDA_VISIBLE_DEVICES
    respected, nothing set without GPUs."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 5")
    gpus = visible_gpus()
    assert gpus == ["2", "5"]
    assert [worker_env(3, i, gpus)["CUDA_VISIBLE_DEVICES"] for i in range(3)] == ["2", "5", "2"]
    assert worker_env(3, 1, gpus)["OMP_NUM_THREADS"] == worker_env(3)["OMP_NUM_THREADS"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # the usual way to hide every GPU
    assert visible_gpus() == []
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    import torch

    assert len(visible_gpus()) == torch.cuda.device_count()
    # With a GPU driver's device node present, torch counts (here: none, a CPU build or no GPU).
    monkeypatch.setattr(launch_cluster, "GPU_DEVICE_NODES", ("null",))
    assert len(visible_gpus()) == torch.cuda.device_count()
    env = worker_env(2, 0, [])
    assert env.get("CUDA_VISIBLE_DEVICES") is None
