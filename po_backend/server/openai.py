"""OpenAI's API: `/v1/models` and the legacy `/v1/completions` (`max_tokens` 0 or 1, `logprobs`,
`logit_bias`, `echo`), so the openai client and lm-eval-style loglikelihood scripts work."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.server.adapters import adapters
from po_backend.server.body import BodyRoute
from po_backend.server.context import Runtime, RuntimeDep, sse
from po_backend.server.errors import HTTPError, bad
from po_backend.server.protocol import CompletionRequest
from po_backend.server.sglang_native import CACHE_NAMESPACE
from po_backend.server.translate import biased_top, envelope, json_logprob, parse_bias

router = APIRouter(route_class=BodyRoute)


@dataclass(frozen=True)
class Completion:
    """One /v1/completions call, parsed: its prompts (ids, and text when sent as text)."""

    prompts: tuple[tuple[tuple[int, ...], str | None], ...]
    max_tokens: int
    bias: dict[int, float]
    requests: tuple[ScoreRequest, ...]


def _model_card(rt: Runtime) -> dict[str, Any]:
    return {
        "id": rt.args.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "prefillonly",
        "root": rt.args.model_path,
        "max_model_len": rt.service.max_input_len,
        **rt.task.describe(),  # task (generate / classify / embed) and its head's facts
    }


def _adapter_cards(rt: Runtime) -> dict[str, dict[str, Any]]:
    """vLLM's cards of the loaded LoRA adapters: the adapter's name as id, the base as parent."""
    base = _model_card(rt)
    return {
        name: {**base, "id": name, "root": path, "parent": rt.args.model_name}
        for name, path in adapters(rt.service).items()
    }


@router.get("/v1/models")
async def models(rt: RuntimeDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(rt), *_adapter_cards(rt).values()]}


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, rt: RuntimeDep) -> dict[str, Any]:
    # {model_id:path}: served names may hold slashes ("org/name"), as OpenAI's ids do.
    cards = _adapter_cards(rt)
    if model_id in cards:
        return cards[model_id]
    if model_id not in (rt.args.model_name, rt.args.model_path):
        raise HTTPError(404, f"The model '{model_id}' does not exist", "NotFoundError")
    return _model_card(rt)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, rt: RuntimeDep) -> Response:
    call = await rt.parse(parse_completion, rt, body)
    results = await rt.run(request, call.requests, call.max_tokens * len(call.requests), body.priority)
    choices = [
        completion_choice(rt, i, ids, text, body, call.max_tokens, call.bias, req, res)
        for i, ((ids, text), req, res) in enumerate(zip(call.prompts, call.requests, results, strict=True))
    ]
    prompt_tokens = sum(r.prompt_tokens for r in results)
    model = body.model or rt.args.model_name
    out = envelope(
        "cmpl", "text_completion", model, "choices", choices, prompt_tokens, call.max_tokens * len(results)
    )
    if body.stream:
        events = [{**{k: v for k, v in out.items() if k != "usage"}, "choices": [c]} for c in choices]
        if (body.stream_options or {}).get("include_usage"):
            events.append({**{k: v for k, v in out.items() if k != "choices"}, "choices": []})
        return sse(events)
    return JSONResponse(out)


def parse_completion(rt: Runtime, body: CompletionRequest) -> Completion:
    max_tokens = 1 if body.max_tokens is None else body.max_tokens
    if max_tokens not in (0, 1):
        raise bad(
            f"max_tokens must be 0 or 1 on this prefill-only server (it never decodes), got {max_tokens}"
        )
    if body.n not in (None, 1) or body.best_of not in (None, 1):
        raise bad("n and best_of must be 1 on the prefill-only server")
    if body.cache_salt is not None:
        raise bad(CACHE_NAMESPACE.format(field="cache_salt"))
    if body.suffix is not None:
        raise bad("suffix is not supported")
    if body.return_hidden_states:
        raise bad("return_hidden_states is not supported by the prefill-only server")
    cap = rt.args.max_top_logprobs
    if body.logprobs is not None and not 0 <= body.logprobs <= cap:
        raise bad(f"logprobs must be in [0, {cap}] (--max-top-logprobs), got {body.logprobs}")
    bias = parse_bias(body.logit_bias, rt.service.vocab_size, "logit_bias", rt.args.max_logit_bias)
    p = body.prompt
    if not isinstance(p, str) and p and not isinstance(p[0], int):
        rt.check_items(len(p), "prompts")
    if isinstance(p, str):
        prompts: list[tuple[tuple[int, ...], str | None]] = [(rt.encode_prompt(p), p)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [(rt.encode_prompt(x), x) for x in cast(list[str], p)]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [(tuple(x), None) for x in cast(list[list[int]], p)]
    elif all(isinstance(x, int) for x in p):
        prompts = [(tuple(cast(list[int], p)), None)]
    else:
        raise bad("prompt must be a string, a list of strings, token ids or a list of token-id lists")
    echo_logprobs = body.echo and body.logprobs is not None
    k = body.logprobs or 0
    rt.check_logprobs(sum(1 + k + (len(ids) * (1 + k) if echo_logprobs else 0) for ids, _ in prompts))
    requests = tuple(
        ScoreRequest(
            ids,
            tuple(bias),
            top_k=(body.logprobs or 0) + len(bias) + 1,
            logprob_start_len=0 if echo_logprobs else -1,
            input_top_k=(body.logprobs or 0) if echo_logprobs else 0,
        )
        for ids, _ in prompts
    )
    return Completion(tuple(prompts), max_tokens, bias, requests)


def _alternatives(rt: Runtime, pairs: Sequence[tuple[int, float]]) -> dict[str, float | None]:
    """OpenAI's top_logprobs row, keyed by token text, best first. Two tokens may decode to the
    same text: the key keeps the more likely one's log-prob."""
    row: dict[str, float | None] = {}
    for token, logprob in pairs:
        row.setdefault(rt.token_text(token) or "", json_logprob(logprob))
    return row


