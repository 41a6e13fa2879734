"""Launch the HTTP server, with `python -m sglang.launch_server`-style flags:

    python -m po_backend.entrypoints.launch_server --model-path embedded --backend prefillonly \\
        --host 127.0.0.1 --port 30000 [--schedule-policy po] [--api-key KEY]

`--backend hf` serves the same API from plain transformers (FCFS, no prefix cache): the baseline
for side-by-side benchmarks. Also installed as the console scripts `prefillonly serve MODEL` and
`po-launch-server`. The flags are generated from `core.settings.Settings` and `ServerArgs`; the
ones SGLang (and vLLM) users paste are accepted under their names and mapped by
`core.settings.resolve`, the same function every in-process entry point uses; what a prefill-only
engine cannot do (`--tp-size 2`, `--dp-size 2`, ...) is a clear usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from po_backend.core.errors import DeviceUnavailableError, DrainingError, LoRAError
from po_backend.core.flags import add_arguments, add_fields, given, settings_kwargs
from po_backend.core.fs import UnsafeCacheError
from po_backend.core.settings import parse_bytes, resolve
from po_backend.entrypoints.spawn import die_with_parent
from po_backend.server import LoopService, ServerArgs, create_app

log = logging.getLogger("po_backend.entrypoints.launch_server")

__all__ = ["build_parser", "build_service", "main", "parse_bytes", "prefer_passive_openmp", "server_args"]

API_KEY_ENV = "PREFILLONLY_API_KEY"
ADMIN_KEY_ENV = "PREFILLONLY_ADMIN_KEY"


def build_parser() -> argparse.ArgumentParser:
    """The flags, generated from the declarations: the engine and scheduler settings (and their
    SGLang/vLLM names) from `core.settings.Settings`, the HTTP edge's from `ServerArgs`."""
    ap = argparse.ArgumentParser(
        prog="po-launch-server", description=__doc__.splitlines()[0] if __doc__ else None
    )
    add_arguments(ap)
    add_fields(ap.add_argument_group("HTTP server"), ServerArgs, skip=("engine",))
    return ap


def server_args(a: argparse.Namespace) -> ServerArgs:
    """The command line as `ServerArgs`: the engine settings through `core.settings.resolve`
    (the same mapping and checks as every in-process entry point), the flags not given left to
    the fields' defaults. Raises ValueError for values or combinations that cannot run, TypeError
    never (argparse knows every flag)."""
    engine = resolve(**settings_kwargs(a))
    http = given(a, ServerArgs)
    http["api_key"] = http.get("api_key") or os.environ.get(API_KEY_ENV) or None
    http["admin_api_key"] = http.get("admin_api_key") or os.environ.get(ADMIN_KEY_ENV) or None
    return ServerArgs(engine=engine, **http)


def build_service(args: ServerArgs) -> LoopService:
    """The runtime `args.engine` describes (`serving.engine_runtime.build_runtime`, the one factory) as
    the server's scoring service."""
    from po_backend.serving.engine_runtime import build_runtime

    return LoopService.from_runtime(build_runtime(args.engine))


class ReadDeadlineH11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with a read deadline: a client gets `read_timeout` seconds from
    connecting (or from the first byte of its next request) to deliver the whole request, headers
    and body; a slow or stalled sender is then disconnected instead of holding a connection for
    minutes. Idle keep-alive connections stay under uvicorn's own keep-alive timeout, and a
    request that arrived whole waits as long as its answer takes."""

    read_timeout = 30.0

    def connection_made(self, transport: Any) -> None:
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm()  # the first bytes of a next request on a kept-alive connection
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.read_timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
            log.info("closing a connection that sent no whole request in %.0f s", self.read_timeout)
            self.transport.close()


def uvicorn_config(app: Any, args: ServerArgs) -> uvicorn.Config:
    """How uvicorn serves `app`: every HTTP setting of `args` reaches it here."""
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]  # seconds; a float works
        # Above the default so a burst of ~1000 connects is queued by the kernel, not refused.
        backlog=4096,
        # Connections at once: off by default (idle sockets must not lock clients out); the
        # calls in flight are limited by ConcurrencyLimitMiddleware.
        limit_concurrency=args.limit_concurrency,
        # Past our own deadline (DrainingServer answers what is still queued with 503s): only
        # then would uvicorn cut connections.
        timeout_graceful_shutdown=int(args.shutdown_timeout) + SHUTDOWN_MARGIN_S,
        h11_max_incomplete_event_size=64 * 1024,  # headers larger than this are refused
        http=type("H11Protocol", (ReadDeadlineH11,), {"read_timeout": args.timeout_request_read}),
    )


SHUTDOWN_MARGIN_S = 10  # the step running at the deadline finishes and its answers go out


class DrainingServer(uvicorn.Server):
    """uvicorn's server with a drain that never drops a request: on SIGTERM it stops accepting
    (uvicorn closes the listening socket), new calls on open connections get 503 + Retry-After,
    queued work runs until `--shutdown-timeout`, and whatever is still queued then is answered
    503 + Retry-After before uvicorn's own (later) graceful timeout could cut a connection."""

    def __init__(self, config: uvicorn.Config, runtime: Any, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.shutdown_timeout = shutdown_timeout

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.runtime.draining:
            self.runtime.draining = True
            log.info("draining: %.0f s to finish queued work", self.shutdown_timeout)
            timer = threading.Timer(self.shutdown_timeout, self._deadline)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)

    def _deadline(self) -> None:
        n = self.runtime.service.abandon_waiting(DrainingError("the server is shutting down"))
        if n:
            log.warning("shutdown deadline: %d queued requests answered 503 (Retry-After)", n)


def prefer_passive_openmp() -> None:
    """Idle OpenMP threads sleep instead of spinning, unless the user chose (`OMP_WAIT_POLICY`).
    A server shares its cores with its own HTTP and tokenizer threads, and often with a router or
    a client on the same machine: a thread spinning at a barrier holds a core its partner thread
    waits for. OpenMP reads the policy once, when torch loads it, so this runs before that."""
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def raise_open_files_limit() -> None:
    """The soft limit on open files up to the hard one (as SGLang's set_ulimit): every idle
    connection holds a descriptor, and at a soft limit of 1,024 accept() fails for everyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # a container that refuses: the soft limit stays


def main(argv: Sequence[str] | None = None) -> None:
    t0 = time.monotonic()
    die_with_parent()
    raise_open_files_limit()
    prefer_passive_openmp()
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        args = server_args(a)
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        service = build_service(args)
    except (
        DeviceUnavailableError,
        LoRAError,
        UnsafeCacheError,
    ) as e:  # missing hardware, a bad adapter, a foreign cache
        parser.error(str(e))
    try:
        app = create_app(service, args)
    except ValueError as e:
        service.shutdown()
        parser.error(str(e))
    log.info(
        "ready in %.1f s: serving %s (%s backend) on http://%s:%d",
        time.monotonic() - t0,
        args.model_path,
        args.backend,
        args.host,
        args.port,
    )
    DrainingServer(uvicorn_config(app, args), app.state.runtime, args.shutdown_timeout).run()


if __name__ == "__main__":
    main()
