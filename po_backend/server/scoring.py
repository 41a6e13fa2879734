"""Scoring APIs: SGLang's `/v1/score` (label-token probabilities for query + item), vLLM's
`/generative_scoring` (the same over token ids, in vLLM's shape), and `/v1/classify` in two forms
told apart by their required key: SGLang/vLLM's `{model, input}` (labels and prompt template fixed
at launch by `--classify-labels` / `--classify-template`) and ours, `{prompt, labels}` (also at
`/v1/classify_labels`). Label strings become tokens after each prompt by `po_backend.core.labels`, the
same rule as po_lang's `@po.classify`."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, cast

from fastapi import APIRouter, Body, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictInt, ValidationError

from po_backend.core.labels import (
    ANCHOR_CHARS,
    LabelIds,
    LabelTokenError,
    check_distinct,
    continuation_score,
    label_continuations,
    label_key,
    label_requests,
    single_tokens,
)
from po_backend.core.request import ScoreRequest, ScoreResult, common_prefix
from po_backend.server import heads
from po_backend.server.body import BodyRoute
from po_backend.server.context import MAX_CHARS_PER_TOKEN, Runtime, RuntimeDep
from po_backend.server.errors import CallLimits, HTTPError, bad
from po_backend.server.protocol import ClassifyRequest, IntList, ScoreRequestBody, TolerantBody
from po_backend.server.translate import envelope, json_logprob, softmax

router = APIRouter(route_class=BodyRoute)

# Prompt tokens decoded to find where a token-id prompt's labels begin (only the tail matters).
_TAIL_TOKENS = 32


def _validate(model: type[BaseModel], raw: dict[str, Any]) -> Any:
    """A body chosen after parsing, validated with the same 400 as a declared one."""
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from e


class LaunchClassifyBody(TolerantBody):
    """SGLang/vLLM's `ClassifyRequest`: one text, a list of texts, or one prompt's token ids."""

    input: str | list[str] | IntList
    model: str | None = None
    priority: StrictInt | None = None


class GenerativeScoringBody(TolerantBody):
    """vLLM's `GenerativeScoringRequest`: prompt = query ids + item ids (item first when asked),
    the query tokenised with special tokens, items without."""

    query: str | IntList
    items: list[str] | list[IntList] = Field(min_length=1)
    label_token_ids: IntList = Field(min_length=1)
    apply_softmax: bool = True
    item_first: bool = False
    add_special_tokens: bool = True
    model: str | None = None
    priority: StrictInt | None = None


@router.post("/v1/score")
async def score(body: ScoreRequestBody, request: Request, rt: RuntimeDep) -> JSONResponse:
    head = heads.is_head(rt, "/v1/score")
    if head:  # SGLang's classifier form: the head's probabilities per item
        results = await heads.score_items(rt, request, body.query, body.items, body.item_first, body.priority)
        tokens = sum(r.prompt_tokens for r in results)
        return JSONResponse(score_envelope(body, heads.probs_of(rt, results), tokens, rt.args.model_name))
    results = await rt.run(request, await rt.parse(parse_score, rt, body), priority=body.priority)
    tokens = sum(r.prompt_tokens for r in results)
    return JSONResponse(score_answer(body, [r.logprobs for r in results], tokens, rt.args.model_name))


def score_envelope(
    body: ScoreRequestBody, scores: list[list[float]], tokens: int, model: str
) -> dict[str, Any]:
    """SGLang's /v1/score answer around the items' scores."""
    return {
        "scores": scores,
        "model": body.model or model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        "object": "scoring",
    }


def score_answer(
    body: ScoreRequestBody, logprobs: Sequence[Sequence[float]], tokens: int, model: str
) -> dict[str, Any]:
    """A causal LM's /v1/score answer from each item's label-token log-probs (also the cluster's
    gate's, from the workers' /generate answers)."""
    out = score_envelope(body, [score_values(body, lp) for lp in logprobs], tokens, model)
    if body.return_token_logprobs:
        out["token_logprobs"] = [[json_logprob(x) for x in lp] for lp in logprobs]
    return out


@router.post("/v1/classify")
async def classify_any(
    raw: Annotated[dict[str, Any], Body()], request: Request, rt: RuntimeDep
) -> dict[str, Any]:
    """SGLang/vLLM's form when the body has `input` (what their clients and the router send),
    ours otherwise; the two share no required key, so the choice is never ambiguous."""
    if heads.is_head(rt, "/v1/classify"):
        if "input" in raw:
            body = _validate(LaunchClassifyBody, raw)
            model = body.model or rt.args.model_name
            return await heads.classify_input(rt, request, body.input, model, body.priority)
        return await classify(_validate(ClassifyRequest, raw), request, rt)
    if "input" in raw:
        return await classify_input(_validate(LaunchClassifyBody, raw), request, rt)
    return await classify(_validate(ClassifyRequest, raw), request, rt)


@router.post("/v1/classify_labels")
async def classify(body: ClassifyRequest, request: Request, rt: RuntimeDep) -> dict[str, Any]:
    if heads.is_head(rt, "/v1/classify"):
        prompts = await rt.parse(_classify_prompts, rt, body)
        pairs = [(ids, shared) for ids, _, shared in prompts]
        model = body.model or rt.args.model_name
        return await heads.classify_labels(rt, request, pairs, body.labels, model, body.priority)
    items, data, total = await run_classify(rt, request, body)
    return {
        "object": "classification",
        "model": body.model or rt.args.model_name,
        "data": [classification(i, it, g, body) for i, (it, g) in enumerate(zip(items, data, strict=True))],
        "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
    }


async def classify_input(body: LaunchClassifyBody, request: Request, rt: RuntimeDep) -> dict[str, Any]:
    """SGLang's `ClassifyResponse`: per input the best label, the probabilities in the launch
    labels' order, their number."""
    labels = list(getattr(rt.args, "classify_labels", ()) or ())
    if not labels:
        raise bad(
            "this server has no classification labels: launch it with --classify-labels A,B[,...] "
            "(and --classify-template), or send our {prompt, labels} form"
        )
    inner = await rt.parse(launch_classify_request, rt, body, labels)
    items, data, total = await run_classify(rt, request, inner, body.priority)
    out = []
    for i, (it, group) in enumerate(zip(items, data, strict=True)):
        c = classification(i, it, group, inner)
        probs = [c["probs"][label] for label in labels]
        out.append({"index": i, "label": c["label"], "probs": probs, "num_classes": len(labels)})
    return envelope("classify", "list", body.model or rt.args.model_name, "data", out, total)


