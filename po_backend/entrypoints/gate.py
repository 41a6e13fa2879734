"""The cluster's public port: a pass-through in front of the SGLang router that checks a key on
every route and forwards the call unchanged otherwise (no routing of its own).

The router answers its informational routes (/v1/models, /get_model_info, /get_server_info,
/engine_metrics, /health_generate, and whatever it adds later) without any key and has no option
to protect them, so `launch_cluster` runs it on a private loopback port behind this. Three keys:

- the data key (clients'): accepted on every route; it is replaced by the worker key on the way
  in, so the router and the workers never see it;
- the admin key: forwarded as it is, for the router's control plane (/workers, /flush_cache),
  which takes that key only;
- the worker key (the launcher's own, never given to clients): what the router accepts on its
  data routes and sends the workers, so a data-key holder can call neither the router's private
  port nor a worker directly (a worker's /flush_cache included).

GET and HEAD of /health, /liveness and /readiness stay open for load balancers, as a single
server's /health and /ready do (SGLang and vLLM leave their liveness probes open too); on a
cluster without a data key every call is let through with the worker key.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from po_backend.server.errors import error_body

log = logging.getLogger("po_backend.entrypoints.gate")

OPEN = frozenset({"/health", "/liveness", "/readiness"})
# Headers of one connection, not of the call (RFC 9110 7.6.1): never forwarded either way.
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
     b"transfer-encoding", b"upgrade", b"host"}
)  # fmt: skip
# What the gate's own HTTP server writes on every answer: the router's copies are dropped, so an
# answer carries one of each.
OWN_HEADERS = frozenset({b"date", b"server"})
NOT_RETURNED = HOP_BY_HOP | OWN_HEADERS

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class Keys:
    data: str | None  # None: a cluster without a data key
    admin: str
    worker: str

    def __post_init__(self) -> None:
        if len({self.data, self.admin, self.worker}) != 3 or not self.admin or not self.worker:
            raise ValueError(
                "the data, admin and worker keys must be set (the data key may be None) and differ"
            )

    def forwarded(self, method: str, path: str, authorization: bytes) -> bytes | None:
        """The Authorization header the router gets for this call, b"" for none; None: refused."""
        if path in OPEN and method in ("GET", "HEAD"):
            return b""
        scheme, _, token = authorization.strip().partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        # Both compared every time, in constant time: the time taken says nothing of either key.
        is_admin = hmac.compare_digest(token, self.admin.encode())
        is_data = self.data is None or hmac.compare_digest(token, self.data.encode())
        if is_admin:
            return b"Bearer " + token
        return b"Bearer " + self.worker.encode() if is_data else None


class Gate:
    """The ASGI app: each call streamed to `upstream` (its body as it arrives, its answer as the
    router sends it), a client that leaves closing the upstream call."""

    def __init__(self, upstream: str, keys: Keys, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.keys = keys
        # No read deadline: a long prefill answers when it is done, as a direct call would.
        self.client = httpx.AsyncClient(
            base_url=upstream,
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(max_connections=None),
            transport=transport,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # no websocket route is served
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers") or [])
        # The path as sent, which the router matches its routes on (not the percent-decoded one).
        url = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        forwarded = self.keys.forwarded(scope["method"], url, dict(headers).get(b"authorization", b""))
        if forwarded is None:
            message = "invalid or missing API key (send 'Authorization: Bearer <key>')"
            await _error(send, 401, message, "AuthenticationError", scope["path"])
            return
        out = [(k, v) for k, v in headers if k.lower() not in HOP_BY_HOP and k.lower() != b"authorization"]
        if forwarded:
            out.append((b"authorization", forwarded))
        has_body = any(k.lower() in (b"content-length", b"transfer-encoding") for k, _ in headers)
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        body_read = anyio.Event()
        if not has_body:
            body_read.set()
        request = self.client.build_request(
            scope["method"], url, headers=out, content=_body(receive, body_read) if has_body else None
        )
        async with anyio.create_task_group() as calls:

            async def until_the_client_leaves() -> None:
                # After the body, the next message is the disconnect: the upstream call is
                # dropped then, which ends the router's (and its worker's) work for it.
                await body_read.wait()
                while (await receive())["type"] != "http.disconnect":
                    pass
                calls.cancel_scope.cancel()

            calls.start_soon(until_the_client_leaves)
            await self._forward(request, scope, send)
            calls.cancel_scope.cancel()

    async def _forward(self, request: httpx.Request, scope: Scope, send: Send) -> None:
        try:
            response = await self.client.send(request, stream=True)
        except (httpx.HTTPError, OSError) as e:
            log.warning("the router did not answer %s %s: %s", scope["method"], scope["path"], e)
            await _error(send, 502, "the router is not answering", "BadGatewayError", scope["path"])
            return
        try:
            kept = [(k, v) for k, v in response.headers.raw if k.lower() not in NOT_RETURNED]
            await send({"type": "http.response.start", "status": response.status_code, "headers": kept})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        except (httpx.HTTPError, OSError) as e:  # the router or the client went away mid-answer
            log.info("an answer was cut: %s", e)
        finally:
            await response.aclose()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


async def _body(receive: Receive, read: anyio.Event) -> AsyncIterator[bytes]:
    """The request body as the client sends it; a client that leaves meanwhile ends the call."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise OSError("the client left while sending its body")
        yield message.get("body", b"")
        if not message.get("more_body", False):
            read.set()
            return


async def _error(send: Send, status: int, message: str, kind: str, path: str) -> None:
    data = json.dumps(error_body(status, message, kind, path)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
