"""Rerank APIs over yes/no label scoring: SGLang's `/v1/rerank`, vLLM/Jina's `/rerank` and
Cohere's `/v2/rerank`.

Every document becomes one prompt of the reranker template (Qwen3-Reranker's format by default:
a judge instruction, `<Instruct>`, `<Query>`, `<Document>`, answer "yes" or "no"), and its score is
P(yes) / (P(yes) + P(no)) from the next-token distribution. The template puts the query before the
document, so everything up to the document is the same for all of a call's documents: it is
declared as the cache prefix, and the scheduler runs the documents as one multi-item forward over
it (the first document computes and caches it when it is new). The same text prefix is what the
SGLang router's cache_aware policy sees, so one query's calls stay on one worker.

`--rerank-preset` (po_backend/server/rerank_presets.py) lays prompts out and scores them as
Qwen3-Reranker's, bge-reranker-v2-gemma's or mxbai-rerank-v2's reference code does; by default the
preset the model folder names, if any. `--rerank-template` replaces the template: any text with `{query}` before `{doc}` (and optionally
`{instruct}` before `{query}`); other braces are literal. By default the user turn is wrapped in
the model's chat template (with the judge line as the system turn), or left plain when the model
has none.
"""

from __future__ import annotations

import heapq
import math
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from po_backend.core.labels import (
    LabelIds,
    LabelTokenError,
    check_distinct,
    continuation_score,
    label_continuations,
    label_requests,
    single_tokens,
)
from po_backend.core.request import ScoreRequest, ScoreResult, common_prefix
from po_backend.server import heads, rerank_presets
from po_backend.server.body import BodyRoute
from po_backend.server.context import Runtime, RuntimeDep
from po_backend.server.errors import bad, validated
from po_backend.server.protocol import TolerantBody
from po_backend.server.rerank_presets import RerankPreset
from po_backend.server.translate import softmax

router = APIRouter(route_class=BodyRoute)

SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
USER = "<Instruct>: {instruct}\n<Query>: {query}\n<Document>: {doc}"
# Qwen3-Reranker's default instruction, used when a call sends none.
DEFAULT_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
ANSWERS = ("yes", "no")
PLACEHOLDERS = ("{instruct}", "{query}", "{doc}")


# ---- request bodies -----------------------------------------------------------------------------


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str = "text"
    text: str | None = None


class DocumentObject(BaseModel):
    """vLLM/Jina's `{"text": ...}` document."""

    model_config = ConfigDict(extra="ignore")
    text: str


Document = str | DocumentObject | list[TextPart]


class SGLangRerankBody(TolerantBody):
    """SGLang's `V1RerankReqInput` (text only)."""

    query: str | list[TextPart]
    documents: list[Document]
    instruct: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    model: str | None = None
    priority: StrictInt | None = None  # scheduled by it with --enable-priority-scheduling


class CohereRerankBody(TolerantBody):
    """vLLM/Jina's `RerankRequest` and Cohere's v2 rerank: `top_n` 0 or absent returns all."""

    query: str
    documents: list[Document]
    model: str | None = None
    top_n: int | None = Field(default=None, ge=0)
    return_documents: bool = True  # vLLM always returns them; Jina and Cohere v1 default to it
    max_tokens_per_doc: int | None = Field(default=None, ge=1)  # Cohere: truncate longer documents
    instruct: str | None = None  # ours (and SGLang's), for instruction-tuned rerankers
    priority: StrictInt | None = None  # vLLM's; scheduled by it with --enable-priority-scheduling


# ---- the template -------------------------------------------------------------------------------


@dataclass(frozen=True)
class RerankTemplate:
    """A reranker prompt with `{instruct}`, `{query}` and `{doc}` placeholders, split around them.

    `add_special_tokens` is False when the text already starts with the tokenizer's BOS (a chat
    template that writes it), so it is not doubled.
    """

    text: str
    add_special_tokens: bool = True

    def __post_init__(self) -> None:
        check_template(self.text)

    def prompt_parts(self, instruct: str, query: str) -> tuple[str, str]:
        """(everything before the document with the query filled in, everything after it)."""
        before, after = self.text.split("{doc}")
        return before.replace("{instruct}", instruct).replace("{query}", query), after


