"""N PrefillOnly workers behind the real SGLang router (the SGLang Model Gateway), one endpoint:

    python -m po_backend.entrypoints.launch_cluster --model-path embedded --workers 2 --host 127.0.0.1 \\
        --port 30000 [--router-policy cache_aware|round_robin|power_of_two] [worker flags...]

The equivalent of `python -m sglang_router.launch_server --dp-size N`: each worker is
`po_backend.entrypoints.launch_server` on its own loopback port with the CPU threads split between them (and
one GPU each where there are GPUs: CUDA_VISIBLE_DEVICES, or all that torch sees); the
router (`pip install sglang-router`) routes between them with retries, a circuit breaker and
health checks set so a dead worker's requests go to the others. The router listens on a private
loopback port behind `entrypoints.gate`, which serves HOST:PORT and checks a key on every route
(the router leaves its informational routes open). Unknown flags go to every worker.
Ctrl-C / SIGTERM: the public port and the router stop taking requests first, then the workers
drain (they answer what they queued, see --shutdown-timeout), then everything exits.

A worker started later, on this machine or another, joins the running router through the router's
worker API (POST /workers, with the admin key); this launcher neither starts nor stops it. The
router sends it the cluster's worker key (made at start, kept in a file of mode 0600 beside the
admin key), so start it with $PREFILLONLY_API_KEY set to that key:

    python -m po_backend.entrypoints.launch_cluster add-worker --router http://127.0.0.1:30000 \\
        --worker-url http://10.0.0.7:30001
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from po_backend.core.choices import ROUTER_POLICIES
from po_backend.core.fs import private_cache_dir
from po_backend.entrypoints.spawn import (
    NotReadyError,
    child_env,
    die_with_parent,
    free_port,
    stop,
    wait_until,
)

if TYPE_CHECKING:
    from po_backend.server.args import ServerArgs

log = logging.getLogger("po_backend.entrypoints.launch_cluster")

# cache_aware leaves a request's cache match for the least-loaded worker only past this imbalance of
# outstanding requests. The router's 64 suits long decode requests and never fires for one-forward
# calls; far lower fires on ordinary bursts and costs the cache (docs/scaling-out.md).
BALANCE_ABS_THRESHOLD = 32
# The router picks a worker afresh for each attempt of a call (its --retry-max-retries counts attempts,
# the first included), but cache_aware keeps picking a dead worker until that worker's circuit
# breaker opens after CB_FAILURES consecutive failures: with no more attempts than that, a lone call
# routed to a worker just killed spends them all there and gets a 500. Attempts beyond the
# threshold reach another worker.
CB_FAILURES = 3
ROUTER_ATTEMPTS = CB_FAILURES + 3
# The /dev entries of the drivers torch.cuda reaches GPUs through: NVIDIA's, ROCm's, WSL 2's.
GPU_DEVICE_NODES = ("nvidia*", "kfd", "dxg")
ADD_WORKER = "add-worker"  # the subcommand
RUN_ROUTER = "run-router"  # internal: the router with its keys read from the environment
RUN_GATE = "run-gate"  # internal: the public port's key check (entrypoints.gate)
API_KEY_ENV = "PREFILLONLY_API_KEY"  # the data plane's key: what clients send the public port
# The router's control plane (adding / removing workers, flushing caches) has a key of its own, so a
# client that may score cannot reconfigure the cluster: given, or made at start and kept in a file
# only this user can read.
ADMIN_KEY_ENV = "PREFILLONLY_ROUTER_ADMIN_KEY"
# What the router takes on its data routes and sends the workers (data calls, health checks, the
# /flush_cache fan-out), made at every start: the gate swaps the data key for it, so a data-key
# holder can call neither the router's private port nor a worker (its /flush_cache included).
WORKER_KEY_ENV = "PREFILLONLY_CLUSTER_WORKER_KEY"
SERVER_ADMIN_KEY_ENV = "PREFILLONLY_ADMIN_KEY"  # a single server's --admin-api-key; not the workers'


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="po-launch-cluster",
        description=__doc__.splitlines()[0] if __doc__ else None,
        epilog=f"{ADD_WORKER} --router URL --worker-url URL: add a running worker to a running router "
        f"(`{ADD_WORKER} --help`)",
    )
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--host", default="127.0.0.1", help="the router's address (workers stay on loopback)")
    ap.add_argument("--port", type=int, default=30000, help="the router's port")
    ap.add_argument("--router-policy", choices=ROUTER_POLICIES, default="cache_aware")
    ap.add_argument(
        "--balance-abs-threshold",
        type=int,
        default=BALANCE_ABS_THRESHOLD,
        help="cache_aware: route by load once the busiest worker has this many more outstanding requests "
        "than the idlest (the router's default 64 never fires for prefill-only calls; lower values move "
        "users off their cache on ordinary bursts)",
    )
    ap.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds for workers and router to come up"
    )
    ap.add_argument(
        "--api-key",
        default=None,
        help=f"the key every call to HOST:PORT needs (GET /health, /liveness and /readiness excepted); "
        f"${API_KEY_ENV} keeps it out of `ps`. Only the public port's gate sees it: the router and the "
        "workers take a key made at start. The router's control plane (/workers, /flush_cache) takes "
        f"${ADMIN_KEY_ENV}, a different key; without it one is made and kept in a file of mode 0600 "
        "(its path is printed)",
    )
    return ap


def check_worker_flags(model_path: str, extra: Sequence[str]) -> ServerArgs:
    """Parse the worker flags with the server's own parser and settings (`launch_server`,
    `core.settings.resolve`) before anything starts: a bad flag fails once, here, with the text
    a single server gives, instead of once per worker after the spawn. Returns the workers'
    settings (the gate checks their limits)."""
    from po_backend.entrypoints.launch_server import build_parser as server_parser
    from po_backend.entrypoints.launch_server import server_args

    parser = server_parser()
    parser.prog = "po-launch-cluster (worker flags)"
    ns = parser.parse_args(["--model-path", model_path, "--port", "0", *extra])  # exits on a bad flag
    try:
        return server_args(ns)
    except ValueError as e:
        parser.error(str(e))


def worker_command(model_path: str, port: int, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "po_backend.entrypoints.launch_server",
        "--model-path",
        model_path,
        "--port",
        str(port),
        *extra,
    ]


def worker_threads(workers: int) -> int:
    """Each of `workers` workers on this machine gets its share of the cores, so their thread pools
    do not fight over the same cores."""
    return max(1, (os.cpu_count() or 1) // workers)


def visible_gpus() -> list[str]:
    """The GPUs this launcher may hand out: CUDA_VISIBLE_DEVICES if set (so users pick them the
    usual way), else every device torch sees; [] on a CPU-only machine or torch."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip() and g.strip() != "-1"]
    if sys.platform == "linux" and not any(any(Path("/dev").glob(p)) for p in GPU_DEVICE_NODES):
        # No node a GPU driver makes (NVIDIA's, ROCm's, WSL's): nothing to count, and importing
        # torch to learn that costs the launcher seconds of CPU beside the workers it starts.
        return []
    import torch  # lazy: only to count devices; the launcher itself runs no torch code

    return [str(i) for i in range(torch.cuda.device_count())]