def completion_choice(
    rt: Runtime, index: int, prompt_ids: tuple[int, ...], prompt_text: str | None, body: CompletionRequest,
    max_tokens: int, bias: dict[int, float], req: ScoreRequest, res: ScoreResult,
) -> dict[str, Any]:  # fmt: skip
    k = body.logprobs
    top = biased_top(res, req.label_token_ids, bias, max(k or 0, 1))
    out_ids = [top[0][0]] if max_tokens == 1 else []
    out_text = rt.decode(out_ids, skip_special_tokens=True) if out_ids else ""
    text = out_text
    finish = "stop" if out_ids and out_ids[0] == rt.eos_token_id else "length"
    logprobs = None
    if body.echo:
        if prompt_text is None:
            prompt_text = rt.decode(prompt_ids)
        text = prompt_text + out_text
    if k is not None:
        tokens: list[int] = []
        values: list[float | None] = []
        tops: list[dict[str, float | None] | None] = []
        if body.echo:
            tokens += list(prompt_ids)
            values += [None, *res.input_token_logprobs]
            # The first token has no context: null, as OpenAI and vLLM answer there.
            tops.append(None)
            rows = res.input_top_logprobs or [[] for _ in res.input_token_logprobs]  # logprobs=0
            for t, v, row in zip(prompt_ids[1:], res.input_token_logprobs, rows, strict=True):
                alt = _alternatives(rt, row[:k])
                alt.setdefault(rt.token_text(t) or "", json_logprob(v))  # OpenAI includes the token itself
                tops.append(alt)
        chosen = dict(top)
        for t in out_ids:
            tokens.append(t)
            values.append(chosen[t])
            alts = _alternatives(rt, top[:k])
            alts.setdefault(rt.token_text(t) or "", json_logprob(chosen[t]))
            tops.append(alts)
        texts = [rt.token_text(t) or "" for t in tokens]
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
