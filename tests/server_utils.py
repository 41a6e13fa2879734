"""Test helpers: our real server in a subprocess on a free loopback port (`po_backend.entrypoints.spawn`
starts it and waits until it is healthy), and SGLang's frontend or a skip."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.entrypoints import launch_cluster, spawn
from po_backend.entrypoints.spawn import free_port
from po_lang.sglang_shim import import_sglang_frontend
from tests.deps import missing

REPO_ROOT = Path(__file__).resolve().parent.parent


def error_message(resp: httpx.Response) -> str:
    """The message of either of SGLang's error shapes (flat on /v1/*, nested on native routes)."""
    body = resp.json()
    return str(body["error"]["message"] if "error" in body else body["message"])


def metric(url: str, name: str, default: float | None = None) -> float:
    """One unlabelled series (or a full `name{labels}`) of the server's /metrics."""
    text = httpx.get(url + "/metrics", timeout=10.0).text
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    if m is None and default is not None:
        return default  # a labelled series appears at its first increment
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def poll_until(ready: Callable[[], bool], what: str, timeout: float = 120.0, interval: float = 0.02) -> None:
    """Wait for a state (the queue holds the burst, a counter moved) instead of sleeping and
    hoping; the deadline only turns a hang into a failure that says what never happened."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() >= deadline:
            raise AssertionError(f"not reached within {timeout:.0f} s: {what}")
        time.sleep(interval)


@contextlib.contextmanager
def dead_url() -> Iterator[str]:
    """A loopback URL that refuses connections for as long as the block runs: its port is bound by
    a socket that never listens, so no other process can take it meanwhile. A port that was only
    found free (`free_port`), or the port of a server just stopped, can be taken at any moment by
    a server that another test starts, which then answers instead of nobody."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


