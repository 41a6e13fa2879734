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

Calls sglang-router 0.3.2 cannot take as the clients send them are read whole (within the
workers' --max-body-bytes) and translated, their limits checked before any is forwarded:

- a batched `/generate` with `text` a list (what `sgl.select` sends; the router's typed body
  takes one string): one routed call per prompt, at most `Limits.fan_out` at a time, answered as
  one server answers the batch (the list in order, or its stream), or with the first failing
  prompt's answer, as one server fails the whole batch;
- `/v2/rerank` and `/rerank` (Cohere's and vLLM/Jina's shape; the router 404s the one and
  answers the other in SGLang's), and `/v1/rerank` from Cohere's v1 client (its SDK header, as
  one server tells it): the router's `/v1/rerank`, its answer rebuilt in Cohere's shape;
- `/v1/classify` without `model` (the router requires it): the served model's name filled in;
- `/v1/score` and `/generative_scoring` (the router has neither route): built as SGLang's own
  /v1/score is, on its /generate: each item's prompt (query + item, text or token ids) asks the
  label tokens' log-probs of the next token (`token_ids_logprob`, `max_new_tokens` 0), and the
  scores are made from those as one server makes them. Text items go one routed call each (the
  query their shared prefix, which cache_aware follows), token-id items as one batched call
  (one call each when their label tokens differ: the router takes one list for a batch).

GET and HEAD of /health, /liveness and /readiness stay open for load balancers, as a single
server's /health and /ready do (SGLang and vLLM leave their liveness probes open too); on a
cluster without a data key every call is let through with the worker key.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import anyio
import httpx

from po_backend.server.args import ServerArgs
from po_backend.server.errors import (
    HTTPError,
    bad,
    check_items,
    check_logprobs,
    check_tokenize,
    error_body,
    validated,
)
from po_backend.server.middleware import BodyLimitMiddleware
from po_backend.server.protocol import ScoreRequestBody
from po_backend.server.rerank import (
    SDK_HEADER,
    CohereRerankBody,
    Ranked,
    cohere_answer,
    document_text,
    from_cohere_sdk,
)
from po_backend.server.scoring import (
    GenerativeScoringBody,
    checked_generative,
    checked_score,
    generative_answer,
    score_answer,
)
from po_backend.server.sglang_native import split_batch

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

# Calls read whole and translated (see the module's docstring).
SCORING = frozenset({"/v1/score", "/generative_scoring"})
READ_WHOLE = frozenset({"/generate", "/v1/classify", "/rerank", "/v2/rerank"}) | SCORING
FORWARDED = "po_gate.forwarded"  # the scope key carrying a read-whole call's URL and headers

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


@dataclass(frozen=True)
class Limits:
    """What the workers serve and take: the gate checks a translated call against these before it
    forwards any of it (the workers' --max-body-bytes, --max-items-per-request, served name,
    --max-logprobs-per-request and --max-tokenize-chars)."""

    max_body_bytes: int = ServerArgs.max_body_bytes
    max_items: int = ServerArgs.max_items_per_request
    model_name: str = ""
    fan_out: int = 16  # a batch's prompts in flight at a time
    max_logprobs: int = ServerArgs.max_logprobs_per_request
    max_tokenize_chars: int = ServerArgs.max_tokenize_chars

    def check_items(self, n: int, what: str) -> None:
        check_items(n, what, self.max_items)

    def check_logprobs(self, n: int) -> None:
        check_logprobs(n, self.max_logprobs)

    def check_tokenize(self, chars: int, what: str) -> None:
        check_tokenize(chars, what, self.max_tokenize_chars)


class Gate:
    """The ASGI app: each call streamed to `upstream` (its body as it arrives, its answer as the
    router sends it), a client that leaves closing the upstream call."""

    def __init__(
        self,
        upstream: str,
        keys: Keys,
        transport: httpx.AsyncBaseTransport | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.keys, self.limits = keys, limits or Limits()
        self.read_whole = BodyLimitMiddleware(
            self._read_whole, self.limits.max_body_bytes, READ_WHOLE | {"/v1/rerank"}
        )
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
        cohere_v1 = scope["path"] == "/v1/rerank" and from_cohere_sdk(dict(headers).get(SDK_HEADER.encode()))
        if scope["method"] == "POST" and (scope["path"] in READ_WHOLE or cohere_v1):
            # httpx sets the length of what it sends.
            out = [(k, v) for k, v in out if k.lower() != b"content-length"]
            await self.read_whole({**scope, FORWARDED: (url, out)}, receive, send)
            return
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

    async def _read_whole(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A translated call, its body read (and bounded) by `BodyLimitMiddleware`; the client
        leaving ends its upstream calls."""
        message = await receive()
        raw = message.get("body", b"") if message["type"] == "http.request" else None
        if raw is None:
            return
        async with anyio.create_task_group() as calls:

            async def until_the_client_leaves() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                calls.cancel_scope.cancel()

            calls.start_soon(until_the_client_leaves)
            try:
                await self._translate(scope, send, raw)
            except HTTPError as e:
                await _error(send, e.status, e.message, e.kind, scope["path"])
            calls.cancel_scope.cancel()

    async def _translate(self, scope: Scope, send: Send, raw: bytes) -> None:
        url, headers = scope[FORWARDED]
        path = scope["path"]
        try:
            data = await anyio.to_thread.run_sync(json.loads, raw)
        except ValueError:  # not JSON (UnicodeDecodeError included): the router's own answer
            data = None
        body = data if isinstance(data, dict) else None
        if path in ("/rerank", "/v2/rerank", "/v1/rerank"):  # the last from Cohere's v1 client only
            await self._cohere_rerank(send, path, headers, body)
            return
        if path == "/generate" and body is not None and isinstance(body.get("text"), list):
            await self._fan_out(send, headers, body)
            return
        if path in SCORING:
            await self._score(send, path, headers, body)
            return
        if path == "/v1/classify" and body is not None and body.get("model") is None:
            raw = json.dumps({**body, "model": self.limits.model_name}).encode()
        request = self.client.build_request("POST", url, headers=headers, content=raw)
        await self._forward(request, scope, send)

    async def _fan_out(self, send: Send, headers: list[tuple[bytes, bytes]], body: dict[str, Any]) -> None:
        """A batched /generate as one routed call per prompt (the router routes each by its text),
        answered as one server answers the batch."""
        n = len(body["text"])
        if n == 0:
            raise bad("the batch is empty")
        self.limits.check_items(n, "prompts")
        out = await self._generate_each(send, headers, split_batch(body, n), "/generate")
        if out is None:
            return
        if body.get("stream"):  # a single server's stream of a batch: one event per prompt
            events = b"".join(
                b"data: " + json.dumps({**o, "index": i}).encode() + b"\n\n" for i, o in enumerate(out)
            )
            await _send(send, 200, events + b"data: [DONE]\n\n", b"text/event-stream")
        else:
            await _send(send, 200, json.dumps(out).encode())

    async def _generate_each(
        self, send: Send, headers: list[tuple[bytes, bytes]], bodies: list[dict[str, Any]], path: str
    ) -> list[Any] | None:
        """Each body as one routed /generate call, at most `Limits.fan_out` in flight, their JSON
        answers in order; None once the earliest failing call's answer was sent as the answer to
        the client's call on `path` (a single server fails a whole batch on any prompt)."""
        answers: list[httpx.Response | BaseException | None] = [None] * len(bodies)
        in_flight = anyio.Semaphore(self.limits.fan_out)

        async def one(i: int) -> None:
            async with in_flight:
                try:
                    answers[i] = await self.client.post(
                        "/generate", headers=headers, json={**bodies[i], "stream": False}
                    )
                except (httpx.HTTPError, OSError) as e:
                    answers[i] = e

        async with anyio.create_task_group() as calls:
            for i in range(len(bodies)):
                calls.start_soon(one, i)
        for answer in answers:
            if not isinstance(answer, httpx.Response):
                log.warning("the router did not answer a call's prompt: %s", answer)
                await _error(send, 502, "the router is not answering", "BadGatewayError", path)
                return None
            if not answer.is_success:
                await _send_answer(send, answer, path if path in SCORING else "")
                return None
        try:
            return [a.json() for a in answers if isinstance(a, httpx.Response)]
        except ValueError:
            raise HTTPError(502, "the router answered a prompt with no JSON", "BadGatewayError") from None

    async def _score(
        self, send: Send, path: str, headers: list[tuple[bytes, bytes]], data: dict[str, Any] | None
    ) -> None:
        """SGLang's /v1/score or vLLM's /generative_scoring through the workers' /generate, checked
        as one server checks it (what needs no model) before any call goes out."""
        if data is None:
            raise bad("the body must be a JSON object")
        limits = self.limits
        score_body: ScoreRequestBody | None = None
        items: list[Any]
        query: Any
        if path == "/v1/score":
            score_body = validated(ScoreRequestBody, data)
            items, labels, query = checked_score(score_body, limits)
            item_first, priority = score_body.item_first, score_body.priority
        else:
            vllm_body = validated(GenerativeScoringBody, data)
            items = list(vllm_body.items)
            labels = [checked_generative(vllm_body, limits)] * len(items)
            query, item_first, priority = vllm_body.query, vllm_body.item_first, vllm_body.priority
            if isinstance(query, str) or any(isinstance(x, str) for x in items):
                # vLLM joins the query's and the item's tokens, which takes the workers' tokenizer.
                raise bad(
                    "through the cluster, /generative_scoring takes the query and the items as token ids "
                    "(/v1/score takes text), or send the call to a worker"
                )
        common: dict[str, Any] = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
        if priority is not None:
            common["priority"] = priority
        # What picks a LoRA adapter on a worker (`lora_path`, or an adapter's name as `model`).
        common |= {k: data[k] for k in ("lora_path", "model") if data.get(k) is not None}
        if isinstance(query, str):  # one routed call per item: the router takes one text a call
            prompts = [it + query if item_first else query + it for it in cast(list[str], items)]
            bodies = [
                {**common, "text": p, "token_ids_logprob": list(ls)}
                for p, ls in zip(prompts, labels, strict=True)
            ]
        else:
            ids = [list(it) + list(query) if item_first else list(query) + list(it) for it in items]
            if len(set(labels)) == 1:  # one call: the router takes a batch of token ids...
                bodies = [{**common, "input_ids": ids, "token_ids_logprob": list(labels[0])}]
            else:  # ...with one list of label tokens for all (its typed body): one call each
                bodies = [
                    {**common, "input_ids": p, "token_ids_logprob": list(ls)}
                    for p, ls in zip(ids, labels, strict=True)
                ]
        out = await self._generate_each(send, headers, bodies, path)
        if out is None:
            return
        answers = [a for o in out for a in (o if isinstance(o, list) else [o])]
        try:
            logprobs = [_label_logprobs(a, ls) for a, ls in zip(answers, labels, strict=True)]
            tokens = sum(int(a["meta_info"]["prompt_tokens"]) for a in answers)
        except (ValueError, KeyError, TypeError, IndexError) as e:
            raise HTTPError(
                502, f"a worker's /generate answer is not SGLang's: {e!r}", "BadGatewayError"
            ) from None
        if score_body is not None:
            answer = score_answer(score_body, logprobs, tokens, limits.model_name)
        else:
            answer = generative_answer(vllm_body, logprobs, tokens, limits.model_name)
        await _send(send, 200, json.dumps(answer).encode())

    async def _cohere_rerank(
        self, send: Send, path: str, headers: list[tuple[bytes, bytes]], data: dict[str, Any] | None
    ) -> None:
        """Cohere's and vLLM/Jina's rerank through the router's /v1/rerank, answered as one server
        answers them. The router forwards only the query and the documents, so the fields it would
        drop are refused rather than ignored (`top_n` is applied here)."""
        if data is None:
            raise bad("the body must be a JSON object")
        body = validated(CohereRerankBody, data)
        self.limits.check_items(len(body.documents), "documents")
        for name in ("max_tokens_per_doc", "instruct"):
            if getattr(body, name) is not None:
                raise bad(f"{name} is not supported through the cluster (its router does not forward it)")
        docs = [document_text(d) for d in body.documents]
        sent = {"query": body.query, "documents": docs, "return_documents": False}
        try:
            answer = await self.client.post("/v1/rerank", headers=headers, json=sent)
        except (httpx.HTTPError, OSError) as e:
            log.warning("the router did not answer a rerank: %s", e)
            raise HTTPError(502, "the router is not answering", "BadGatewayError") from None
        if not answer.is_success:
            await _send_answer(send, answer)
            return
        try:
            ranked = sorted(
                (Ranked(r["index"], r["score"], r["meta_info"]["prompt_tokens"], r["meta_info"]["cached_tokens"])
                 for r in answer.json()["results"]),
                key=lambda r: r.index,
            )  # fmt: skip
        except (ValueError, KeyError, TypeError) as e:
            raise HTTPError(
                502, f"the router's rerank answer is not SGLang's: {e!r}", "BadGatewayError"
            ) from None
        await _send(send, 200, json.dumps(cohere_answer(body, docs, ranked, self.limits.model_name)).encode())

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _label_logprobs(answer: dict[str, Any], labels: tuple[int, ...]) -> list[float]:
    """The label tokens' next-token log-probs in a /generate answer, in the labels' order."""
    [row] = answer["meta_info"]["output_token_ids_logprobs"]
    by_id = {int(t): (float("-inf") if v is None else float(v)) for v, t, *_ in row}
    return [by_id[t] for t in labels]


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
    await _send(send, status, json.dumps(error_body(status, message, kind, path)).encode())


async def _send(
    send: Send,
    status: int,
    data: bytes,
    content_type: bytes = b"application/json",
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(data)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


async def _send_answer(send: Send, answer: httpx.Response, path: str = "") -> None:
    """An upstream answer read whole, passed on as it came (its own headers excepted); a
    worker's error on a route of another shape than `path`'s (a /generate error answering a
    /v1/score call) in `path`'s shape, its Retry-After kept."""
    if path and not answer.is_success:
        try:
            error = answer.json()
            error = error.get("error", error)
            message, kind = str(error["message"]), str(error.get("type") or "BadRequestError")
        except (ValueError, KeyError, TypeError, AttributeError):  # not a worker's error: as it came
            pass
        else:
            retry = answer.headers.get("retry-after")
            extra = [(b"retry-after", retry.encode("latin-1"))] if retry else []
            body = json.dumps(error_body(answer.status_code, message, kind, path)).encode()
            await _send(send, answer.status_code, body, extra=extra)
            return
    headers = [(k, v) for k, v in answer.headers.raw if k.lower() not in NOT_RETURNED | {b"content-length",
               b"content-encoding"}]  # fmt: skip
    headers.append((b"content-length", str(len(answer.content)).encode()))
    await send({"type": "http.response.start", "status": answer.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": answer.content})