@router.post("/generative_scoring")
async def generative_scoring(body: GenerativeScoringBody, request: Request, rt: RuntimeDep) -> dict[str, Any]:
    """vLLM's generative scoring: per item the probability of the first label token (softmax over
    the labels by default, full vocabulary with apply_softmax=false)."""
    reqs = await rt.parse(parse_generative, rt, body)
    results = await rt.run(request, reqs, priority=body.priority)
    tokens = sum(r.prompt_tokens for r in results)
    return generative_answer(body, [r.logprobs for r in results], tokens, rt.args.model_name)


def generative_answer(
    body: GenerativeScoringBody, logprobs: Sequence[Sequence[float]], tokens: int, model: str
) -> dict[str, Any]:
    """vLLM's answer from each item's label-token log-probs (also the cluster's gate's): the first
    label's probability, over the labels or (apply_softmax=false) the whole vocabulary."""
    data = [
        {"index": i, "object": "score", "score": softmax(lp)[0] if body.apply_softmax else math.exp(lp[0])}
        for i, lp in enumerate(logprobs)
    ]
    # vLLM counts the one sampled token per item; a prefill-only server samples none.
    return envelope("generative-scoring", "list", body.model or model, "data", data, tokens)


async def run_classify(
    rt: Runtime, request: Request, body: ClassifyRequest, priority: int | None = None
) -> tuple[list[ClassifyItem], list[list[ScoreResult]], int]:
    """The prompts parsed, their results grouped per prompt, the prompt tokens in all."""
    items = await rt.parse(parse_classify, rt, body)
    results = await rt.run(
        request,
        [r for it in items for r in it.requests],
        priority=priority if body.priority is None else body.priority,
    )
    groups = []
    pos = 0
    for it in items:
        groups.append(results[pos : pos + len(it.requests)])
        pos += len(it.requests)
    return items, groups, sum(r.prompt_tokens for r in results)


# ---- /v1/score ----------------------------------------------------------------------------------


