"""Pooled outputs: OpenAI's `/v1/embeddings` (an embedder) and vLLM's `/pooling` (an embedder's
vectors or a classifier head's raw logits).

Inputs come in OpenAI's four shapes: a string, a list of strings, one prompt's token ids, a list
of token-id lists. The token ids every input of one call shares (an instruction such as
"Instruct: ...\\nQuery: ") are declared as the cache prefix, so it is computed once for all of
them, and read from the prefix cache by later calls (last-token pooling; see engine.outputs for
mean pooling). `dimensions` truncates each vector to its first dimensions (Matryoshka) and
renormalises it when the model normalises; `encoding_format` "base64" sends little-endian
float32 bytes, as OpenAI does (the openai client asks for it by default).
"""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import Field, StrictInt

from po_backend.core.request import ScoreResult, pooled_requests
from po_backend.core.task import ModelTask, mismatch_text
from po_backend.server.body import BodyRoute
from po_backend.server.context import Runtime, RuntimeDep
from po_backend.server.errors import bad
from po_backend.server.protocol import IntList, TolerantBody
from po_backend.server.translate import envelope

router = APIRouter(route_class=BodyRoute)

Inputs = str | list[str] | IntList | list[IntList]


class EmbeddingBody(TolerantBody):
    """OpenAI's `EmbeddingCreateParams` (vLLM's and SGLang's too)."""

    input: Inputs
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's
    priority: StrictInt | None = None  # vLLM's; scheduled by it with --enable-priority-scheduling


class PoolingBody(EmbeddingBody):
    """vLLM's `PoolingRequest`: the same inputs, raw pooled outputs."""


def require(rt: Runtime, kinds: Sequence[str], route: str) -> ModelTask:
    """The model's task when `route` fits it, else a 400 naming the routes it serves."""
    task = rt.task
    if task.kind not in kinds:
        raise bad(mismatch_text(task.kind, route))
    return task


def prompts(rt: Runtime, raw: Inputs, add_special_tokens: bool = True) -> list[tuple[int, ...]]:
    """OpenAI's four input shapes as token-id prompts."""
    if isinstance(raw, str):
        raw = [raw]
    if not raw:
        raise bad("input is empty")
    if all(isinstance(x, int) for x in raw):
        rows: list[Any] = [raw]
    else:
        rows = list(raw)
    rt.check_items(len(rows), "inputs")
    out = []
    for r in rows:
        if isinstance(r, str):
            if not r:
                raise bad("an input is an empty string")
            out.append(rt.encode(r, add_special_tokens=add_special_tokens))
        elif isinstance(r, list) and all(isinstance(t, int) for t in r):
            out.append(tuple(r))
        else:
            raise bad("input must be a string, a list of strings, token ids or a list of token-id lists")
    return out


def truncate(vec: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    """Matryoshka: the first `dimensions` values, renormalised when the model's vectors are."""
    if dimensions is None:
        return vec
    if dimensions > len(vec):
        raise bad(f"dimensions={dimensions} is more than the model's {len(vec)}")
    out = vec[:dimensions]
    if normalize:
        norm = math.sqrt(sum(x * x for x in out)) or 1.0
        out = [x / norm for x in out]
    return out


def encode_vector(vec: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vec)}f", *vec)).decode()
    return vec


async def run_pooled(rt: Runtime, request: Request, body: EmbeddingBody) -> list[ScoreResult]:
    ids = await rt.parse(prompts, rt, body.input, body.add_special_tokens)
    return await rt.run(request, pooled_requests(ids), priority=body.priority)


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingBody, request: Request, rt: RuntimeDep) -> dict[str, Any]:
    task = require(rt, ("embed",), "/v1/embeddings needs an embedding model (--task embed)")
    width = int(getattr(rt.service, "hidden_size", 0) or 0)
    if body.dimensions is not None and width and body.dimensions > width:
        raise bad(f"dimensions={body.dimensions} is more than the model's {width}")
    results = await run_pooled(rt, request, body)
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": encode_vector(
                truncate(r.outputs, body.dimensions, task.normalize), body.encoding_format
            ),
        }
        for i, r in enumerate(results)
    ]
    tokens = sum(r.prompt_tokens for r in results)
    out = envelope("embd", "list", body.model or rt.args.model_name, "data", data, tokens)
    out["usage"] = {"prompt_tokens": tokens, "total_tokens": tokens}
    return out


@router.post("/pooling")
async def pooling(body: PoolingBody, request: Request, rt: RuntimeDep) -> dict[str, Any]:
    """vLLM's raw pooled outputs: an embedder's vectors, a classifier head's logits."""
    require(rt, ("embed", "classify"), "/pooling needs an embedding or classifier model (--task pooling)")
    if body.dimensions is not None:
        raise bad("dimensions applies to /v1/embeddings only")
    results = await run_pooled(rt, request, body)
    data = [
        {"index": i, "object": "pooling", "data": encode_vector(r.outputs, body.encoding_format)}
        for i, r in enumerate(results)
    ]
    return envelope(
        "pool", "list", body.model or rt.args.model_name, "data", data, sum(r.prompt_tokens for r in results)
    )