def worker_env(
    workers: int, index: int = 0, gpus: Sequence[str] = (), api_key: str | None = None
) -> dict[str, str]:
    """Worker `index`'s environment: its share of the CPU threads and, where there are GPUs, one
    GPU of its own (round robin when there are more workers than GPUs), as `--dp-size` gives
    each SGLang replica one. The worker then sees a single device and runs on cuda:0."""
    # They die with the launcher: a worker left behind would keep serving with the key.
    env = child_env({**os.environ, "OMP_NUM_THREADS": str(worker_threads(workers))})
    # The control plane's key is the router's alone; a worker's /flush_cache takes the worker key,
    # which only the router sends (its /flush_cache fans out with it).
    for name in (API_KEY_ENV, ADMIN_KEY_ENV, SERVER_ADMIN_KEY_ENV, WORKER_KEY_ENV):
        env.pop(name, None)
    if api_key:
        env[API_KEY_ENV] = api_key
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[index % len(gpus)]
    return env


def router_command(
    worker_urls: Sequence[str],
    host: str,
    port: int,
    policy: str,
    *,
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
) -> list[str]:
    """The router with failover on: a failed call is retried on another worker, a worker that keeps
    failing is cut off by the circuit breaker and its health checks, its users move to the others.
    It runs through `run-router`, which gives it the keys of its environment (`keys_env`)."""
    return [
        sys.executable, "-m", "po_backend.entrypoints.launch_cluster", RUN_ROUTER, "--worker-urls", *worker_urls,
        "--policy", policy, "--host", host, "--port", str(port),
        "--balance-abs-threshold", str(balance_abs_threshold),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--retry-max-retries", str(ROUTER_ATTEMPTS), "--retry-initial-backoff-ms", "50",
        "--retry-max-backoff-ms", "1000",
        "--cb-failure-threshold", str(CB_FAILURES), "--cb-timeout-duration-secs", "10",
        "--health-check-interval-secs", "2", "--health-failure-threshold", "2",
        "--worker-startup-check-interval", "1", "--worker-startup-timeout-secs", "600",
        "--log-level", "warn",
    ]  # fmt: skip