def parse_score(rt: Runtime, body: ScoreRequestBody) -> list[ScoreRequest]:
    """One request per item: query + item (item + query with item_first), the shared part marked
    as the cache prefix."""
    items, labels, query = checked_score(body, rt)
    if isinstance(query, str):
        return _text_score_requests(rt, query, cast(list[str], items), labels, body.item_first)
    rt.check_prompt_ids(query, "query")  # once, not once per item
    reqs = []
    for item, label_ids in zip(items, labels, strict=True):
        q, it = tuple(query), tuple(cast(list[int], item))
        ids = it + q if body.item_first else q + it
        shared_len = len(it) if body.item_first else len(q)
        reqs.append(ScoreRequest(ids, label_ids, cache_prefix_len=shared_len or None))
    return reqs


def checked_score(
    body: ScoreRequestBody, limits: CallLimits
) -> tuple[list[str] | list[list[int]], list[tuple[int, ...]], str | list[int]]:
    """A /v1/score body's items, each item's label tokens and the query, after every check that
    needs no model, in one order (also the cluster's gate's, which answers /v1/score through the
    workers' /generate). A text query is tokenized with each item, so the total is bounded here,
    before any of it."""
    items = _score_items(body)
    limits.check_items(len(items), "items")
    labels = _score_labels(body.label_token_ids, len(items))
    limits.check_logprobs(sum(len(x) for x in labels))
    query = _score_query(body, items)
    if isinstance(query, str):
        chars = (len(items) + 1) * len(query) + sum(len(x) for x in items) * (2 if body.item_first else 1)
        limits.check_tokenize(chars, f"a query of {len(query)} characters with each of {len(items)} items")
    return items, labels, query


def checked_generative(body: GenerativeScoringBody, limits: CallLimits) -> tuple[int, ...]:
    """A /generative_scoring body's label tokens (one list for every item), after the checks
    that need no model (also the cluster's gate's)."""
    [labels] = _score_labels(body.label_token_ids, 1)
    limits.check_items(len(body.items), "items")
    limits.check_logprobs(len(body.items) * len(labels))
    return labels


def _score_items(body: ScoreRequestBody) -> list[str] | list[list[int]]:
    """A /v1/score body's items, after the checks of its fields that need no model."""
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
    return (
        [body.items] if isinstance(body.items, str) else cast(list[str] | list[list[int]], list(body.items))
    )


def _score_query(body: ScoreRequestBody, items: list[str] | list[list[int]]) -> str | list[int]:
    """The query (empty when absent), of the items' kind: text with text, token ids with ids."""
    query = body.query
    if query is None:
        query = [] if items and isinstance(items[0], list) else ""
    if isinstance(query, str):
        if items and not all(isinstance(x, str) for x in items):
            raise bad("a text query needs text items")
    elif items and not all(isinstance(x, list) for x in items):
        raise bad("a token-id query needs token-id items")
    return query


def score_values(body: ScoreRequestBody, logprobs: Sequence[float]) -> list[float]:
    """One item's scores from its label tokens' log-probs: softmax over the labels (at the
    body's temperature) or each label's probability over the whole vocabulary."""
    if body.apply_softmax:
        return softmax(logprobs, body.temperature)
    return [math.exp(x) for x in logprobs]


def _score_labels(label_token_ids: list[int] | list[list[int]] | None, n_items: int) -> list[tuple[int, ...]]:
    """The label tokens of each item: one list for all, or one list per item."""
    if not label_token_ids:
        raise bad("label_token_ids must be a nonempty list")
    if isinstance(label_token_ids[0], list):
        if len(label_token_ids) != n_items:
            raise bad("label_token_ids must have one list per item")
        labels = [tuple(x) for x in label_token_ids]
    else:
        labels = [tuple(label_token_ids)] * n_items
    for ls in labels:
        if not ls:
            raise bad("each item must have a nonempty label_token_ids list")
        if len(set(ls)) != len(ls):
            raise bad("label_token_ids must not contain duplicate tokens")
    return labels


def _text_score_requests(
    rt: Runtime, query: str, items: Sequence[str], labels: Sequence[tuple[int, ...]], item_first: bool
) -> list[ScoreRequest]:
    # Each prompt is tokenized whole (the tokens a direct computation uses), so the query is
    # tokenized once per item (`checked_score` bounded the total); the query alone is tokenized
    # and checked first, so one too long is refused without touching the items.
    query_ids = rt.encode(query, add_special_tokens=not item_first)
    rt.check_prompt_ids(query_ids, "query")
    prefix_ids = query_ids if not item_first else None
    reqs = []
    for item, label_ids in zip(items, labels, strict=True):
        ids = rt.encode_prompt(f"{item}{query}" if item_first else f"{query}{item}")
        # The shared part's tokens (the query, or the item with item_first) are the cache prefix;
        # a BPE merge across the join can only shorten it.
        shared = prefix_ids if prefix_ids is not None else rt.encode(item)
        reqs.append(ScoreRequest(ids, label_ids, cache_prefix_len=common_prefix(shared, ids)))
    return reqs