def check_template(text: str) -> None:
    """`{query}` and `{doc}` once each, query first; `{instruct}` at most once, before the query
    (so the text before the document is the same for all of a query's documents)."""
    counts = {p: text.count(p) for p in PLACEHOLDERS}
    if counts["{query}"] != 1 or counts["{doc}"] != 1 or counts["{instruct}"] > 1:
        raise ValueError(
            "a rerank template needs {query} and {doc} exactly once (and {instruct} at most once), "
            f"got {counts}"
        )
    if text.index("{query}") > text.index("{doc}"):
        raise ValueError("a rerank template must put {query} before {doc} (the shared cache prefix)")
    if counts["{instruct}"] and text.index("{instruct}") > text.index("{query}"):
        raise ValueError("a rerank template must put {instruct} before {query}")


def default_template(tokenizer: Any) -> RerankTemplate:
    """Qwen3-Reranker's turns in the model's chat template; plain text for models without one."""
    bos = getattr(tokenizer, "bos_token", None)
    if getattr(tokenizer, "chat_template", None):
        for messages in (
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}],
            # Templates that refuse a system turn get the judge line at the top of the user turn.
            [{"role": "user", "content": SYSTEM + "\n" + USER}],
        ):
            try:
                # enable_thinking=False: Qwen3's template then writes the empty think block that
                # Qwen3-Reranker was trained with; other templates ignore the variable.
                text = tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
                )
            except Exception:  # jinja raises whatever the template's author chose
                continue
            if isinstance(text, str) and all(text.count(p) == 1 for p in PLACEHOLDERS):
                return RerankTemplate(text, add_special_tokens=not (bos and text.startswith(bos)))
    return RerankTemplate(SYSTEM + "\n" + USER + "\nAnswer:")


_TEMPLATES: weakref.WeakKeyDictionary[Runtime, RerankTemplate] = weakref.WeakKeyDictionary()


def template_for(rt: Runtime) -> RerankTemplate:
    """The server's template (its flag, or the default for its tokenizer), built once."""
    tpl = _TEMPLATES.get(rt)
    if tpl is None:
        text = getattr(rt.args, "rerank_template", "")
        tpl = _TEMPLATES[rt] = RerankTemplate(text) if text else default_template(rt.tokenizer)
    return tpl


_PRESETS: weakref.WeakKeyDictionary[Runtime, tuple[RerankPreset, tuple[int, ...]] | None] = (
    weakref.WeakKeyDictionary()
)


def check_preset(rt: Runtime) -> tuple[RerankPreset, tuple[int, ...]] | None:
    """The server's preset and its answer token ids (None: a template or a score head), found
    once, when the app is built: a preset named for a model that scores with its head, or one
    whose answer tokens the vocabulary lacks, is a ValueError there, never each call's 400."""
    if rt in _PRESETS:
        return _PRESETS[rt]
    found = None
    setting = getattr(rt.args, "rerank_preset", "auto")
    if rt.task.kind != "generate":
        if setting not in ("auto", "none"):
            raise ValueError(
                f"--rerank-preset {setting}: this is a {rt.task.kind} model, which reranks with its "
                "head; presets lay out prompts for causal LMs that answer with label tokens"
            )
    elif not getattr(rt.args, "rerank_template", ""):
        preset = rerank_presets.choose(setting, rt.args.model_path)
        if preset is not None:
            if rt.tokenizer is None:  # a token-ids-only service: rerank needs text anyway
                return None
            found = (preset, rerank_presets.answer_ids(preset, rt.tokenizer))
    _PRESETS[rt] = found
    return found


def preset_for(rt: Runtime) -> tuple[RerankPreset, tuple[int, ...]] | None:
    """`check_preset`'s answer (an app built without it finds it here, a ValueError a 400)."""
    try:
        return check_preset(rt)
    except ValueError as e:
        raise bad(str(e)) from e


# ---- parse --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RerankCall:
    """One call's prefills: per document, its answers' tokens and the requests that score them."""

    label_ids: LabelIds
    multi_token: bool
    requests: tuple[tuple[ScoreRequest, ...], ...]  # one group per document
    score: rerank_presets.Score = "pair"  # "logit": the first answer's raw logit, sigmoid-normalised


def document_text(doc: Document) -> str:
    if isinstance(doc, str):
        return doc
    if isinstance(doc, DocumentObject):
        return doc.text
    if any(p.type != "text" or p.text is None for p in doc):
        raise bad("only text documents are supported (no image or video parts)")
    return " ".join(p.text or "" for p in doc)