def gate_command(upstream: str, host: str, port: int, workers: ServerArgs | None = None) -> list[str]:
    """The public port: `run-gate` checks every call's key and forwards it to the router at
    `upstream` (its keys from the environment, `keys_env`), checking the calls it translates
    against the limits of the `workers`' settings."""
    limits = [] if workers is None else [
        "--max-body-bytes", str(workers.max_body_bytes), "--max-items-per-request", str(workers.max_items_per_request),
        "--served-model-name", workers.model_name,
        "--max-logprobs-per-request", str(workers.max_logprobs_per_request),
        "--max-tokenize-chars", str(workers.max_tokenize_chars),
    ]  # fmt: skip
    return [sys.executable, "-m", "po_backend.entrypoints.launch_cluster", RUN_GATE, "--upstream", upstream,
            "--host", host, "--port", str(port), *limits]  # fmt: skip


def keys_env(data_key: str | None, admin_key: str, worker_key: str) -> dict[str, str]:
    """The router's and the gate's environment: ours with the keys set (the data key removed
    when there is none), for `run_router` and `run_gate` to read."""
    env = {k: v for k, v in os.environ.items() if k not in (API_KEY_ENV, ADMIN_KEY_ENV, WORKER_KEY_ENV)}
    env.update({API_KEY_ENV: data_key} if data_key else {})
    env.update({ADMIN_KEY_ENV: admin_key, WORKER_KEY_ENV: worker_key})
    return child_env(env)


def key_path(port: int, kind: str = "admin") -> Path:
    """Where the `kind` key ("admin" or "worker") made for the cluster on `port` is kept (a folder
    only this user may write, the file only this user may read)."""
    return private_cache_dir("router", what="the router's keys") / f"{kind}-key-{port}"


def admin_key_path(port: int) -> Path:
    return key_path(port, "admin")


def make_key(port: int, kind: str = "admin") -> tuple[str, Path]:
    """A fresh `kind` key for the cluster on `port`, written to `key_path(port, kind)` (mode 0600)."""
    key = secrets.token_urlsafe(32)
    path = key_path(port, kind)
    path.unlink(missing_ok=True)  # O_EXCL below: never through a link someone left here
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key, path