def parse_generative(rt: Runtime, body: GenerativeScoringBody) -> list[ScoreRequest]:
    """vLLM joins token ids, not strings; the query's ids are the shared part and the cache
    prefix (unless the item comes first)."""
    labels = checked_generative(body, rt)
    q = tuple(body.query) if isinstance(body.query, list) else rt.encode(body.query, body.add_special_tokens)
    rt.check_prompt_ids(q, "query")  # once, before any item
    reqs = []
    for item in body.items:
        it = tuple(item) if isinstance(item, list) else rt.encode(item, add_special_tokens=False)
        ids = it + q if body.item_first else q + it
        reqs.append(
            ScoreRequest(ids, labels, cache_prefix_len=(len(it) if body.item_first else len(q)) or None)
        )
    return reqs


# ---- /v1/classify -------------------------------------------------------------------------------


def launch_classify_request(rt: Runtime, body: LaunchClassifyBody, labels: list[str]) -> ClassifyRequest:
    """The launch labels over the launch template (`{input}` placeholder): the template's text
    before the input, up to its last non-space character, is tokenised once and cached (a space
    left at its end would tokenise apart from the word after it). Token ids are taken as the
    whole prompt, the template not applied."""
    if isinstance(body.input, list) and body.input and all(isinstance(x, int) for x in body.input):
        return ClassifyRequest(prompt=body.input, labels=labels)
    texts = [body.input] if isinstance(body.input, str) else list(body.input)
    if not texts:
        raise bad("input is empty")
    rt.check_items(len(texts), "inputs")
    template = getattr(rt.args, "classify_template", "") or "{input}"
    before, after = template.split("{input}", 1)
    k = len(before.rstrip())
    return ClassifyRequest(
        prompt=[before + str(t) + after for t in texts], labels=labels, shared_prefix_len=k or None
    )


@dataclass(frozen=True)
class ClassifyItem:
    """One prompt of a /v1/classify call: its ids, each label's tokens after it, its prefills."""

    ids: tuple[int, ...]
    label_ids: LabelIds
    multi_token: bool
    requests: tuple[ScoreRequest, ...]


def parse_classify(rt: Runtime, body: ClassifyRequest) -> list[ClassifyItem]:
    if len(body.labels) > rt.args.max_labels:
        raise bad(f"{len(body.labels)} labels, more than the limit of {rt.args.max_labels} (--max-labels)")
    if not isinstance(body.prompt, str) and body.prompt and not isinstance(body.prompt[0], int):
        rt.check_items(len(body.prompt), "prompts")
    if any(not x.strip() for x in body.labels) or len(set(body.labels)) != len(body.labels):
        raise bad("labels must be distinct non-empty strings")
    max_tokens = rt.args.max_label_tokens
    for label in body.labels:  # before tokenizing: no label this long fits the token limit
        if len(label) > MAX_CHARS_PER_TOKEN * max_tokens:
            raise bad(
                f"a label of {len(label)} characters is longer than {max_tokens} tokens (--max-label-tokens)"
            )
    p = body.prompt
    n_prompts = 1 if isinstance(p, str) or (p and isinstance(p[0], int)) else len(p)
    rt.check_queue(n_prompts)  # before any tokenizing: never fits, whatever the labels' tokens

    def encode(text: str) -> tuple[int, ...]:
        return rt.encode(text, add_special_tokens=False)

    def derive(end: str) -> LabelIds:
        try:
            label_ids = label_continuations(encode, end, body.labels, body.leading_space)
            check_distinct(body.labels, label_ids)
        except LabelTokenError as e:
            raise bad(str(e)) from e
        longest = max(len(c) for c in label_ids)
        if longest > max_tokens:
            raise bad(
                f"a label has {longest} tokens, more than the limit of {max_tokens} (--max-label-tokens)"
            )
        return label_ids

    labels_after = LabelsByEnd(derive).after

    if isinstance(p, list) and len(p) > 1 and isinstance(p[0], str):
        # Labels of several tokens take one prefill each per prompt: known from the first prompt's
        # labels, checked against the queue before any other prompt or label is tokenized.
        if single_tokens(labels_after(p[0])) is None:
            rt.check_queue(n_prompts * len(body.labels))
    prompts = _classify_prompts(rt, body)
    if not prompts:
        raise bad("prompt is empty")
    items = []
    for ids, text, shared in prompts:
        label_ids = labels_after(text if text is not None else rt.decode(ids[-_TAIL_TOKENS:]))
        # One next-token distribution when every label is its own single token; otherwise one
        # prefill per label over prompt + label (the prompt cached by the first).
        multi = single_tokens(label_ids) is None
        items.append(ClassifyItem(ids, label_ids, multi, label_requests(ids, label_ids, shared, multi)))
    return items


