"""The FastAPI app: SGLang's native API, OpenAI completions, our `/v1/classify`, /metrics.

`Server` holds the endpoint logic over one backend (tokenising, submitting a call's requests
together, cancelling them when the client goes, shaping results); `create_app` wires it into
FastAPI with the error handlers and the middleware.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from po_backend.engine import ScoreRequest, ScoreResult
from po_backend.errors import EmptyPromptError, OverloadedError, PrefillOnlyError
from po_backend.scheduler import common_prefix
from po_backend.server.backend import Backend, ServerArgs
from po_backend.server.errors import ClientGone, add_exception_handlers, bad
from po_backend.server.metrics import Metrics
from po_backend.server.middleware import ApiKeyMiddleware, BodyLimitMiddleware, MetricsMiddleware
from po_backend.server.protocol import (
    ChatTemplateRequest,
    ClassifyRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    SamplingParams,
    ScoreRequestBody,
    TokenizeRequest,
)
from po_backend.server.translate import (
    biased_top,
    json_logprob,
    parse_bias,
    per_item,
    softmax,
    unique,
)

VERSION = "prefillonly-0.1.0"
MAX_OPENAI_LOGPROBS = 20


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

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.metrics = Metrics(backend)
        self._token_text: dict[int, str] = {}

    # ---- tokens ---------------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        if self.backend.tokenizer is None:
            raise bad("this model has no tokenizer: send input_ids instead of text")
        return self.backend.tokenizer

    @property
    def eos_token_id(self) -> int | None:
        return getattr(self.backend.tokenizer, "eos_token_id", None)

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
        return [json_logprob(lp), tid, self.token_text(tid) if with_text else None]

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
        sps = per_item(body.sampling_params, n, "sampling_params", SamplingParams())
        ret = per_item(body.return_logprob, n, "return_logprob", False)
        starts = per_item(body.logprob_start_len, n, "logprob_start_len", -1)
        tops = per_item(body.top_logprobs_num, n, "top_logprobs_num", 0)
        tid = body.token_ids_logprob
        if tid is not None and tid and isinstance(tid[0], list):
            id_lists = per_item(tid, n, "token_ids_logprob", None)
        else:
            id_lists = [tid] * n
        prefix = per_item(body.cache_prefix_len, n, "cache_prefix_len", None)
        rids = per_item(body.rid, n, "rid", None)
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
            bias = parse_bias(sp.logit_bias, self.backend.vocab_size, "logit_bias")
            top_k = int(tops[i]) if ret[i] else 0
            if mnt == 1:
                top_k = max(top_k, 1 + len(bias))  # enough unbiased candidates for the argmax
            # The engine returns log-probs of the positions after its start; SGLang's list
            # begins at the start position itself.
            engine_start = max(start - 1, 0) if ret[i] and start >= 0 else -1
            request = ScoreRequest(
                prompts[i],
                unique((ids_lp or ()) + tuple(bias)),
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
            if tok == self.eos_token_id:
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
                reqs.append(ScoreRequest(ids, ls, cache_prefix_len=common_prefix(shared, ids)))
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
        finish = "stop" if out_ids and out_ids[0] == self.eos_token_id else "length"
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
                row = {self.token_text(tt) or "": json_logprob(v) for tt, v in top[:k]}
                row.setdefault(self.token_text(t) or "", json_logprob(chosen[t]))
                tops.append(row)
            texts = [self.token_text(t) or "" for t in tokens]
            offsets, pos = [], 0
            for s in texts:
                offsets.append(pos)
                pos += len(s)
            logprobs = {
                "tokens": texts,
                "token_logprobs": [json_logprob(v) for v in values],
                "top_logprobs": tops,
                "text_offset": offsets,
            }
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


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


def create_app(backend: Backend, args: ServerArgs) -> FastAPI:
    """The FastAPI app over `backend`. `backend.shutdown()` runs when the app stops."""
    srv = Server(backend)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(backend.shutdown)

    app = FastAPI(title="PrefillOnly", version=VERSION, lifespan=lifespan)
    app.state.server = srv
    add_exception_handlers(app)

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
        return {**info, "internal_states": [backend.stats()], "version": VERSION}

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
                scores.append(softmax(res.logprobs, body.temperature))
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
            out["token_logprobs"] = [[json_logprob(x) for x in r.logprobs] for r in results]
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
        bias = parse_bias(body.logit_bias, backend.vocab_size, "logit_bias")
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
            probs = softmax(scores)
            best = max(range(len(scores)), key=lambda j: scores[j])
            total += sum(r.prompt_tokens for r in group)
            data.append(
                {
                    "index": i,
                    "label": body.labels[best],
                    "probs": dict(zip(body.labels, probs, strict=True)),
                    "logprobs": {lab: json_logprob(s) for lab, s in zip(body.labels, scores, strict=True)},
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