def run_router(argv: Sequence[str]) -> int:
    """`sglang_router.launch_router` with `argv`, its keys taken from the environment: the router
    reads them from its command line only, where every user of the machine can read them (`ps`).
    $PREFILLONLY_CLUSTER_WORKER_KEY: what its data routes take and what it sends the workers;
    $PREFILLONLY_ROUTER_ADMIN_KEY: the control plane's (admin role)."""
    from sglang_router.launch_router import launch_router, parse_router_args

    die_with_parent()
    args = parse_router_args(list(argv))
    args.api_key = os.environ.get(WORKER_KEY_ENV) or None
    admin = os.environ.get(ADMIN_KEY_ENV)
    if not admin or not args.api_key or admin == args.api_key:
        # Without control-plane keys the router's /workers and /flush_cache take its data key.
        raise SystemExit(f"run-router: ${ADMIN_KEY_ENV} and ${WORKER_KEY_ENV} must be set, and differ")
    args.control_plane_api_keys = [("admin", "launch_cluster", admin, "admin")]
    launch_router(args)
    return 0


def run_gate(argv: Sequence[str]) -> int:
    """The public port (`entrypoints.gate`) in front of the router at --upstream, its keys taken
    from the environment. uvicorn as a single server runs it: idle keep-alive 5 s, a request read
    deadline, no limit on connections (idle sockets must not lock anyone out)."""
    import uvicorn

    from po_backend.entrypoints.gate import Gate, Keys, Limits
    from po_backend.entrypoints.launch_server import ReadDeadlineH11

    die_with_parent()
    ap = argparse.ArgumentParser(prog=f"po-launch-cluster {RUN_GATE}")
    ap.add_argument("--upstream", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    ap.add_argument("--max-items-per-request", type=int, default=Limits.max_items)
    ap.add_argument("--served-model-name", default=Limits.model_name)
    ap.add_argument("--max-logprobs-per-request", type=int, default=Limits.max_logprobs)
    ap.add_argument("--max-tokenize-chars", type=int, default=Limits.max_tokenize_chars)
    args = ap.parse_args(argv)
    admin, worker = os.environ.get(ADMIN_KEY_ENV), os.environ.get(WORKER_KEY_ENV)
    if not admin or not worker:
        raise SystemExit(f"run-gate: ${ADMIN_KEY_ENV} and ${WORKER_KEY_ENV} must be set")
    keys = Keys(data=os.environ.get(API_KEY_ENV) or None, admin=admin, worker=worker)
    limits = Limits(
        args.max_body_bytes,
        args.max_items_per_request,
        args.served_model_name,
        max_logprobs=args.max_logprobs_per_request,
        max_tokenize_chars=args.max_tokenize_chars,
    )
    config = uvicorn.Config(
        Gate(args.upstream, keys, limits=limits), host=args.host, port=args.port, log_level="warning", backlog=4096,
        timeout_keep_alive=5, h11_max_incomplete_event_size=64 * 1024, http=ReadDeadlineH11,
    )  # fmt: skip
    uvicorn.Server(config).run()
    return 0


def stop_all(
    gate: subprocess.Popen[bytes] | None,
    router: subprocess.Popen[bytes] | None,
    workers: Sequence[subprocess.Popen[bytes]],
) -> None:
    """The public port first, then the router (no new work), then the workers drain."""
    stop([p for p in (gate, router) if p is not None])
    stop(workers)


def wait_for_workers(urls: Sequence[str], procs: Sequence[subprocess.Popen[bytes]], timeout: float) -> None:
    """Until every worker answers /health, saying every few seconds how many are ready: the
    workers log at warning level, and a first start (model conversion, JCT profile) takes a while.
    One HTTP client polls them all (a client per poll builds an SSL context each time)."""
    start = time.monotonic()
    pending = dict(enumerate(urls))
    last_report = start
    with httpx.Client(timeout=2.0) as client:
        while pending:
            for i, url in list(pending.items()):
                try:
                    wait_until(url + "/health", procs, timeout=0.0, client=client)
                except NotReadyError:
                    if time.monotonic() - start > timeout:
                        raise
                    continue
                del pending[i]
                log.info("worker %d/%d ready at %s (%.0f s)", i + 1, len(urls), url, time.monotonic() - start)
            if pending and time.monotonic() - last_report >= 10:
                last_report = time.monotonic()
                log.info("starting workers: %d/%d ready after %.0f s (loading the model; a first start "
                         "converts it and measures the JCT model once)", len(urls) - len(pending), len(urls),
                         last_report - start)  # fmt: skip
            if pending:
                time.sleep(0.5)


# ---- adding a worker at runtime ------------------------------------------------------------------


def add_worker(router_url: str, worker_url: str, *, timeout: float = 600.0) -> str:
    """Register the running worker at `worker_url` with the running router at `router_url`, and
    wait until the router routes to it; returns the router's id for it (DELETE
    {router_url}/workers/{id} takes it out again).

    The router's worker API: POST /workers {"url": ...} is answered 202 with the worker's id at
    once, and the router then checks the worker in the background; GET /workers/{id} carries a
    `job_status` while that runs (`failed`, with the reason, if the worker never answered within
    the router's --worker-startup-timeout-secs), and none once the worker is in the routing set."""
    _check_url(worker_url, "worker")
    _check_url(router_url, "router")
    base = router_url.rstrip("/")
    admin = os.environ.get(ADMIN_KEY_ENV) or _stored_key(base, "admin")
    headers = {"Authorization": f"Bearer {admin}"} if admin else {}
    # The key the router sends this worker (health checks, the /flush_cache fan-out), as it sends
    # the workers it started with: the cluster's worker key, which the worker must be started with.
    worker_key = os.environ.get(WORKER_KEY_ENV) or _stored_key(base, "worker")
    body = {"url": worker_url, **({"api_key": worker_key} if worker_key else {})}
    resp = httpx.post(base + "/workers", json=body, headers=headers, timeout=30)
    if resp.status_code != 202:
        raise RuntimeError(f"{base}/workers answered {resp.status_code}: {resp.text[:300]}")
    worker_id = str(resp.json()["worker_id"])
    _wait_registered(f"{base}/workers/{worker_id}", worker_url, timeout, headers)
    return worker_id


def _stored_key(router_url: str, kind: str) -> str | None:
    """The `kind` key `launch_cluster` made for a cluster on this machine (`key_path`), if any."""
    url = httpx.URL(router_url)
    if url.host not in ("127.0.0.1", "localhost", "::1") or url.port is None:
        return None
    try:
        return key_path(url.port, kind).read_text().strip() or None
    except OSError:
        return None


def _check_url(url: str, what: str) -> None:
    # The router queues any string and only reports a bad one when its background check fails.
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as e:
        raise ValueError(f"bad {what} URL {url!r}: {e}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"bad {what} URL {url!r}: expected http://HOST:PORT")


def _wait_registered(status_url: str, worker_url: str, timeout: float, headers: dict[str, str]) -> None:
    """Until the router lists the worker healthy with its add job done; its failure is an error."""
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.get(status_url, headers=headers, timeout=10)
        resp.raise_for_status()
        info = resp.json()
        job = info.get("job_status")
        if job is None and info.get("is_healthy"):
            return
        if job is not None and job.get("status") == "failed":
            raise RuntimeError(f"the router could not add {worker_url}: {job.get('message')}")
        if time.monotonic() >= deadline:
            raise RuntimeError(
                f"the router has not taken {worker_url} within {timeout:.0f} s (it keeps trying until its "
                f"--worker-startup-timeout-secs); is the worker up and reachable from the router?"
            )
        time.sleep(0.5)


def add_worker_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=f"po-launch-cluster {ADD_WORKER}",
        description="Add a running worker (`launch_server` on any machine the router can reach) to a running "
        "router, through the router's worker API; returns once the router routes to it.",
    )
    ap.add_argument("--router", required=True, help="the router's URL, e.g. http://127.0.0.1:30000")
    ap.add_argument("--worker-url", required=True, help="the worker's URL as the router reaches it")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the router to take it")
    return ap


def add_worker_main(argv: Sequence[str]) -> int:
    ap = add_worker_parser()
    args = ap.parse_args(argv)
    try:
        worker_id = add_worker(args.router, args.worker_url, timeout=args.timeout)
    except ValueError as e:
        ap.error(str(e))
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"added {args.worker_url} to {args.router} as worker {worker_id}")
    return 0


