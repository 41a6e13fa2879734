"""vLLM's offline pooling API on our engine: `LLM.embed`, `LLM.classify`, `LLM.score` and
`LLM.encode`, with vLLM's output objects (`.outputs.embedding`, `.outputs.probs`,
`.outputs.score`, `.outputs.data`, `.prompt_token_ids`), so vLLM pooling code runs by changing
the import:

    from po_backend.compat.vllm import LLM          # instead of: from vllm import LLM
    llm = LLM(model="path/to/Qwen3-Embedding", runner="pooling")
    vecs = [o.outputs.embedding for o in llm.embed(["Instruct: ...\\nQuery: cats"])]

Keyword arguments are vLLM's engine arguments (`task`, `runner`, `convert`, `max_model_len`,
`enable_prefix_caching`, `gpu_memory_utilization`, ...) or ours, mapped by `core.settings.resolve`
as the server's flags are. `score` follows vLLM: a classifier head scores each (text_1, text_2)
pair (one logit: its sigmoid; more: the last label's probability, the "relevant" class of
two-label cross-encoders), an embedder gives the cosine similarity of the two embeddings;
one text_1 is paired with every text_2. Several prompts that share leading tokens (an
instruction, the query of a score) share them as the cache prefix.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from po_backend.compat.local_runtime import LocalRuntime
from po_backend.core.errors import InvalidRequestError
from po_backend.core.request import ScoreRequest, ScoreResult, pooled_requests
from po_backend.core.task import ModelTask, probabilities

Prompts = str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]]


@dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]


@dataclass(frozen=True)
class ClassificationOutput:
    probs: list[float]


@dataclass(frozen=True)
class ScoringOutput:
    score: float


@dataclass(frozen=True)
class PoolingOutput:
    data: list[float]


@dataclass(frozen=True)
class PoolingRequestOutput:
    """vLLM's `PoolingRequestOutput` (and its Embedding/Classification/Scoring variants)."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = True


class LLM:
    """vLLM's `LLM` for pooling models (embedders, classifier / reranker / reward heads)."""

    def __init__(
        self, model: str | os.PathLike[str] | None = None, runtime: LocalRuntime | None = None, **kwargs: Any
    ) -> None:
        self.runtime = runtime if runtime is not None else LocalRuntime.launch(model, **kwargs)
        self._ids = 0

    @property
    def task(self) -> ModelTask:
        return self.runtime.scorer.task

    def _prompts(self, prompts: Prompts) -> list[tuple[int, ...]]:
        return [
            self.runtime.encode(p) if isinstance(p, str) else tuple(int(t) for t in p)
            for p in _as_list(prompts)
        ]

    def _run(self, reqs: list[ScoreRequest], kind: str) -> list[ScoreResult]:
        if self.task.kind not in kind.split("|"):
            raise InvalidRequestError(
                f"this model is served for task {self.task.kind!r}; this call needs {kind} "
                "(pass task= / runner='pooling' / convert=...)"
            )
        return self.runtime.run(reqs)

    def _out(self, req: ScoreRequest, res: ScoreResult, outputs: Any) -> PoolingRequestOutput:
        self._ids += 1
        return PoolingRequestOutput(str(self._ids), outputs, list(req.input_ids), res.cached_tokens)

    def embed(self, prompts: Prompts) -> list[PoolingRequestOutput]:
        reqs = pooled_requests(self._prompts(prompts))
        return [
            self._out(q, r, EmbeddingOutput(r.outputs))
            for q, r in zip(reqs, self._run(reqs, "embed"), strict=True)
        ]

    def classify(self, prompts: Prompts) -> list[PoolingRequestOutput]:
        reqs = pooled_requests(self._prompts(prompts))
        results = self._run(reqs, "classify")
        probs = [probabilities(self.task, r.outputs) for r in results]
        return [
            self._out(q, r, ClassificationOutput(p)) for q, r, p in zip(reqs, results, probs, strict=True)
        ]

    def encode(self, prompts: Prompts) -> list[PoolingRequestOutput]:
        """Raw pooled outputs: an embedder's vectors, a classifier head's logits."""
        reqs = pooled_requests(self._prompts(prompts))
        return [
            self._out(q, r, PoolingOutput(r.outputs))
            for q, r in zip(reqs, self._run(reqs, "embed|classify"), strict=True)
        ]

    def score(self, text_1: Prompts, text_2: Prompts) -> list[PoolingRequestOutput]:
        firsts, seconds = _as_list(text_1), _as_list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        if len(firsts) != len(seconds):
            raise InvalidRequestError(
                f"text_1 has {len(firsts)} prompts and text_2 {len(seconds)}: give one or as many"
            )
        if self.task.kind == "classify":
            reqs = []
            for x, y in zip(firsts, seconds, strict=True):
                (a,) = self._prompts([x])
                b = self.runtime.encode(y, add_special_tokens=False) if isinstance(y, str) else tuple(y)
                reqs.append(
                    ScoreRequest(a + b, pool=True, cache_prefix_len=min(len(a), len(a) + len(b) - 1) or None)
                )
            results = self._run(reqs, "classify")
            return [
                self._out(q, r, ScoringOutput(probabilities(self.task, r.outputs)[-1]))
                for q, r in zip(reqs, results, strict=True)
            ]
        a_ids, b_ids = self._prompts(firsts), self._prompts(seconds)
        vecs = [r.outputs for r in self._run(pooled_requests([*a_ids, *b_ids]), "embed")]
        n = len(a_ids)
        out = []
        for i, (x, y) in enumerate(zip(a_ids, b_ids, strict=True)):
            q = ScoreRequest(x + y, pool=True)
            out.append(
                self._out(
                    q,
                    ScoreResult([], prompt_tokens=len(x) + len(y)),
                    ScoringOutput(_cosine(vecs[i], vecs[n + i])),
                )
            )
        return out

    def shutdown(self) -> None:
        self.runtime.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_list(p: Prompts) -> list[Any]:
    return [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)


def _cosine(x: Sequence[float], y: Sequence[float]) -> float:
    dot = math.fsum(a * b for a, b in zip(x, y, strict=True))
    nx, ny = math.sqrt(math.fsum(a * a for a in x)), math.sqrt(math.fsum(b * b for b in y))
    return dot / (nx * ny) if nx and ny else 0.0