class LabelsByEnd:
    """A call's labels' tokens after each prompt, derived once per distinct prompt end: a label's
    tokens depend on the prompt's end only, so prompts ending alike (a template's "\nAnswer:")
    share one tokenizing of the labels. The short end (`label_key`) stands for the whole
    ANCHOR_CHARS end once it was seen to give the same tokens, checked once per distinct short
    end: a tokenizer whose pieces run from a word into the whitespace after it may split a short
    end otherwise, and then that end's prompts get their whole end's derivation."""

    def __init__(self, derive: Callable[[str], LabelIds]) -> None:
        self.derive = derive
        self.by_end: dict[str, LabelIds] = {}
        self.short_ok: dict[str, bool] = {}

    def ids(self, end: str) -> LabelIds:
        label_ids = self.by_end.get(end)
        if label_ids is None:
            label_ids = self.by_end[end] = self.derive(end)
        return label_ids

    def after(self, text: str) -> LabelIds:
        anchor, key = text[-ANCHOR_CHARS:], label_key(text)
        ok = self.short_ok.get(key)
        if ok is None:
            full = self.ids(anchor)
            try:
                ok = key == anchor or self.ids(key) == full
            except HTTPError:  # the short end refused what the whole end takes
                ok = False
            self.short_ok[key] = ok
        return self.ids(key if ok else anchor)


def _classify_prompts(
    rt: Runtime, body: ClassifyRequest
) -> list[tuple[tuple[int, ...], str | None, int | None]]:
    """(ids, text or None, shared prefix tokens) per prompt."""
    p, k = body.prompt, body.shared_prefix_len
    if isinstance(p, str) or (p and all(isinstance(x, str) for x in p)):
        texts: list[str] = [p] if isinstance(p, str) else list(cast(list[str], p))
        if k is None:
            return [(rt.encode_prompt(t), t, None) for t in texts]
        out: list[tuple[tuple[int, ...], str | None, int | None]] = []
        for t in texts:
            # The shared part is tokenised on its own so its ids are an exact prefix whatever
            # follows (a merge across the boundary would break cache reuse).
            head = rt.encode(t[:k])
            out.append((head + rt.encode(t[k:], add_special_tokens=False), t, len(head)))
        return out
    rows = [cast(list[int], p)] if p and all(isinstance(x, int) for x in p) else cast(list[list[int]], p)
    vocab = rt.service.vocab_size
    for r in rows:  # before anything decodes them (the tokenizer overflows on ids like 2**40)
        bad_ids = [t for t in r if not 0 <= t < vocab]
        if bad_ids:
            raise bad(f"prompt token ids outside the vocabulary [0, {vocab}): {bad_ids[:5]}")
    return [(tuple(r), None, k) for r in rows]


def classification(
    index: int, it: ClassifyItem, group: Sequence[ScoreResult], body: ClassifyRequest
) -> dict[str, Any]:
    """One prompt's answer: the best label, probabilities over the labels, log-scores."""
    if not it.multi_token:
        scores = list(group[0].logprobs)
    else:
        scores = [
            continuation_score(r.input_token_logprobs[-len(c) :], body.choices_method)
            for c, r in zip(it.label_ids, group, strict=True)
        ]
    best = max(range(len(scores)), key=lambda j: scores[j])
    return {
        "index": index,
        "label": body.labels[best],
        "probs": dict(zip(body.labels, softmax(scores), strict=True)),
        "logprobs": {label: json_logprob(s) for label, s in zip(body.labels, scores, strict=True)},
        "label_token_ids": [list(c) for c in it.label_ids],
        "prompt_tokens": len(it.ids),
        "cached_tokens": sum(r.cached_tokens for r in group),
    }