class ServerProcess(spawn.ServerProcess):
    """`python -m po_backend.entrypoints.launch_server ...` on 127.0.0.1 and a free port."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "po_backend.entrypoints.launch_server", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), *args]
        # One thread each: several servers and the test process share two cores. The cache root
        # (GGUF conversion, kernel build) is the user's, shared by every server; the JCT profiles
        # go to the session's directory (tests/conftest.py sets it in os.environ).
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        super().__init__(command, f"http://127.0.0.1:{self.port}", env=full_env, cwd=REPO_ROOT)
        self.args = command

    def wait_ready(self, timeout: float = 120.0, headers: Mapping[str, str] | None = None) -> ServerProcess:
        super().wait_ready(timeout, headers)
        return self


# Small prompts, both classify labels: what every cluster test's workers serve.
CLUSTER_WORKER_FLAGS = ("--dtype", "fp32", "--max-input-len", "256", "--classify-labels", "yes,no")


@contextlib.contextmanager
def launched_cluster(
    model: Path,
    flags: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 240.0,
) -> Iterator[spawn.ServerProcess]:
    """`launch_cluster` (`CLUSTER_WORKER_FLAGS` and `flags`) on a free loopback port, with `env`
    as its whole environment (default ours), ready once its public port answers /get_model_info
    with `headers` (a data key's). Its workers, router and gate are killed on the way out, with
    the launcher, unless a test already stopped them."""
    import psutil

    port = free_port()
    cmd = [sys.executable, "-m", "po_backend.entrypoints.launch_cluster", "--model-path", str(model)]
    cmd += ["--port", str(port), *flags, *CLUSTER_WORKER_FLAGS]
    launcher = spawn.ServerProcess(
        cmd, f"http://127.0.0.1:{port}", env=None if env is None else dict(env), cwd=REPO_ROOT,
        health_path="/get_model_info",
    )  # fmt: skip
    launcher.start()
    proc = launcher.proc
    assert proc is not None
    children: list[psutil.Process] = []
    try:
        launcher.wait_ready(timeout, headers)
        children = psutil.Process(proc.pid).children(recursive=True)
        yield launcher
    finally:
        if proc.poll() is None:
            children += psutil.Process(proc.pid).children(recursive=True)
            proc.kill()
            proc.wait()
        for child in children:  # a test that killed the launcher leaves none behind either
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def cluster_key(router_url: str, kind: str) -> str:
    """The `kind` key ("admin", "worker") the launcher made for the cluster at `router_url`."""
    return launch_cluster.key_path(httpx.URL(router_url).port or 0, kind).read_text().strip()


def worker_urls(router_url: str) -> list[str]:
    """The workers the router routes to, from its worker API (with the admin key the launcher made)."""
    key = cluster_key(router_url, "admin")
    r = httpx.get(router_url + "/workers", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return sorted(w["url"] for w in r.json()["workers"])


async def read_asgi_body(receive: Callable[[], Awaitable[dict[str, Any]]]) -> bytes:
    """A whole request body as an ASGI app receives it (for the tests' model-free upstreams)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


def assert_same_answer(a: Any, b: Any, where: str = "answer") -> None:
    """`a` and `b` equal, floats within fp32 round-off: one of two calls may read the prompt from
    the prefix cache, which moves the last digits (fp32 sums in another order); a rounded
    comparison would still differ where a value sits on a rounding boundary."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, int | float) and isinstance(b, int | float), (where, a, b)
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5), (where, a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for k in a:
            assert_same_answer(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_answer(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


class FakeService:
    """A scoring service without a model, for the server's failure paths (`create_app` takes it in
    place of a `LoopService`): `submit_many` raises `refuse` when given; else it answers every
    request at once with `answer(request)`, or, without `answer`, takes the requests and never
    runs them (what is still queued at a drain deadline; `abandon_waiting` fails them)."""

    max_input_len = 64
    model_type = "llama"
    architectures = ("LlamaForCausalLM",)

    def __init__(
        self,
        refuse: BaseException | None = None,
        answer: Callable[[ScoreRequest], ScoreResult] | None = None,
        tokenizer: Any = None,
        vocab_size: int = 100,
        dtype: str = "fp32",
    ) -> None:
        self.refuse, self.answer, self.tokenizer, self.vocab_size = refuse, answer, tokenizer, vocab_size
        self.settings = {"dtype": dtype}
        self.pending: list[Future[ScoreResult]] = []

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        if self.refuse is not None:
            raise self.refuse
        futures: list[Future[ScoreResult]] = [Future() for _ in reqs]
        for f, r in zip(futures, reqs, strict=True):
            if self.answer is None:
                self.pending.append(f)
            else:
                f.set_result(self.answer(r))
        return futures

    def cancel(self, fut: Future[ScoreResult]) -> None:
        fut.cancel()

    def stats(self) -> dict[str, Any]:
        return {}

    def flush_cache(self) -> None: ...

    def alive(self) -> bool:
        return True

    def abandon_waiting(self, error: BaseException) -> int:
        waiting = [f for f in self.pending if not f.done()]
        for f in waiting:
            f.set_exception(error)
        return len(waiting)

    def shutdown(self) -> None: ...


# ---- SGLang frontend -------------------------------------------------------------------------


def sglang_frontend() -> Any:
    """SGLang's frontend through our shim. Not installed: a skip (a failure under
    PO_REQUIRE_DEPS=1); any other error is our shim's bug and fails the test."""
    try:
        return import_sglang_frontend()
    except ImportError as e:
        missing(f"SGLang frontend unavailable ({e}); pip install --no-deps sglang==0.5.23")


T = TypeVar("T")


def probed_while(
    url: str,
    call: Callable[[], T],
    probes: Sequence[Callable[[httpx.Client], httpx.Response]],
    timeout: float,
) -> tuple[T, list[float]]:
    """`call()`'s result, and the slowest answer of each probe: requests another keep-alive client
    sends back to back (every probe at least once, each answering 200) while `call` runs in
    another thread."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:
            errors.append(e)

    worker = threading.Thread(target=run)
    slowest = [0.0] * len(probes)
    with httpx.Client(base_url=url, timeout=timeout) as prober:
        prober.get("/health")  # the connection is open before the call starts
        worker.start()
        rounds = 0
        while worker.is_alive() or rounds == 0:
            for i, probe in enumerate(probes):
                t0 = time.perf_counter()
                assert probe(prober).status_code == 200
                slowest[i] = max(slowest[i], time.perf_counter() - t0)
            rounds += 1
    worker.join()
    if errors:
        raise errors[0]
    return result[0], slowest
