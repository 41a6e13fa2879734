"""What a forward's hidden rows become: next-token log-probs of labels and prompt tokens (the LM
head), a classifier head's logits, or a pooled embedding. Architecture-independent: heads read
the decoder's `final_hidden` (its final norm, in fp32), whatever the decoder.

Pooling over a cached prefix: a last-token embedding or a classifier reads only the last row, so
the prefix comes from the cache as for label scoring. Mean and first-token pooling need a hidden
state at every prompt position, which a cached prefix never has (the pool keeps K/V only): such
requests are run whole (`prepare` makes them read and store nothing), so their answer is the cold
one by construction.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from po_backend.core.errors import TaskMismatchError
from po_backend.core.request import ScoreRequest, ScoreResult
from po_backend.core.task import ModelTask, mismatch_text
from po_backend.engine.config import ModelConfig

# Hidden rows normed at a time by mean pooling (bounds its fp32 copy, like the LM head's blocks).
POOL_ROWS = 64


class PromptSpan:
    """What a request asked of its prompt positions, gathered block by block from log-softmax
    rows (each row predicts the next prompt token; the row after the last target is the
    next-token distribution and belongs to no position)."""

    def __init__(self, req: ScoreRequest) -> None:
        self.req = req
        self.logprobs: list[float] = []
        self.top: list[list[tuple[int, float]]] = []
        self.ids: list[list[float]] = []

    def add(self, logp: torch.Tensor, targets: torch.Tensor) -> None:
        if self.req.logprob_start_len < 0:
            return
        rows = logp[: targets.numel()]
        self.logprobs += rows.gather(1, targets.to(rows.device)[:, None]).squeeze(1).tolist()
        if self.req.input_top_k:
            values, ids = rows.topk(self.req.input_top_k, dim=-1)
            self.top += [
                list(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
            ]
        if self.req.input_token_ids:
            cols = torch.tensor(self.req.input_token_ids, dtype=torch.int64, device=rows.device)
            self.ids += rows[:, cols].tolist()


def score_result(
    req: ScoreRequest, last: torch.Tensor, span: PromptSpan, cached: int, last_logits: torch.Tensor
) -> ScoreResult:
    """The result of one request from the log-softmax of its last position (labels, top-k), the
    same position's raw logits (labels) and its prompt positions; the engine and the transformers
    baseline both answer through it."""
    labels = torch.tensor(req.label_token_ids, dtype=torch.int64, device=last.device)
    top: list[tuple[int, float]] = []
    if req.top_k:
        values, ids = last.topk(req.top_k)
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return ScoreResult(
        logprobs=last[labels].tolist(),
        label_logits=last_logits[labels].float().tolist(),
        top_logprobs=top,
        input_token_logprobs=span.logprobs,
        input_top_logprobs=span.top,
        input_token_ids_logprobs=span.ids,
        prompt_tokens=len(req.input_ids),
        cached_tokens=cached,
    )


def check_task(req: ScoreRequest, task: ModelTask) -> None:
    """A request the model's task cannot answer is a 400 naming the routes it serves."""
    if task.pooled and not req.pool:
        raise TaskMismatchError(mismatch_text(task.kind, "next-token log-probs (label tokens, top-k, text)"))
    if req.pool and not task.pooled:
        raise TaskMismatchError(mismatch_text(task.kind, "a pooled output (embedding or classifier head)"))
    if req.pool and (
        req.label_token_ids
        or req.top_k
        or req.logprob_start_len >= 0
        or req.input_top_k
        or req.input_token_ids
    ):
        raise TaskMismatchError(
            mismatch_text(task.kind, "a pooled request asks for no label tokens, top-k or prompt log-probs")
        )


def prepare(req: ScoreRequest, task: ModelTask) -> ScoreRequest:
    """The request as the engine runs it. A classifier reads transformers' row, the last token
    that is not `pad_token_id` (the first when all are): a causal model's state there ignores the
    pads after it, so they are dropped. Mean and first-token pooling compute every row (module doc)."""
    if not req.pool:
        return req
    ids = req.input_ids
    if task.kind == "classify" and task.pad_token_id is not None:
        k = len(ids)
        while k > 1 and ids[k - 1] == task.pad_token_id:
            k -= 1
        if k < len(ids):
            c = req.cache_prefix_len
            req = replace(req, input_ids=ids[:k], cache_prefix_len=None if c is None else min(c, k))
    if task.kind == "embed" and task.pooling != "last":
        req = replace(req, logprob_start_len=0, cache_prefix_len=0)
    return req


def pooled_result(
    model: Any, task: ModelTask, req: ScoreRequest, hidden: torch.Tensor, cached: int
) -> ScoreResult:
    """A pooled request's answer from its hidden rows (the last row; every row for mean and
    first-token pooling, see `prepare`)."""
    out = pooled(model, task, hidden).tolist()
    return ScoreResult(logprobs=[], prompt_tokens=len(req.input_ids), cached_tokens=cached, outputs=out)


def pooled(model: Any, task: ModelTask, hidden: torch.Tensor) -> torch.Tensor:
    """[hidden] fp32: the classifier's logits, or the embedding (normalised as configured)."""
    if task.kind == "classify":
        return (model.final_hidden(hidden[-1:]) @ model.score.float().t())[0]
    if task.pooling == "mean":
        total = torch.zeros(hidden.shape[1], dtype=torch.float32, device=hidden.device)
        for a in range(0, hidden.shape[0], POOL_ROWS):
            total += model.final_hidden(hidden[a : a + POOL_ROWS]).sum(0)
        v = total / hidden.shape[0]
    else:
        v = model.final_hidden(hidden[:1] if task.pooling == "cls" else hidden[-1:])[0]
    return torch.nn.functional.normalize(v, dim=0) if task.normalize else v


def pool_bytes(cfg: ModelConfig, task: ModelTask, dtype: torch.dtype, n_tokens: int) -> int:
    """What a pooled head allocates: the fp32 copy of the score weight, one block of normed rows,
    the running sum, and for mean / first-token pooling the runner's output row of every token."""
    if not task.pooled:
        return 0
    it = torch.empty((), dtype=dtype).element_size()
    rows = it * n_tokens * cfg.hidden_size if task.kind == "embed" and task.pooling != "last" else 0
    head = 4 * task.num_labels * cfg.hidden_size
    return rows + head + (4 + it) * POOL_ROWS * cfg.hidden_size + 4 * 4 * cfg.hidden_size