def build_call(rt: Runtime, query: str, docs: Sequence[str], instruct: str | None) -> RerankCall:
    """Each document's prompt tokenised whole (the tokens a direct computation would use); the
    part before the document, up to its last non-space character, declared as the cache prefix
    (a BPE merge across the join could only shorten the shared ids, never make them differ)."""
    if not query.strip():
        raise bad("query must be a non-empty string")
    if not docs:
        raise bad("documents must be a non-empty list")
    rt.check_items(len(docs), "documents")
    if any(not d.strip() for d in docs):
        raise bad("each document must be a non-empty string")
    preset = preset_for(rt)
    if preset is not None:
        return preset_call(rt, *preset, query, docs, instruct)
    tpl = template_for(rt)
    before, after = tpl.prompt_parts(DEFAULT_INSTRUCT if instruct is None else instruct, query)
    # Each document's prompt is tokenized whole, the query within it: bounded before any of it,
    # and the shared part alone tokenized and checked first.
    rt.check_tokenize(
        (len(docs) + 1) * (len(before) + len(after)) + sum(len(d) for d in docs),
        f"a query of {len(query)} characters in the prompt of each of {len(docs)} documents",
    )
    head = before.rstrip()
    shared = rt.encode(head, add_special_tokens=tpl.add_special_tokens)
    rt.check_prompt_ids(shared, "query (in the rerank template)")
    texts = [before + d + after for d in docs]
    try:
        label_ids = label_continuations(
            lambda s: rt.encode(s, add_special_tokens=False), texts[0], ANSWERS, None
        )
        check_distinct(ANSWERS, label_ids)
    except LabelTokenError as e:
        raise bad(f"the rerank template's end does not fit the answers yes/no: {e}") from e
    multi = single_tokens(label_ids) is None
    groups = []
    for text in texts:
        ids = rt.encode(text, add_special_tokens=tpl.add_special_tokens)
        groups.append(label_requests(ids, label_ids, common_prefix(shared, ids), multi))
    return RerankCall(label_ids, multi, tuple(groups))


def preset_call(
    rt: Runtime,
    preset: RerankPreset,
    answers: tuple[int, ...],
    query: str,
    docs: Sequence[str],
    instruct: str | None,
) -> RerankCall:
    """Each document's prompt as the preset's reference code builds it, one request reading the
    answers' next-token log-probs and logits; the call's common head declared as the cache prefix."""

    def encode(s: str) -> tuple[int, ...]:
        return rt.encode(s, add_special_tokens=False)

    bos = getattr(rt.tokenizer, "bos_token_id", None)
    shared = rerank_presets.head_ids(preset, encode, bos, instruct, query)
    groups = []
    for doc in docs:
        ids = rerank_presets.prompt_ids(preset, encode, bos, instruct, query, doc)
        groups.append(label_requests(ids, tuple((a,) for a in answers), common_prefix(shared, ids), False))
    return RerankCall(tuple((a,) for a in answers), False, tuple(groups), preset.score)


def relevance(call: RerankCall, group: Sequence[ScoreResult]) -> float:
    """P(yes) / (P(yes) + P(no)) (Qwen3-Reranker's score), from log-probs so it never divides
    by an underflowed zero. A "logit" preset: the sigmoid of its one answer's raw logit."""
    if call.score == "logit":
        return sigmoid(group[0].label_logits[0])
    if not call.multi_token:
        scores = list(group[0].logprobs)
    else:
        scores = [
            continuation_score(r.input_token_logprobs[-len(c) :], "sum")
            for c, r in zip(call.label_ids, group, strict=True)
        ]
    return softmax(scores)[0]


@dataclass(frozen=True)
class Ranked:
    index: int
    score: float
    prompt_tokens: int
    cached_tokens: int


async def rerank(
    rt: Runtime,
    request: Request,
    query: str,
    docs: Sequence[str],
    instruct: str | None,
    priority: int | None = None,
) -> list[Ranked]:
    """Each document's relevance, in the documents' order; all submitted together."""
    if heads.is_head(rt, "rerank"):
        scored = await heads.rerank_scores(rt, request, query, docs, priority)
        return [Ranked(i, heads.relevance(r), r.prompt_tokens, r.cached_tokens) for i, r in enumerate(scored)]
    call = await rt.parse(build_call, rt, query, docs, instruct)
    results = await rt.run(request, [r for g in call.requests for r in g], priority=priority)
    out = []
    pos = 0
    for i, g in enumerate(call.requests):
        group = results[pos : pos + len(g)]
        pos += len(g)
        out.append(
            Ranked(i, relevance(call, group), group[0].prompt_tokens, sum(r.cached_tokens for r in group))
        )
    return out


