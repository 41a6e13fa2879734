"""Classifier heads (`*ForSequenceClassification`: classifiers, one-logit rerankers, reward
models) on the routes their users call, in place of label-token scoring:

- `/v1/classify`: vLLM's / SGLang's `{input}` form (per input the best label from `id2label`, the
  probabilities in label order, their number) and ours, `{prompt, labels}` (labels must be the
  model's own, in any order);
- `/v1/score`: SGLang's shape, per item the head's probabilities for query + item;
- every rerank route: a one-logit head's sigmoid, over the `--rerank-template` when given, else
  the query's tokens followed by the document's.

Probabilities follow `ModelTask.activation` (softmax, sigmoid for one logit / multi-label, none
for regression). The query (or any part all of a call's items share) is the cache prefix, so the
items run as one multi-item forward over it, as label scoring does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fastapi import Request

from po_backend.core.request import ScoreRequest, ScoreResult, common_prefix, pooled_requests
from po_backend.core.task import mismatch_text, probabilities
from po_backend.server.context import Runtime
from po_backend.server.embeddings import Inputs, prompts
from po_backend.server.errors import bad
from po_backend.server.translate import envelope


def is_head(rt: Runtime, route: str) -> bool:
    """Whether the model is a classifier head (this module answers `route`); an embedder gets
    the 400 that names its routes."""
    kind = rt.task.kind
    if kind == "embed":
        raise bad(mismatch_text(kind, f"{route} needs a causal LM or a classifier head"))
    return kind == "classify"


def probs_of(rt: Runtime, results: Sequence[ScoreResult]) -> list[list[float]]:
    return [probabilities(rt.task, r.outputs) for r in results]


def best(rt: Runtime, probs: list[float]) -> str:
    return rt.task.labels[max(range(len(probs)), key=lambda j: probs[j])]


async def classify_input(
    rt: Runtime, request: Request, raw: Inputs, model: str, priority: int | None = None
) -> dict[str, Any]:
    """vLLM's and SGLang's `ClassificationResponse`."""
    ids = await rt.parse(prompts, rt, raw)
    results = await rt.run(request, pooled_requests(ids), priority=priority)
    data = [
        {"index": i, "label": best(rt, p), "probs": p, "num_classes": len(p)}
        for i, p in enumerate(probs_of(rt, results))
    ]
    return envelope("classify", "list", model, "data", data, sum(r.prompt_tokens for r in results))


async def classify_labels(
    rt: Runtime,
    request: Request,
    items: Sequence[tuple[tuple[int, ...], int | None]],
    labels: Sequence[str],
    model: str,
    priority: int | None = None,
) -> dict[str, Any]:
    """Ours, `{prompt, labels}`: the labels must be the model's own (any order); each prompt's
    ids with its shared-prefix length, as `scoring.parse_classify` tokenised them."""
    own = rt.task.labels
    if sorted(labels) != sorted(own):
        raise bad(
            f"this model is a classifier with its own labels {list(own)} (id2label); send those "
            "labels (any order) or use the {input} form"
        )
    reqs = [ScoreRequest(ids, pool=True, cache_prefix_len=shared) for ids, shared in items]
    results = await rt.run(request, reqs, priority=priority)
    data = []
    for i, (r, p) in enumerate(zip(results, probs_of(rt, results), strict=True)):
        by_label = dict(zip(own, p, strict=True))
        data.append(
            {
                "index": i,
                "label": best(rt, p),
                "probs": {label: by_label[label] for label in labels},
                "logprobs": {
                    label: math.log(by_label[label]) if by_label[label] > 0 else None for label in labels
                },
                "logits": dict(zip(own, r.outputs, strict=True)),
                "label_token_ids": [],
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
            }
        )
    total = sum(r.prompt_tokens for r in results)
    usage = {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0}
    return {"object": "classification", "model": model, "data": data, "usage": usage}


def pair_requests(
    rt: Runtime, query: str | Sequence[int], items: Sequence[Any], item_first: bool = False
) -> list[ScoreRequest]:
    """query + item per item (item + query with `item_first`): the first part's tokens (with the
    tokenizer's special tokens), then the second's (without), the first as the cache prefix."""
    reqs = []
    for item in items:
        if isinstance(query, str) and isinstance(item, str):
            a, b = (item, query) if item_first else (query, item)
            a_ids, b_ids = rt.encode(a), rt.encode(b, add_special_tokens=False)
        elif not isinstance(query, str) and isinstance(item, list):
            a_ids, b_ids = (tuple(item), tuple(query)) if item_first else (tuple(query), tuple(item))
        else:
            raise bad("query and items must both be text or both be token ids")
        ids = a_ids + b_ids
        if not ids:
            raise bad("an item's prompt is empty")
        reqs.append(ScoreRequest(ids, pool=True, cache_prefix_len=min(len(a_ids), len(ids) - 1) or None))
    return reqs


async def score_items(
    rt: Runtime, request: Request, query: Any, items: Any, item_first: bool, priority: int | None = None
) -> list[ScoreResult]:
    items = [items] if isinstance(items, str) else list(items or [])
    if not items:
        raise bad("items must be provided")
    rt.check_items(len(items), "items")
    if query is None:
        query = [] if isinstance(items[0], list) else ""
    reqs = await rt.parse(pair_requests, rt, query, items, item_first)
    return await rt.run(request, reqs, priority=priority)


def template_requests(rt: Runtime, text: str, query: str, docs: Sequence[str]) -> list[ScoreRequest]:
    """The documents over `--rerank-template` (`{query}` before `{doc}`, `{instruct}` empty)."""
    before, after = text.replace("{instruct}", "").split("{doc}")
    before = before.replace("{query}", query)
    shared = rt.encode(before.rstrip())
    reqs = []
    for d in docs:
        ids = rt.encode(before + d + after)
        reqs.append(
            ScoreRequest(
                ids, pool=True, cache_prefix_len=min(common_prefix(shared, ids), len(ids) - 1) or None
            )
        )
    return reqs


async def rerank_scores(
    rt: Runtime, request: Request, query: str, docs: Sequence[str], priority: int | None = None
) -> list[ScoreResult]:
    """Each document's head output over the query (the relevance: `relevance`)."""
    if rt.task.num_labels != 1:
        raise bad(
            f"rerank needs a one-logit head; this classifier has {rt.task.num_labels} labels "
            "(use /v1/classify or /v1/score)"
        )
    if not query.strip() or not docs:
        raise bad("query must be a non-empty string and documents a non-empty list")
    rt.check_items(len(docs), "documents")
    text = getattr(rt.args, "rerank_template", "")
    if text:
        reqs = await rt.parse(template_requests, rt, text, query, docs)
    else:
        reqs = await rt.parse(pair_requests, rt, query, list(docs))
    return await rt.run(request, reqs, priority=priority)


def relevance(r: ScoreResult) -> float:
    """A one-logit reranker's score: the sigmoid of its logit."""
    (x,) = r.outputs
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
