"""N PrefillOnly workers behind the real SGLang router (the SGLang Model Gateway), one endpoint:

    python -m po_backend.launch_cluster --model-path embedded --workers 2 --host 127.0.0.1 \\
        --port 30000 [--router-policy cache_aware|round_robin|power_of_two] [worker flags...]

The equivalent of `python -m sglang_router.launch_server --dp-size N`: each worker is
`po_backend.launch_server` on its own loopback port with the CPU threads split between them; the
router (`pip install sglang-router`) listens on HOST:PORT with retries, a circuit breaker and
health checks set so a dead worker's requests go to the others. Unknown flags go to every worker.
Ctrl-C / SIGTERM: the router stops taking requests first, then the workers drain (they answer what
they queued, see --shutdown-timeout), then everything exits. Workers on other machines join with the
router's own `--worker-urls` (run `launch_server` there and list its URL).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx

log = logging.getLogger("po_backend.launch_cluster")

POLICIES = ("cache_aware", "round_robin", "power_of_two")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="po-launch-cluster", description=__doc__.splitlines()[0] if __doc__ else None
    )
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--host", default="127.0.0.1", help="the router's address (workers stay on loopback)")
    ap.add_argument("--port", type=int, default=30000, help="the router's port")
    ap.add_argument("--router-policy", choices=POLICIES, default="cache_aware")
    ap.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for workers and router to come up"
    )
    return ap


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_command(model_path: str, port: int, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "po_backend.launch_server",
        "--model-path",
        model_path,
        "--port",
        str(port),
        *extra,
    ]


def router_command(worker_urls: Sequence[str], host: str, port: int, policy: str) -> list[str]:
    """The router with failover on: a failed call is retried on another worker, a worker that keeps
    failing is cut off by the circuit breaker and its health checks, its users move to the others."""
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
        "--policy", policy, "--host", host, "--port", str(port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50",
        "--cb-failure-threshold", "3", "--cb-timeout-duration-secs", "10",
        "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
        "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "600",
        "--log-level", "warn",
    ]  # fmt: skip


def wait_until(url: str, procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """Until `url` answers 200 (a process of `procs` exiting first is an error)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"{' '.join(map(str, p.args))[:120]}... exited with {p.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")


def stop_all(router: subprocess.Popen[bytes] | None, workers: Sequence[subprocess.Popen[bytes]]) -> None:
    """Router first (no new work), then the workers drain; whatever ignores SIGTERM is killed."""
    for group in ([router] if router else [], list(workers)):
        for p in group:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in group:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    threads = max(1, (os.cpu_count() or 1) // args.workers)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # the cores split between the workers
    ports = [free_port() for _ in range(args.workers)]
    workers = [
        subprocess.Popen(worker_command(args.model_path, p, ["--log-level", "warning", *extra]), env=env)
        for p in ports
    ]
    router: subprocess.Popen[bytes] | None = None
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for u in urls:
            wait_until(u + "/health", workers, args.startup_timeout)
        router = subprocess.Popen(router_command(urls, args.host, args.port, args.router_policy))
        wait_until(f"http://{args.host}:{args.port}/get_model_info", [router], args.startup_timeout)
        log.info("serving %s on http://%s:%d: %d workers (%s), %s", args.model_path, args.host, args.port,
                 args.workers, ", ".join(urls), args.router_policy)  # fmt: skip
        while not stopping:
            if router.poll() is not None:
                log.error("the router exited with %s", router.returncode)
                return 1
            time.sleep(0.5)
        return 0
    finally:
        stop_all(router, workers)


if __name__ == "__main__":
    sys.exit(main())