def top(ranked: Sequence[Ranked], n: int | None) -> list[Ranked]:
    """Best first (ties in document order); the n best when n is set."""
    if n:
        return heapq.nlargest(n, ranked, key=lambda r: r.score)
    return sorted(ranked, key=lambda r: -r.score)


# ---- endpoints ----------------------------------------------------------------------------------


# Cohere's SDK names itself in this header; its v1 client posts Cohere's rerank to /v1/rerank,
# SGLang's route, with a body SGLang's parses alike: only the header tells which answer it reads.
SDK_HEADER = "x-fern-sdk-name"


def from_cohere_sdk(sdk_name: str | bytes | None) -> bool:
    """Whether a call's `SDK_HEADER` names Cohere's SDK."""
    name = sdk_name.decode("latin-1") if isinstance(sdk_name, bytes) else sdk_name or ""
    return name.strip().lower() == "cohere"


@router.post("/v1/rerank")
async def sglang_rerank(body: SGLangRerankBody, request: Request, rt: RuntimeDep) -> Any:
    """SGLang's shape: a JSON list of `{score, document?, index, meta_info}`, best first (the
    SGLang router builds its own reply from exactly this); Cohere's for Cohere's v1 client."""
    if from_cohere_sdk(request.headers.get(SDK_HEADER)):
        cohere_body = validated(CohereRerankBody, await request.json())
        return await cohere_rerank(cohere_body, request, rt)
    rt.check_items(len(body.documents), "documents")
    query = body.query if isinstance(body.query, str) else document_text(body.query)
    docs = [document_text(d) for d in body.documents]
    ranked = await rerank(rt, request, query, docs, body.instruct, body.priority)
    out = []
    for r in top(ranked, body.top_n):
        item: dict[str, Any] = {"score": r.score, "index": r.index}
        if body.return_documents:
            item["document"] = docs[r.index]
        item["meta_info"] = {"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens}
        out.append(item)
    return JSONResponse(out)


@router.post("/rerank")
@router.post("/v2/rerank")
async def cohere_rerank(body: CohereRerankBody, request: Request, rt: RuntimeDep) -> dict[str, Any]:
    """vLLM/Jina's and Cohere v2's shape: `{id, model, usage, results: [{index, relevance_score,
    document?}]}`, best first."""
    rt.check_items(len(body.documents), "documents")  # before anything is truncated
    docs = [document_text(d) for d in body.documents]
    if body.max_tokens_per_doc is not None:
        docs = await rt.parse(_truncate_all, rt, docs, body.max_tokens_per_doc)
    ranked = await rerank(rt, request, body.query, docs, body.instruct, body.priority)
    return cohere_answer(body, docs, ranked, rt.args.model_name)


def cohere_answer(
    body: CohereRerankBody, docs: Sequence[str], ranked: Sequence[Ranked], model: str
) -> dict[str, Any]:
    """The vLLM/Jina/Cohere answer to `body` from its documents' relevance (also what the
    cluster's gate answers from the router's SGLang-shaped reply)."""
    results = []
    for r in top(ranked, body.top_n):
        item: dict[str, Any] = {"index": r.index, "relevance_score": r.score}
        if body.return_documents:
            item["document"] = {"text": docs[r.index]}
        results.append(item)
    tokens = sum(r.prompt_tokens for r in ranked)
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": body.model or model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": results,
    }


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _truncate_all(rt: Runtime, docs: Sequence[str], max_tokens: int) -> list[str]:
    """Cohere's `max_tokens_per_doc`: each document's first tokens, as text (on the parse pool:
    the tokenizer's work, like every other)."""
    return [_truncate(rt, d, max_tokens) for d in docs]


def _truncate(rt: Runtime, doc: str, max_tokens: int) -> str:
    ids = rt.encode(doc, add_special_tokens=False)
    return doc if len(ids) <= max_tokens else rt.decode(ids[:max_tokens])
