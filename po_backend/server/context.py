"""What every endpoint shares: `Runtime` (the scoring service, the settings, the metrics; tokenizing, token
text, log-prob entries; submitting a call's requests and awaiting them with cancel-on-disconnect),
the `RuntimeDep` that hands it to a handler, and the SSE response."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import dataclasses
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.responses import StreamingResponse

from po_backend.core.errors import DrainingError, EmptyPromptError, OverloadedError
from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.core.task import ModelTask
from po_backend.server.adapters import adapter_of
from po_backend.server.args import ServerArgs
from po_backend.server.errors import ClientGone, HTTPError, bad, check_items, check_logprobs, check_tokenize
from po_backend.server.metrics import Metrics
from po_backend.server.service import ScoringService
from po_backend.server.translate import json_logprob

if TYPE_CHECKING:
    from po_backend.server.tracing import Tracing

VERSION = "prefillonly-0.1.0"

# A text longer than this many characters per allowed token cannot fit max_input_len with any
# tokenizer we load (their longest tokens are ~16 characters): refused before tokenizing, so a
# 60 MB string costs a length check, not a minute of tokenizer time.
MAX_CHARS_PER_TOKEN = 32

T = TypeVar("T")


@dataclasses.dataclass
class _ParseCall:
    """One call's parse step as its thread sees it: `gone` is set once its client disconnected,
    `chars_left` is the tokenizer input it may still use (--max-tokenize-chars)."""

    gone: threading.Event
    chars_left: int


# The call a parse-pool thread works for (set in that thread's copy of the handler's context),
# and the request a handler serves (set by `get_runtime`, the dependency every handler has).
_CALL: contextvars.ContextVar[_ParseCall | None] = contextvars.ContextVar("po_parse_call", default=None)
_REQUEST: contextvars.ContextVar[Request | None] = contextvars.ContextVar("po_request", default=None)


class Runtime:
    """One app's scoring service, settings and metrics, and the steps its handlers share."""

    def __init__(self, service: ScoringService, args: ServerArgs) -> None:
        self.service = service
        self.args = args
        self.metrics = Metrics(service, args.model_name)
        self._token_text: dict[int, str] = {}
        # Answers decode with a tokenizer of their own: the shared one is locked for as long as
        # a long text tokenizes on the parse pool, and a one-token answer would wait for it.
        self._decoder = _own_copy(service.tokenizer)
        self._decode_lock = threading.Lock()
        # Parsing a call tokenizes: CPU work of up to a few hundred ms for a large batch. It runs
        # here, off the event loop, which keeps answering /health and other clients meanwhile.
        self._parse_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="po-parse")
        # Set on SIGTERM (launch_server): new calls get 503 + Retry-After, queued ones still run.
        self.draining = False
        # Set by create_app when traces are exported (--otlp-traces-endpoint); None costs nothing.
        self.tracing: Tracing | None = None

    @property
    def task(self) -> ModelTask:
        """What the model is served for (a service that does not say scores label tokens)."""
        return getattr(self.service, "task", None) or ModelTask()

    def healthy(self) -> bool:
        """Liveness: the scoring loop runs and the server is not shutting down."""
        return self.service.alive() and not self.draining

    async def parse(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (a handler's parse step) on the parse pool, traced as tokenizing when tracing
        is on."""
        if self.tracing is not None:
            with self.tracing.tokenize():
                return await self._parse(fn, *args)
        return await self._parse(fn, *args)

    async def _parse(self, fn: Callable[..., T], *args: Any) -> T:
        """`parse`'s work. When the handler's client
        disconnects meanwhile, the call is answered at once and its parse stops at its next
        `encode`; `encode` also holds the call to --max-tokenize-chars."""
        call = _ParseCall(threading.Event(), self.args.max_tokenize_chars)
        ctx = contextvars.copy_context()
        ctx.run(_CALL.set, call)
        fut = asyncio.get_running_loop().run_in_executor(self._parse_pool, ctx.run, fn, *args)
        request = _REQUEST.get()
        if request is None:
            return await fut
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            both: set[asyncio.Future[Any]] = {fut, watcher}
            await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if fut.done():
                return fut.result()
            call.gone.set()
            fut.add_done_callback(_discard_outcome)
            raise ClientGone()
        finally:
            watcher.cancel()

    def check_tokenize(self, chars: int, what: str) -> None:
        """Refuse, before any tokenizing, a call whose texts would give the tokenizer more than
        --max-tokenize-chars characters in all (a shared query is tokenized once per item)."""
        check_tokenize(chars, what, self.args.max_tokenize_chars)

    def check_items(self, n: int, what: str) -> None:
        """The per-call item limit, checked on the parsed body before anything is tokenized (a
        call over it could never be served, so it is a 413, not a 503 to retry)."""
        check_items(n, what, self.args.max_items_per_request)

    def check_queue(self, prefills: int) -> None:
        """A call that could never be queued however long its client waits: 413, not a 503 to
        retry; checked again before tokenizing wherever the count is known by then."""
        if prefills > self.args.max_queue:
            raise HTTPError(
                413,
                f"this call needs {prefills} prefills (prompts, times the labels where a label has "
                f"several tokens), more than the queue holds (--max-queue {self.args.max_queue}): split the call",
                "PayloadTooLargeError",
            )

    def check_prompt_ids(self, ids: Sequence[int], what: str) -> None:
        """A prompt part every prompt of the call holds (a shared query), checked once before the
        call's prompts are built from it: too long, or a token outside the vocabulary."""
        limit = self.service.max_input_len
        if len(ids) > limit:
            raise bad(f"the {what} has {len(ids)} tokens, more than max_input_len={limit}")
        vocab = self.service.vocab_size
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            wrong = [t for t in ids if not 0 <= t < vocab]
            raise bad(f"{what} token ids outside the vocabulary [0, {vocab}): {wrong[:5]}")

    def check_logprobs(self, n: int) -> None:
        check_logprobs(n, self.args.max_logprobs_per_request)

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        if self.service.tokenizer is None:
            raise bad("this model has no tokenizer: send input_ids instead of text")
        return self.service.tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.service.tokenizer, "eos_token_id", None)

    def encode(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        limit = MAX_CHARS_PER_TOKEN * self.service.max_input_len
        if len(text) > limit:
            raise bad(
                f"the text has {len(text)} characters: it cannot fit max_input_len="
                f"{self.service.max_input_len} tokens (refused before tokenizing above {limit} characters)"
            )
        call = _CALL.get()
        if call is not None:
            if call.gone.is_set():
                raise ClientGone()
            call.chars_left -= len(text)
            if call.chars_left < 0:
                raise HTTPError(
                    413,
                    f"this call's texts are more than {self.args.max_tokenize_chars} characters of "
                    "tokenizer input (--max-tokenize-chars): send fewer or shorter texts, or split the call",
                    "PayloadTooLargeError",
                )
        self.metrics.tokenized_chars.inc(len(text))
        return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_prompt(self, text: str) -> tuple[int, ...]:
        """A prompt's ids; empty text is an empty prompt even though the tokenizer would give it
        a BOS (scoring the distribution after BOS alone is never what was meant)."""
        if not text:
            raise EmptyPromptError("the prompt is empty (empty text)")
        return self.encode(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        if self._decoder is None or _CALL.get() is not None:  # a parse step: the shared tokenizer
            return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))
        # An answer: the private copy, whose lock only other answers' decodes (a few tokens) take.
        with self._decode_lock:
            return str(self._decoder.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_text(self, token: int) -> str | None:
        """One token decoded on its own (SGLang's `return_text_in_logprobs`), memoised."""
        if self.service.tokenizer is None:
            return None
        text = self._token_text.get(token)
        if text is None:
            text = self._token_text[token] = self.decode([token])
        return text

    def entry(self, logprob: float | None, token: int, with_text: bool) -> list[Any]:
        """SGLang's log-prob entry: [log-prob, token id, token text or None]."""
        return [json_logprob(logprob), token, self.token_text(token) if with_text else None]

    # ---- running requests -----------------------------------------------------------------------

    async def run(
        self,
        request: Request,
        reqs: Sequence[ScoreRequest],
        output_tokens: int = 0,
        priority: int | None = None,
    ) -> list[ScoreResult]:
        """Submit together (one multi-item batch for the scheduler) and await, cancelling all if
        the client disconnects first. `output_tokens`: what the call answers with in all (for
        SGLang's generation-token counter). `priority`: the call's (the body's `priority`), given
        to each of its requests."""
        if not reqs:
            return []
        if priority is not None:
            reqs = [dataclasses.replace(r, priority=priority) for r in reqs]
        lora = adapter_of(self.service, await _body(request))
        if lora is not None:
            reqs = [dataclasses.replace(r, lora=lora) for r in reqs]
        if self.draining:
            raise DrainingError("the server is shutting down")
        self.check_queue(len(reqs))
        submitted_ns = time.time_ns() if self.tracing is not None else 0
        try:
            # Off the event loop: validation reads every token id of every request (a shared
            # query of thousands of ids times a thousand items is a second of CPU).
            futs = await asyncio.to_thread(self.service.submit_many, reqs)
        except OverloadedError:
            self.metrics.rejected.inc(len(reqs))
            raise
        t0 = time.perf_counter()
        waiters = asyncio.gather(*(asyncio.wrap_future(f) for f in futs))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            both: set[asyncio.Future[Any]] = {waiters, watcher}
            done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
            if waiters in done:
                results = waiters.result()
                self.metrics.observe(results, time.perf_counter() - t0, output_tokens, priority)
                self._check_finite(results)
                if self.tracing is not None:
                    self.tracing.record_run(submitted_ns, results)
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
                    self.service.cancel(f)
                self.metrics.cancelled.inc(len(unfinished))
                self.metrics.sgl_aborted.inc(len(unfinished))

    def _check_finite(self, results: Sequence[ScoreResult]) -> None:
        """NaN log-probs (a half-precision overflow in the model) are no answer: a clear 500 on
        every route, instead of a label picked from NaN, null probabilities or an encoder crash."""
        for r in results:
            if _has_nan(r):
                dtype = self.service.settings.get("dtype", "?")
                raise HTTPError(
                    500,
                    f"the model produced NaN scores (a numeric overflow in dtype {dtype}); "
                    "serve it with --dtype fp32 (or bf16 where it runs fp16)",
                    "NumericalError",
                )


async def _body(request: Request) -> Any:
    """The call's JSON body (parsed once already: the request caches it), or None."""
    if request.method != "POST":
        return None
    try:
        return await request.json()
    except ValueError:
        return None


def _has_nan(r: ScoreResult) -> bool:
    # x != x only for NaN; -inf (a token the model rules out) is a valid log-prob.
    return (
        any(x != x for x in r.logprobs)
        or any(v != v for _, v in r.top_logprobs)
        or any(x != x for x in r.input_token_logprobs)
        or any(v != v for row in r.input_top_logprobs for _, v in row)
        or any(x != x for row in r.input_token_ids_logprobs for x in row)
    )


async def get_runtime(request: Request) -> Runtime:
    # async: FastAPI would run a plain function in its thread pool for every request, and this
    # one runs in the handler's own context, where `Runtime.parse` finds the request.
    _REQUEST.set(request)
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def sse(events: Sequence[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events, one per result, then `[DONE]` (SGLang's and OpenAI's stream end)."""

    async def gen() -> AsyncIterator[bytes]:
        for e in events:
            yield b"data: " + json.dumps(e).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    return StreamingResponse(gen(), media_type="text/event-stream")


def _own_copy(tokenizer: Any) -> Any:
    """A private copy of the service's tokenizer (unwrapped from its lock), or None when it has
    none or cannot be copied (then decoding shares the service's)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(getattr(tokenizer, "unwrapped", tokenizer))
    except Exception:  # a tokenizer class that cannot be copied
        return None


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
