"""HTTP server: SGLang's native API, OpenAI completions, our `/v1/classify`, Prometheus metrics.

Every endpoint turns its body into `ScoreRequest`s, submits them to the scheduling loop (which
validates them and owns the engine), awaits the futures and formats the results in the shape its
clients expect. The event loop never runs model code; a client that disconnects cancels its
requests. `create_app` takes any `Backend`, so `--backend hf` (the transformers baseline) serves
the same API.

Shapes follow SGLang 0.5.23 (`/generate` meta_info, `/v1/score`) and OpenAI (`/v1/completions`);
errors are `{"error": {"message", "type", "param", "code"}}` (what the openai client parses).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from po_backend.engine import ScoreRequest, ScoreResult
from po_backend.errors import EmptyPromptError, InvalidRequestError, OverloadedError, PrefillOnlyError
from po_backend.protocol import (
    ChatTemplateRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    SamplingParams,
    ScoreRequestBody,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

VERSION = "prefillonly-0.1.0"
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; SGLang and vLLM clamp to this value too
MAX_OPENAI_LOGPROBS = 20
ASGIApp = Callable[
    [dict[str, Any], Callable[[], Awaitable[dict[str, Any]]], Callable[..., Awaitable[None]]], Awaitable[None]
]


# ---- what the server needs from a model ---------------------------------------------------------


class Backend(Protocol):
    """A tokenizer plus a scheduling loop that scores `ScoreRequest`s off the event loop."""

    tokenizer: Any
    vocab_size: int
    max_input_len: int

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        """Validate all (typed errors, nothing queued on error) and queue them together; raises
        OverloadedError when the queue cannot take them."""
        ...

    def cancel(self, fut: Future[ScoreResult]) -> None: ...

    def stats(self) -> dict[str, Any]: ...

    def flush_cache(self) -> None: ...

    def shutdown(self) -> None: ...


class LoopBackend:
    """A `Backend` from a scorer (the Engine or the transformers baseline: tokenizer, vocabulary)
    and the scheduling loop that owns it (queue, futures, cancellation, stats)."""

    def __init__(self, scorer: Any, loop: Any, max_input_len: int) -> None:
        self.scorer = scorer
        self.loop = loop
        self.tokenizer = scorer.tokenizer
        self.vocab_size = int(scorer.vocab_size)
        self.max_input_len = int(max_input_len)

    def submit_many(self, reqs: Sequence[ScoreRequest]) -> list[Future[ScoreResult]]:
        return self.loop.submit_many(reqs)

    def cancel(self, fut: Future[ScoreResult]) -> None:
        self.loop.cancel(fut)

    def stats(self) -> dict[str, Any]:
        return _jsonable(self.loop.stats())

    def flush_cache(self) -> None:
        # The loop owns the engine: the flush must happen between its steps, on its thread.
        self.loop.flush_cache()

    def shutdown(self) -> None:
        self.loop.shutdown(drain=True)


@dataclass(frozen=True)
class ServerArgs:
    """What /model_info and /server_info report, plus the HTTP edge's own limits."""

    model_path: str
    served_model_name: str = ""
    backend: str = "prefillonly"
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_body_bytes: int = 64 << 20
    model_type: str = ""
    architectures: tuple[str, ...] = ()
    engine_args: dict[str, Any] = field(default_factory=dict)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


# ---- errors -------------------------------------------------------------------------------------


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class ClientGone(Exception):
    """The client disconnected while its requests were queued or running."""


def bad(message: str) -> HTTPError:
    return HTTPError(400, message)


def error_body(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"object": "error", "error": {"message": message, "type": kind, "param": None, "code": status}}


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, kind), status_code=status)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "null"}


def _field_path(loc: Sequence[Any]) -> str:
    """'sampling_params.bogus' from pydantic's loc, without the union-member tags it inserts
    ('SamplingParams', 'list[int]', ...): our field names are lower snake case, tags are not."""
    keep = [
        str(x)
        for x in loc
        if x != "body"
        and (isinstance(x, int) or (re.fullmatch(r"[a-z_][a-z0-9_]*", x) and x not in _TYPE_TAGS))
    ]
    return ".".join(keep)


def _validation_message(exc: RequestValidationError) -> str:
    errors = list(exc.errors())
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}"
    # An unknown key is the real problem even when a union's other members also complain.
    extra = [e for e in errors if e.get("type") == "extra_forbidden"]
    parts = [f"unknown field {_field_path(e.get('loc', ()))!r}" for e in extra]
    if not parts:
        parts = [f"{_field_path(e.get('loc', ())) or 'body'}: {e.get('msg')}" for e in errors]
    return "invalid request: " + "; ".join(list(dict.fromkeys(parts))[:5])


# ---- pure ASGI middleware (no BaseHTTPMiddleware: it would hide client disconnects) ---------------