# ---- the cluster ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [ADD_WORKER]:
        return add_worker_main(argv[1:])
    if argv[:1] == [RUN_ROUTER]:
        return run_router(argv[1:])
    if argv[:1] == [RUN_GATE]:
        return run_gate(argv[1:])
    die_with_parent()
    args, extra = build_parser().parse_known_args(argv)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    admin_key = os.environ.get(ADMIN_KEY_ENV) or None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.workers < 1:
        raise SystemExit("--workers must be >= 1")
    if args.balance_abs_threshold < 0:
        raise SystemExit("--balance-abs-threshold must be >= 0")
    if admin_key and admin_key == api_key:
        raise SystemExit(
            f"${ADMIN_KEY_ENV} must differ from the API key: the data key may not reconfigure the router"
        )
    settings = check_worker_flags(args.model_path, extra)
    made: list[Path] = []
    if not admin_key:
        admin_key, path = make_key(args.port, "admin")
        made.append(path)
        log.info("the router's control plane (/workers, /flush_cache) takes the admin key kept in %s "
                 "(mode 0600; set $%s to choose one)", path, ADMIN_KEY_ENV)  # fmt: skip
    worker_key, path = make_key(args.port, "worker")
    made.append(path)
    gpus = visible_gpus()
    if gpus and args.workers > len(gpus):
        log.warning("%d workers share %d GPUs (round robin)", args.workers, len(gpus))
    ports = [free_port() for _ in range(args.workers)]
    workers = [
        subprocess.Popen(
            worker_command(args.model_path, p, ["--log-level", "warning", *extra]),
            env=worker_env(args.workers, i, gpus, worker_key),
        )
        for i, p in enumerate(ports)
    ]
    router: subprocess.Popen[bytes] | None = None
    gate: subprocess.Popen[bytes] | None = None
    stopping = False

    def on_signal(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        wait_for_workers(urls, workers, args.startup_timeout)
        private = free_port()
        cmd = router_command(
            urls, "127.0.0.1", private, args.router_policy, balance_abs_threshold=args.balance_abs_threshold
        )
        env = keys_env(api_key, admin_key, worker_key)
        router = subprocess.Popen(cmd, env=env)
        wait_until(f"http://127.0.0.1:{private}/get_model_info", [router], args.startup_timeout,
                   headers={"Authorization": f"Bearer {worker_key}"})  # fmt: skip
        gate = subprocess.Popen(
            gate_command(f"http://127.0.0.1:{private}", args.host, args.port, settings), env=env
        )
        auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
        wait_until(f"http://{args.host}:{args.port}/get_model_info", [gate, router], args.startup_timeout,
                   headers=auth)  # fmt: skip
        log.info("serving %s on http://%s:%d: %d workers (%s), %s", args.model_path, args.host, args.port,
                 args.workers, ", ".join(urls), args.router_policy)  # fmt: skip
        while not stopping:
            for name, p in (("router", router), ("gate", gate)):
                if p.poll() is not None:
                    log.error("the %s exited with %s", name, p.returncode)
                    return 1
            time.sleep(0.5)
        return 0
    finally:
        stop_all(gate, router, workers)
        for path in made:  # the keys of a cluster that is gone open nothing: not left lying around
            path.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
