"""Pure ASGI middleware: API key, body size limit, request metrics. Not BaseHTTPMiddleware, which
would hide client disconnects from the handlers."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from po_backend.server.errors import RETRY_AFTER_S, error_body
from po_backend.server.metrics import Metrics

ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[..., Awaitable[None]]], Awaitable[None]
]


async def _send_json(
    send: Callable[..., Awaitable[None]],
    status: int,
    body: dict[str, Any],
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += extra or []
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (SGLang and the openai client send it this way;
    the scheme is case-insensitive, as HTTP says). Exactly GET (and HEAD) of /health, /ready and
    /metrics stay open for load balancers and scrapers, as in SGLang; /health_generate runs the
    model, so it needs the key. Every other method, OPTIONS included (no CORS is served), needs the
    key before a byte of its body is read. The key is compared in constant time."""

    OPEN = frozenset({"/health", "/ready", "/metrics"})

    def __init__(self, app: ASGIApp, api_key: str, admin_key: str | None = None) -> None:
        self.app = app
        # The admin key (--admin-api-key) may do whatever the data key may, and /flush_cache.
        self.expected = [k.encode() for k in (api_key, admin_key) if k]

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.strip().partition(b" ")
        # Every key compared, so the time taken does not say which one nearly matched.
        ok = [hmac.compare_digest(token.strip(), k) for k in self.expected]
        return scheme.lower() == b"bearer" and any(ok)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["path"] in self.OPEN and scope["method"] in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not self._authorized(auth):
            body = error_body(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                "AuthenticationError",
                scope["path"],
            )
            await _send_json(send, 401, body)
            return
        await self.app(scope, receive, send)


class ConcurrencyLimitMiddleware:
    """503 + Retry-After for a call beyond `max_requests` calls in flight (TEI's
    --max-concurrent-requests). It counts requests, not connections: a client holding idle
    keep-alive sockets takes no slot, and GET /health, /ready and /metrics are never refused, so
    probes see the truth while the server is busy."""

    OPEN = ApiKeyMiddleware.OPEN

    def __init__(self, app: ASGIApp, max_requests: int) -> None:
        self.app = app
        self.max_requests = max_requests
        self.in_flight = 0  # only the event loop's thread touches it

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or (scope["path"] in self.OPEN and scope["method"] in ("GET", "HEAD")):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.max_requests:
            body = error_body(
                503,
                f"{self.in_flight} calls in flight, the limit (--max-concurrent-requests): retry later",
                "ServiceUnavailableError",
                scope["path"],
            )
            await _send_json(send, 503, body, [(b"retry-after", str(RETRY_AFTER_S).encode())])
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`: from Content-Length before any byte is read, else while
    reading. The body is read here, counted, and replayed, so a chunked upload without
    Content-Length is bounded too; later receives pass through untouched, which keeps the
    disconnect notice reaching the handlers. Only requests a route takes a body on (`posts`: POST
    paths) are read: any other is left to the app, which answers 404 / 405 without reading it."""

    def __init__(self, app: ASGIApp, max_bytes: int, posts: frozenset[str]) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.posts = posts

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in self.posts:
            await self.app(scope, receive, send)
            return
        too_large = error_body(
            413,
            f"request body larger than {self.max_bytes} bytes (--max-body-bytes)",
            "PayloadTooLargeError",
            scope["path"],
        )
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_json(send, 413, too_large)
            return
        body = bytearray()
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            if len(body) > self.max_bytes:
                await _send_json(send, 413, too_large)
                return
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class MetricsMiddleware:
    """Request count and latency per endpoint and status."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: set[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.paths else "other"
        status = 500
        t0 = time.perf_counter()

        async def record(msg: dict[str, Any]) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, record)
        finally:
            if path != "/metrics":
                self.metrics.requests.labels(path, str(status)).inc()
                self.metrics.latency.labels(path).observe(time.perf_counter() - t0)