async def _send_json(send: Callable[..., Awaitable[None]], status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class ApiKeyMiddleware:
    """401 unless `Authorization: Bearer <key>` (SGLang and the openai client send it this way).
    /health and /metrics stay open for load balancers and scrapers, as in SGLang."""

    OPEN = ("/health", "/metrics")

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.OPEN) or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        if auth != self.expected:
            body = error_body(
                401, "invalid or missing API key (send 'Authorization: Bearer <key>')", "AuthenticationError"
            )
            await _send_json(send, 401, body)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for bodies over `max_bytes`. The body is read here, counted, and replayed, so a chunked
    upload without Content-Length is bounded too; later receives pass through untouched, which
    keeps the disconnect notice reaching the handlers."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = error_body(
            413, f"request body larger than {self.max_bytes} bytes", "PayloadTooLargeError"
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


# ---- metrics ------------------------------------------------------------------------------------


class Metrics:
    """Prometheus metrics in a registry of this app's own (two apps in one process do not clash)."""

    WINDOW_S = 10.0  # tokens/s is measured over this sliding window

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        r = self.registry = CollectorRegistry()
        self.requests = Counter("po_http_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram(
            "po_request_latency_seconds",
            "HTTP request latency (arrival to response)",
            ["endpoint"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.prompts = Counter("po_scored_prompts", "Prompts scored (one prefill each)", registry=r)
        self.prompt_tokens = Counter("po_prompt_tokens", "Prompt tokens of scored prompts", registry=r)
        self.cached_tokens = Counter(
            "po_cache_hit_tokens", "Prompt tokens read from the prefix cache instead of computed", registry=r
        )
        self.cancelled = Counter(
            "po_cancelled_requests", "Prompts cancelled by a client disconnect", registry=r
        )
        self.rejected = Counter(
            "po_overloaded_rejections", "Prompts refused with 503 (queue full)", registry=r
        )
        Gauge("po_queue_length", "Prompts waiting in the scheduler queue", registry=r).set_function(
            lambda: float(self._stat("queued"))
        )
        Gauge("po_running_requests", "Prompts in the forward being run", registry=r).set_function(
            lambda: float(self._stat("running"))
        )
        Gauge(
            "po_prompt_tokens_per_second",
            f"Prompt tokens scored per second (last {self.WINDOW_S:.0f} s)",
            registry=r,
        ).set_function(self.tokens_per_second)
        Gauge(
            "po_cache_hit_rate", "Share of prompt tokens served from the prefix cache", registry=r
        ).set_function(self._hit_rate)
        self._lock = threading.Lock()
        self._window: deque[tuple[float, int]] = deque()  # (time, prompt tokens finished then)
        self._tokens = 0
        self._cached = 0

    def _stat(self, key: str) -> float:
        try:
            return float(self.backend.stats().get(key, 0) or 0)
        except Exception:  # a scrape must not fail because a stat is missing
            return 0.0

    def observe(self, results: Sequence[ScoreResult]) -> None:
        now = time.monotonic()
        tokens = sum(r.prompt_tokens for r in results)
        cached = sum(r.cached_tokens for r in results)
        self.prompts.inc(len(results))
        self.prompt_tokens.inc(tokens)
        self.cached_tokens.inc(cached)
        with self._lock:
            self._tokens += tokens
            self._cached += cached
            self._window.append((now, tokens))
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - self.WINDOW_S:
            self._window.popleft()

    def tokens_per_second(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(t for _, t in self._window) / self.WINDOW_S

    def _hit_rate(self) -> float:
        with self._lock:
            return self._cached / self._tokens if self._tokens else 0.0


# ---- small helpers ------------------------------------------------------------------------------


def _lp(x: float | None) -> float | None:
    """A log-prob as JSON can carry it: NaN -> null, -inf -> the floor."""
    if x is None or math.isnan(x):
        return None
    return max(float(x), LOGPROB_FLOOR)


def _per_item(value: Any, n: int, name: str, default: Any) -> list[Any]:
    """SGLang batch fields: one value for all items or a list with one per item."""
    if value is None:
        return [default] * n
    if isinstance(value, list):
        if len(value) != n:
            raise bad(f"{name} has {len(value)} values for a batch of {n} prompts")
        return [default if v is None else v for v in value]
    return [value] * n


def _unique(ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))


def _parse_bias(bias: dict[str, float] | None, vocab_size: int, where: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            tid = int(key)
        except ValueError:
            raise bad(f"{where} keys must be token ids, got {key!r}") from None
        if not 0 <= tid < vocab_size:
            raise bad(f"{where} token id {tid} is outside the vocabulary [0, {vocab_size})")
        if not math.isfinite(value) or not -100 <= value <= 100:
            raise bad(f"{where} values must be in [-100, 100], got {value} for token {tid}")
        out[tid] = float(value)
    return out


def biased_top(
    result: ScoreResult, labels: Sequence[int], bias: dict[int, float], k: int
) -> list[tuple[int, float]]:
    """The exact top-k of softmax(logits + bias), from the raw top list and the biased tokens'
    own log-probs (both in `result`): with Z = sum_v p_v e^{b_v} = 1 - sum_b p_b + sum_b p_b e^{b},
    every log-prob shifts by -log Z and the biased ones also by +b. Needs `result.top_logprobs` to
    hold at least k tokens beyond the biased ones."""
    if not bias:
        return list(result.top_logprobs[:k])
    lp = dict(zip(labels, result.logprobs, strict=True))
    p_biased = math.fsum(math.exp(lp[t]) for t in bias)
    terms = [lp[t] + b for t, b in bias.items()]
    rest = 1.0 - p_biased
    if rest > 1e-12:
        terms.append(math.log(rest))
    m = max(terms)
    log_z = m + math.log(math.fsum(math.exp(t - m) for t in terms))
    cand = {t: lp[t] + b - log_z for t, b in bias.items()}
    for t, v in result.top_logprobs:
        if t not in bias:
            cand[t] = v - log_z
    return sorted(cand.items(), key=lambda kv: -kv[1])[:k]


# ---- the app ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _GenItem:
    """One prompt of a /generate call, parsed."""

    ids: tuple[int, ...]
    max_new_tokens: int
    return_logprob: bool
    logprob_start_len: int  # SGLang's: the first position whose log-prob is returned
    top_logprobs_num: int
    token_ids_logprob: tuple[int, ...] | None
    bias: dict[int, float]
    skip_special_tokens: bool
    with_text: bool  # return_text_in_logprobs
    rid: str
    request: ScoreRequest


class Server:
    """Endpoint logic over one backend; `create_app` wires it into FastAPI."""

    def __init__(self, backend: Backend, args: ServerArgs) -> None:
        self.backend = backend
        self.args = args
        self.metrics = Metrics(backend)
        self._token_text: dict[int, str] = {}

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        if self.backend.tokenizer is None:
            raise bad("this model has no tokenizer: send input_ids instead of text")
        return self.backend.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        """A prompt's ids; empty text is an empty prompt even though the tokenizer would give it
        a BOS (scoring the distribution after BOS alone is never what was meant)."""
        if not text:
            raise EmptyPromptError("the prompt is empty (empty text)")
        return self.encode(text)

    def token_text(self, tid: int) -> str | None:
        """One token decoded on its own (SGLang's `return_text_in_logprobs`), memoised."""
        if self.backend.tokenizer is None:
            return None
        text = self._token_text.get(tid)
        if text is None:
            text = self._token_text[tid] = self.backend.tokenizer.decode([tid])
        return text

    def entry(self, lp: float | None, tid: int, with_text: bool) -> list[Any]:
        return [_lp(lp), tid, self.token_text(tid) if with_text else None]

    # ---- running requests -----------------------------------------------------------------------

    async def run(self, request: Request, reqs: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Submit together (one multi-item batch for the scheduler) and await, cancelling all if
        the client disconnects first."""
        if not reqs:
            return []
        try:
            # Validation and a queue push: fast and thread-safe, fine on the event loop.
            futs = self.backend.submit_many(reqs)
        except OverloadedError:
            self.metrics.rejected.inc(len(reqs))
            raise
        waiters = asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({waiters, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if waiters in done:
                results = waiters.result()
                self.metrics.observe(results)
                return results
            raise ClientGone()
        finally:
            watcher.cancel()
            if not waiters.done():
                waiters.cancel()
                # Nobody awaits it any more: take its outcome so asyncio does not log it.
                waiters.add_done_callback(_discard_outcome)
                unfinished = [f for f in futs if not f.done()]
                for f in unfinished:
                    self.backend.cancel(f)
                self.metrics.cancelled.inc(len(unfinished))

    # ---- /generate ------------------------------------------------------------------------------

    def parse_generate(self, body: GenerateRequest) -> tuple[list[_GenItem], bool]:
        for name in ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "lora_id",
                     "custom_logit_processor", "session_params"):  # fmt: skip
            if getattr(body, name) is not None:
                raise bad(f"{name} is not supported by the prefill-only server")
        if (body.text is None) == (body.input_ids is None):
            raise bad("send exactly one of text and input_ids")
        if body.text is not None:
            single = isinstance(body.text, str)
            texts = [body.text] if single else list(body.text)
            prompts = [self.encode_prompt(t) for t in texts]
        else:
            ids = body.input_ids or []
            single = not ids or not isinstance(ids[0], list)
            prompts = [tuple(ids)] if single else [tuple(x) for x in ids]  # type: ignore[arg-type]
        n = len(prompts)
        if n == 0:
            raise bad("the batch is empty")
        if any(
            body.return_hidden_states
            if isinstance(body.return_hidden_states, list)
            else [body.return_hidden_states]
        ):
            raise bad("return_hidden_states is not supported by the prefill-only server")
        sps = _per_item(body.sampling_params, n, "sampling_params", SamplingParams())
        ret = _per_item(body.return_logprob, n, "return_logprob", False)
        starts = _per_item(body.logprob_start_len, n, "logprob_start_len", -1)
        tops = _per_item(body.top_logprobs_num, n, "top_logprobs_num", 0)
        tid = body.token_ids_logprob
        if tid is not None and tid and isinstance(tid[0], list):
            id_lists = _per_item(tid, n, "token_ids_logprob", None)
        else:
            id_lists = [tid] * n
        prefix = _per_item(body.cache_prefix_len, n, "cache_prefix_len", None)
        rids = _per_item(body.rid, n, "rid", None)
        items = []
        for i in range(n):
            sp: SamplingParams = sps[i]
            mnt = 1 if sp.max_new_tokens is None else sp.max_new_tokens
            if mnt not in (0, 1):
                raise bad(
                    f"max_new_tokens must be 0 or 1 on this prefill-only server (it scores the next "
                    f"token and never decodes), got {mnt}"
                )
            self._check_sampling(sp, mnt)
            if tops[i] < 0:
                raise bad(f"top_logprobs_num must be >= 0, got {tops[i]}")
            start = starts[i]
            if ret[i] and not -1 <= start < max(len(prompts[i]), 1):
                raise bad(
                    f"logprob_start_len must be in [-1, {len(prompts[i]) - 1}] for a {len(prompts[i])}-token prompt, got {start}"
                )
            ids_lp = tuple(id_lists[i]) if id_lists[i] is not None else None
            bias = _parse_bias(sp.logit_bias, self.backend.vocab_size, "logit_bias")
            top_k = int(tops[i]) if ret[i] else 0
            if mnt == 1:
                top_k = max(top_k, 1 + len(bias))  # enough unbiased candidates for the argmax
            # The engine returns log-probs of the positions after its start; SGLang's list
            # begins at the start position itself.
            engine_start = max(start - 1, 0) if ret[i] and start >= 0 else -1
            request = ScoreRequest(
                prompts[i],
                _unique((ids_lp or ()) + tuple(bias)),
                top_k=top_k,
                logprob_start_len=engine_start,
                cache_prefix_len=prefix[i],
            )
            items.append(
                _GenItem(
                    ids=prompts[i],
                    max_new_tokens=mnt,
                    return_logprob=bool(ret[i]),
                    logprob_start_len=start,
                    top_logprobs_num=int(tops[i]),
                    token_ids_logprob=ids_lp,
                    bias=bias,
                    skip_special_tokens=sp.skip_special_tokens is not False,
                    with_text=body.return_text_in_logprobs,
                    rid=rids[i] or uuid.uuid4().hex,
                    request=request,
                )
            )
        return items, single

    @staticmethod
    def _check_sampling(sp: SamplingParams, max_new_tokens: int) -> None:
        for name in ("regex", "json_schema", "ebnf", "structural_tag"):
            if getattr(sp, name) is not None:
                raise bad(
                    f"sampling_params.{name}: constrained decoding is not supported by the prefill-only server"
                )
        if sp.n not in (None, 1):
            raise bad(f"sampling_params.n must be 1 on the prefill-only server, got {sp.n}")
        if sp.beam_width not in (None, 0, 1):
            raise bad("sampling_params.beam_width: beam search is not supported by the prefill-only server")
        if (sp.min_new_tokens or 0) > max_new_tokens:
            raise bad(f"min_new_tokens={sp.min_new_tokens} exceeds max_new_tokens={max_new_tokens}")

    def format_generate(self, it: _GenItem, res: ScoreResult, latency: float) -> dict[str, Any]:
        with_text = it.with_text
        out_ids: list[int] = []
        text = ""
        finish: dict[str, Any] = {"type": "length", "length": it.max_new_tokens}
        req = it.request
        if it.max_new_tokens == 1:
            (tok, _), *_ = biased_top(res, req.label_token_ids, it.bias, 1)
            out_ids = [tok]
            text = (
                self.tokenizer.decode([tok], skip_special_tokens=it.skip_special_tokens)
                if self.backend.tokenizer is not None
                else ""
            )
            eos = getattr(self.backend.tokenizer, "eos_token_id", None)
            if tok == eos:
                finish = {"type": "stop", "matched": tok}
        meta: dict[str, Any] = {
            "id": it.rid,
            "finish_reason": finish,
            "prompt_tokens": res.prompt_tokens,
            "completion_tokens": len(out_ids),
            "cached_tokens": res.cached_tokens,
            "e2e_latency": latency,
        }
        if it.return_logprob:
            lp = dict(zip(req.label_token_ids, res.logprobs, strict=True))
            lp.update(res.top_logprobs)
            inputs: list[list[Any]] = []
            if it.logprob_start_len >= 0:
                start = it.logprob_start_len
                values: list[float | None] = list(res.input_token_logprobs)
                if start == 0:
                    values = [None, *values]  # the first prompt token has no log-prob
                inputs = [self.entry(v, t, with_text) for v, t in zip(values, it.ids[start:], strict=True)]
            meta["input_token_logprobs"] = inputs
            # Not computed by the engine (it scores the prompt's own tokens only).
            meta["input_top_logprobs"] = [None] * len(inputs) if it.top_logprobs_num else []
            meta["input_token_ids_logprobs"] = [None] * len(inputs) if it.token_ids_logprob else []
            meta["output_token_logprobs"] = [self.entry(lp.get(t), t, with_text) for t in out_ids]
            top_row = [self.entry(v, t, with_text) for t, v in res.top_logprobs[: it.top_logprobs_num]]
            meta["output_top_logprobs"] = [top_row] if it.top_logprobs_num else []
            ids_row = [self.entry(lp[t], t, with_text) for t in it.token_ids_logprob or ()]
            # One row, the next-token distribution, also with max_new_tokens=0 (SGLang's /v1/score
            # reads it that way).
            meta["output_token_ids_logprobs"] = [ids_row] if it.token_ids_logprob is not None else []
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    # ---- /v1/score ------------------------------------------------------------------------------

    def parse_score(self, body: ScoreRequestBody) -> list[ScoreRequest]:
        if (
            body.query_embed_overrides is not None
            or body.item_embed_overrides is not None
            or body.embed_override_token_id is not None
        ):
            raise bad("embedding overrides are not supported by the prefill-only server")
        if body.return_pooled_hidden_states:
            raise bad("return_pooled_hidden_states is not supported for causal LM scoring")
        if body.score_extraction_token is not None:
            raise bad("score_extraction_token is not supported by the prefill-only server")
        if not math.isfinite(body.temperature) or body.temperature <= 0:
            raise bad("temperature must be finite and greater than zero")
        if body.temperature != 1.0 and not body.apply_softmax:
            raise bad("temperature requires apply_softmax=True")
        if body.label_token_ids is None or not body.label_token_ids:
            raise bad("label_token_ids must be a nonempty list")
        if body.items is None:
            raise bad("items must be provided")
        items = [body.items] if isinstance(body.items, str) else list(body.items)
        if isinstance(body.label_token_ids[0], list):
            if len(body.label_token_ids) != len(items):
                raise bad("label_token_ids must have one list per item")
            labels = [tuple(x) for x in body.label_token_ids]  # type: ignore[arg-type]
        else:
            labels = [tuple(body.label_token_ids)] * len(items)  # type: ignore[arg-type]
        for ls in labels:
            if not ls:
                raise bad("each item must have a nonempty label_token_ids list")
            if len(set(ls)) != len(ls):
                raise bad("label_token_ids must not contain duplicate tokens")
        query = body.query
        if query is None:
            query = [] if items and isinstance(items[0], list) else ""
        reqs: list[ScoreRequest] = []
        if isinstance(query, str):
            if items and not all(isinstance(x, str) for x in items):
                raise bad("a text query needs text items")
            prefix_ids = self.encode(query) if not body.item_first else None
            for item, ls in zip(items, labels, strict=True):
                text = f"{item}{query}" if body.item_first else f"{query}{item}"
                ids = self.encode_prompt(text)
                # The shared part's tokens (the query, or the item with item_first) are the cache
                # prefix; a BPE merge across the join can only shorten it.
                shared = prefix_ids if prefix_ids is not None else self.encode(item)  # type: ignore[arg-type]
                reqs.append(ScoreRequest(ids, ls, cache_prefix_len=_common_prefix(shared, ids)))
        else:
            if items and not all(isinstance(x, list) for x in items):
                raise bad("a token-id query needs token-id items")
            for item, ls in zip(items, labels, strict=True):
                ids = tuple(item) + tuple(query) if body.item_first else tuple(query) + tuple(item)  # type: ignore[arg-type]
                shared_len = len(item) if body.item_first else len(query)  # type: ignore[arg-type]
                reqs.append(ScoreRequest(ids, ls, cache_prefix_len=shared_len or None))
        return reqs

    # ---- /v1/classify ---------------------------------------------------------------------------

    def label_continuations(
        self, prompt_text: str, labels: Sequence[str], leading_space: bool | None
    ) -> list[tuple[int, ...]]:
        """Each label's tokens as they would follow the prompt: the tokens `tail + label` has
        beyond `tail`, so the tokenizer decides the boundary (as po_lang's compiler does)."""
        anchor = prompt_text[-64:]
        base = self.encode(anchor, add_special_tokens=False)
        out = []
        for label in labels:
            space = (
                leading_space
                if leading_space is not None
                else bool(prompt_text) and not prompt_text[-1].isspace()
            )
            text = " " + label if space and not label[:1].isspace() else label
            full = self.encode(anchor + text, add_special_tokens=False)
            if full[: len(base)] != base:
                raise bad(
                    f"label {label!r} merges with the end of the prompt into different tokens; end the prompt with a separator such as ':' or a newline"
                )
            cont = full[len(base) :]
            if not cont:
                raise bad(f"label {label!r} tokenises to nothing after the prompt")
            out.append(cont)
        if len(set(out)) != len(out):
            raise bad(f"labels {list(labels)} do not all tokenise differently")
        return out

    # ---- formatting for OpenAI ------------------------------------------------------------------

    def completion_choice(
        self, index: int, prompt_ids: tuple[int, ...], prompt_text: str | None, body: CompletionRequest,
        max_tokens: int, bias: dict[int, float], req: ScoreRequest, res: ScoreResult,
    ) -> dict[str, Any]:  # fmt: skip
        k = body.logprobs
        top = biased_top(res, req.label_token_ids, bias, max(k or 0, 1))
        out_ids = [top[0][0]] if max_tokens == 1 else []
        out_text = self.tokenizer.decode(out_ids, skip_special_tokens=True) if out_ids else ""
        text = out_text
        eos = getattr(self.backend.tokenizer, "eos_token_id", None)
        finish = "stop" if out_ids and out_ids[0] == eos else "length"
        logprobs = None
        if body.echo:
            if prompt_text is None:
                prompt_text = self.tokenizer.decode(list(prompt_ids))
            text = prompt_text + out_text
        if k is not None:
            tokens: list[int] = []
            values: list[float | None] = []
            tops: list[dict[str, float] | None] = []
            if body.echo:
                tokens += list(prompt_ids)
                values += [None, *res.input_token_logprobs]
                tops += [None] * len(prompt_ids)  # per-position alternatives are not computed
            chosen = dict(top)
            for t in out_ids:
                tokens.append(t)
                values.append(chosen[t])
                row = {self.token_text(tt) or "": _lp(v) for tt, v in top[:k]}
                row.setdefault(self.token_text(t) or "", _lp(chosen[t]))
                tops.append(row)
            texts = [self.token_text(t) or "" for t in tokens]
            offsets, pos = [], 0
            for s in texts:
                offsets.append(pos)
                pos += len(s)
            logprobs = {
                "tokens": texts,
                "token_logprobs": [_lp(v) for v in values],
                "top_logprobs": tops,
                "text_offset": offsets,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _discard_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


async def _wait_disconnect(request: Request) -> None:
    """Returns when the client disconnects. The body is already read, so the next ASGI message
    the server gives this request is the disconnect (uvicorn also sends it once the response has
    been sent, by which time nobody waits on this)."""
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


def _sse(events: Sequence[dict[str, Any]]) -> StreamingResponse:
    async def gen() -> AsyncIterator[bytes]:
        for e in events:
            yield b"data: " + json.dumps(e).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


def _softmax(xs: Sequence[float], temperature: float = 1.0) -> list[float]:
    m = max(xs)
    w = [math.exp((x - m) / temperature) for x in xs]
    s = math.fsum(w)
    return [x / s for x in w]


def create_app(backend: Backend, args: ServerArgs) -> FastAPI:
    """The FastAPI app over `backend`. `backend.shutdown()` runs when the app stops."""
    srv = Server(backend, args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(backend.shutdown)

    app = FastAPI(title="PrefillOnly", version=VERSION, lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.kind)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, _validation_message(exc), "BadRequestError")

    @app.exception_handler(InvalidRequestError)
    async def _invalid(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, f"{type(exc).__name__}: {exc}", "BadRequestError")

    @app.exception_handler(OverloadedError)
    async def _overloaded(_: Request, exc: OverloadedError) -> JSONResponse:
        return error_response(503, f"overloaded: {exc}", "ServiceUnavailableError")

    @app.exception_handler(ClientGone)
    async def _gone(_: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(PrefillOnlyError)
    async def _engine_error(_: Request, exc: PrefillOnlyError) -> JSONResponse:
        log.warning("engine error: %s: %s", type(exc).__name__, exc)
        return error_response(503, f"{type(exc).__name__}: {exc}", "ServiceUnavailableError")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "InternalServerError")

    # ---- SGLang native ----------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request) -> Response:
        await srv.run(request, [ScoreRequest((0,), ())])
        return Response(status_code=200)

    def model_info() -> dict[str, Any]:
        return {
            "model_path": args.model_path,
            "tokenizer_path": args.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": args.model_type,
            "architectures": list(args.architectures),
            "served_model_name": args.model_name,
            "max_input_len": backend.max_input_len,
            "vocab_size": backend.vocab_size,
            "backend": args.backend,
        }

    def server_info() -> dict[str, Any]:
        info = {k: v for k, v in asdict(args).items() if k not in ("api_key", "engine_args")}
        info.update(args.engine_args)
        return {**info, "internal_states": [_jsonable(backend.stats())], "version": VERSION}

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)
    app.get("/server_info")(server_info)
    app.get("/get_server_info")(server_info)

    async def flush_cache() -> Response:
        try:
            await asyncio.to_thread(backend.flush_cache)
        except PrefillOnlyError as e:
            return PlainTextResponse(f"Cache not flushed: {e}\n", status_code=400)
        return PlainTextResponse("Cache flushed.\n")

    app.post("/flush_cache")(flush_cache)
    app.get("/flush_cache")(flush_cache)

    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        t0 = time.perf_counter()
        items, single = srv.parse_generate(body)
        results = await srv.run(request, [it.request for it in items])
        latency = time.perf_counter() - t0
        out = [srv.format_generate(it, r, latency) for it, r in zip(items, results, strict=True)]
        if body.stream:
            for i, o in enumerate(out):
                o["index"] = i
            return _sse(out)
        return JSONResponse(out[0] if single else out)

    @app.post("/v1/score")
    async def score(body: ScoreRequestBody, request: Request) -> JSONResponse:
        reqs = srv.parse_score(body)
        results = await srv.run(request, reqs)
        scores = []
        for res in results:
            if body.apply_softmax:
                scores.append(_softmax(res.logprobs, body.temperature))
            else:
                scores.append([math.exp(x) for x in res.logprobs])
        tokens = sum(r.prompt_tokens for r in results)
        out: dict[str, Any] = {
            "scores": scores,
            "model": body.model or args.model_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            "object": "scoring",
        }
        if body.return_token_logprobs:
            out["token_logprobs"] = [[_lp(x) for x in r.logprobs] for r in results]
        return JSONResponse(out)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        prompt = body.prompt if body.prompt is not None else body.text
        if prompt is None:
            raise bad("send the text to tokenize as 'prompt'")
        if isinstance(prompt, str):
            ids = list(srv.encode(prompt, body.add_special_tokens))
            return {"tokens": ids, "count": len(ids), "max_model_len": backend.max_input_len}
        lists = [list(srv.encode(p, body.add_special_tokens)) for p in prompt]
        return {"tokens": lists, "count": [len(x) for x in lists], "max_model_len": backend.max_input_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        toks = body.tokens
        for t in (x for row in (toks if toks and isinstance(toks[0], list) else [toks]) for x in row):  # type: ignore[union-attr]
            if not 0 <= t < backend.vocab_size:
                raise bad(f"token id {t} is outside the vocabulary [0, {backend.vocab_size})")
        if toks and isinstance(toks[0], list):
            return {
                "text": [srv.tokenizer.decode(r, skip_special_tokens=body.skip_special_tokens) for r in toks]
            }
        return {"text": srv.tokenizer.decode(toks, skip_special_tokens=body.skip_special_tokens)}

    @app.post("/apply_chat_template")
    async def apply_chat_template(body: ChatTemplateRequest) -> dict[str, Any]:
        tok = srv.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad("this model's tokenizer has no chat template")
        try:
            text = tok.apply_chat_template(
                body.messages, tokenize=False, add_generation_prompt=body.add_generation_prompt
            )
        except Exception as e:  # template errors (missing keys, raise_exception in jinja)
            raise bad(f"chat template failed: {e}") from e
        return {"text": text}

    # ---- OpenAI -----------------------------------------------------------------------------

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": args.model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "prefillonly",
                    "root": args.model_path,
                    "max_model_len": backend.max_input_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        max_tokens = 1 if body.max_tokens is None else body.max_tokens
        if max_tokens not in (0, 1):
            raise bad(
                f"max_tokens must be 0 or 1 on this prefill-only server (it never decodes), got {max_tokens}"
            )
        if body.n not in (None, 1) or body.best_of not in (None, 1):
            raise bad("n and best_of must be 1 on the prefill-only server")
        if body.suffix is not None:
            raise bad("suffix is not supported")
        if body.logprobs is not None and not 0 <= body.logprobs <= MAX_OPENAI_LOGPROBS:
            raise bad(f"logprobs must be in [0, {MAX_OPENAI_LOGPROBS}], got {body.logprobs}")
        bias = _parse_bias(body.logit_bias, backend.vocab_size, "logit_bias")
        p = body.prompt
        if isinstance(p, str):
            prompts: list[tuple[tuple[int, ...], str | None]] = [(srv.encode_prompt(p), p)]
        elif p and all(isinstance(x, str) for x in p):
            prompts = [(srv.encode_prompt(x), x) for x in p]  # type: ignore[arg-type]
        elif p and all(isinstance(x, list) for x in p):
            prompts = [(tuple(x), None) for x in p]  # type: ignore[arg-type]
        elif all(isinstance(x, int) for x in p):
            prompts = [(tuple(p), None)]  # type: ignore[arg-type]
        else:
            raise bad("prompt must be a string, a list of strings, token ids or a list of token-id lists")
        echo_lps = body.echo and body.logprobs is not None
        reqs = [
            ScoreRequest(
                ids,
                tuple(bias),
                top_k=(body.logprobs or 0) + len(bias) + 1,
                logprob_start_len=0 if echo_lps else -1,
            )
            for ids, _ in prompts
        ]
        results = await srv.run(request, reqs)
        choices = [
            srv.completion_choice(i, ids, text, body, max_tokens, bias, req, res)
            for i, ((ids, text), req, res) in enumerate(zip(prompts, reqs, results, strict=True))
        ]
        ptoks = sum(r.prompt_tokens for r in results)
        ctoks = max_tokens * len(results)
        out = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.model or args.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": ptoks, "completion_tokens": ctoks, "total_tokens": ptoks + ctoks},
        }
        if body.stream:
            events = [{**{k: v for k, v in out.items() if k != "usage"}, "choices": [c]} for c in choices]
            if (body.stream_options or {}).get("include_usage"):
                events.append({**{k: v for k, v in out.items() if k != "choices"}, "choices": []})
            return _sse(events)
        return JSONResponse(out)

    # ---- ours -------------------------------------------------------------------------------

    @app.post("/v1/classify")
    async def classify(body: ClassifyRequest, request: Request) -> dict[str, Any]:
        if any(not x.strip() for x in body.labels) or len(set(body.labels)) != len(body.labels):
            raise bad("labels must be distinct non-empty strings")
        p = body.prompt
        texts: list[str | None]
        prompts: list[tuple[int, ...]]
        shared: list[int | None] = []
        k = body.shared_prefix_len
        if isinstance(p, str) or (p and all(isinstance(x, str) for x in p)):
            texts = [p] if isinstance(p, str) else list(p)  # type: ignore[list-item]
            prompts = []
            for t in texts:
                assert t is not None
                if k is None:
                    prompts.append(srv.encode_prompt(t))
                    shared.append(None)
                else:
                    # The shared part is tokenised on its own so its ids are an exact prefix
                    # whatever follows (a merge across the boundary would break cache reuse).
                    head = srv.encode(t[:k])
                    prompts.append(head + srv.encode(t[k:], add_special_tokens=False))
                    shared.append(len(head))
        else:
            rows = [p] if p and all(isinstance(x, int) for x in p) else p
            prompts = [tuple(r) for r in rows]  # type: ignore[union-attr,arg-type]
            texts = [None] * len(prompts)
            shared = [k] * len(prompts)
        if not prompts:
            raise bad("prompt is empty")
        plans = []
        reqs: list[ScoreRequest] = []
        for ids, text, sh in zip(prompts, texts, shared, strict=True):
            tail = text if text is not None else srv.tokenizer.decode(list(ids[-32:]))
            conts = srv.label_continuations(tail, body.labels, body.leading_space)
            firsts = [c[0] for c in conts]
            single = all(len(c) == 1 for c in conts) and len(set(firsts)) == len(firsts)
            if single:
                reqs.append(ScoreRequest(ids, tuple(firsts), cache_prefix_len=sh))
                plans.append((single, ids, conts, 1))
            else:
                # One prefill per label over prompt + label, reading the label tokens' log-probs;
                # the prompt is cached by the first so the others compute only their label.
                n = len(ids)
                reqs.extend(
                    ScoreRequest(ids + c, (), logprob_start_len=n - 1, cache_prefix_len=n) for c in conts
                )
                plans.append((single, ids, conts, len(conts)))
        results = await srv.run(request, reqs)
        data = []
        pos = 0
        total = 0
        for i, (single, ids, conts, m) in enumerate(plans):
            group = results[pos : pos + m]
            pos += m
            if single:
                scores = list(group[0].logprobs)
            else:
                scores = []
                for c, r in zip(conts, group, strict=True):
                    tail_lps = r.input_token_logprobs[-len(c) :]
                    s = math.fsum(tail_lps)
                    scores.append(s / len(c) if body.choices_method == "mean" else s)
            probs = _softmax(scores)
            best = max(range(len(scores)), key=lambda j: scores[j])
            total += sum(r.prompt_tokens for r in group)
            data.append(
                {
                    "index": i,
                    "label": body.labels[best],
                    "probs": dict(zip(body.labels, probs, strict=True)),
                    "logprobs": {lab: _lp(s) for lab, s in zip(body.labels, scores, strict=True)},
                    "label_token_ids": [list(c) for c in conts],
                    "prompt_tokens": len(ids),
                    "cached_tokens": sum(r.cached_tokens for r in group),
                }
            )
        return {
            "object": "classification",
            "model": body.model or args.model_name,
            "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(srv.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    paths = {r.path for r in app.routes if hasattr(r, "path")}  # type: ignore[attr-defined]
    # Each add wraps the previous: auth ends up outermost (401 before a body is read), then the
    # body limit, then metrics around the endpoints.
    app.add_middleware(MetricsMiddleware, metrics=srv.metrics, paths=paths)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_body_bytes)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key)
    return app


def _jsonable(stats: Any) -> Any:
    """Backend stats (dicts, dataclasses) as plain JSON values."""
    if hasattr(stats, "__dataclass_fields__"):
        stats = asdict(stats)
    if isinstance(stats, dict):
        return {str(k): _jsonable(v) for k, v in stats.items()}
    if isinstance(stats, list | tuple):
        return [_jsonable(v) for v in stats]
    if isinstance(stats, float) and not math.isfinite(stats):
        return None
    if isinstance(stats, int | float | str | bool) or stats is None:
        return stats
    return str(stats)
