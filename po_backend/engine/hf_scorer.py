"""The baseline behind `launch_server --backend hf`: plain transformers, one request per forward,
no prefix cache, served by the same `EngineLoop` as the engine (policy fcfs). Same request/result
types and the same result extraction as the engine, so the server (and a side-by-side benchmark)
cannot tell the two apart except by speed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from po_backend.core.errors import LoRAError, UnsupportedModelError
from po_backend.core.request import ScoreRequest, ScoreResult, validate_request
from po_backend.engine.config import parse_dtype
from po_backend.engine.device import resolve_device
from po_backend.engine.models.loader import load_tokenizer, read_task, resolve_model_dir
from po_backend.engine.outputs import PromptSpan, score_result
from po_backend.engine.stats import EngineStats


class HFScorer:
    """Scores `ScoreRequest`s with `AutoModelForCausalLM`: `logits_to_keep` limits the LM head to
    the rows that are read (the last one, or the prompt-logprob span), nothing else is special.
    A `serving.scorer.Scorer`: its steps hold one request each and nothing is ever cached."""

    def __init__(self, model: Any, tokenizer: Any, max_input_len: int, model_path: str = "") -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_input_len = max_input_len
        self.model_path = model_path
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self._counts = {"requests": 0, "forwards": 0, "prompt": 0, "computed": 0, "cached": 0}

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str] = "embedded",
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        max_input_len: int | None = None,
    ) -> HFScorer:
        from transformers import AutoModelForCausalLM

        model_dir = resolve_model_dir(path)
        task = read_task(model_dir)
        if task.pooled:  # an LM head is what this baseline scores through
            raise UnsupportedModelError(
                f"backend hf (the transformers baseline) scores label tokens of a causal LM; this model's "
                f"task is {task.kind!r}: serve it with --backend prefillonly"
            )
        dev = resolve_device(device)
        dt = parse_dtype(dtype, dev)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt)
        model = model.to(dev).eval()  # type: ignore[arg-type]  # transformers types .to() as a decorator
        context = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 8192
        return cls(model, load_tokenizer(model_dir), max_input_len or context, model_path=str(path))

    # ---- the loop's Scorer protocol -------------------------------------------------------------

    can_profile_jct = False  # the baseline runs FCFS, which ranks without step times

    def cache_pool(self) -> None:
        return None  # no prefix cache

    def resolved_settings(self) -> dict[str, Any]:
        """What it runs with, by `core.settings.Settings` field name."""
        return {
            "task": "generate",
            "dtype": str(next(self.model.parameters()).dtype),
            "device": str(self.device),
            "max_input_len": int(self.max_input_len),
            "enable_cache": False,
        }

    def validate(self, req: ScoreRequest) -> None:
        """The engine's checks, so both backends reject the same requests with the same errors."""
        validate_request(req, self.vocab_size, self.max_input_len)
        if req.lora is not None:  # never run the base model silently in an adapter's place
            raise LoRAError(f"LoRA adapter {req.lora!r} asked for, but backend hf serves no adapters")

    def cached_len(self, req: ScoreRequest) -> int:
        return 0  # no prefix cache

    def batchable(self, candidates: Sequence[ScoreRequest]) -> list[tuple[int, int]]:
        return [(0, 0)]  # one request per forward: the baseline as transformers users run it

    def cache_changes(self) -> list[tuple[int, ...]]:
        return []  # no prefix cache: nothing ever changes what a request reads

    def step(self, requests: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> list[ScoreResult]:
        return [self.score(r) for r in requests]  # no cache, so no use for the ranks

    def stats(self) -> EngineStats:
        return EngineStats.from_counts(self._counts)

    def flush_cache(self) -> None:
        """Nothing is cached: kept so both backends answer /flush_cache alike."""

    # ---- scoring ------------------------------------------------------------------------------

    def run(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Score requests offline, in order; all are validated before any work."""
        for r in requests:
            self.validate(r)
        return self.step(requests)

    @torch.inference_mode()
    def score(self, req: ScoreRequest) -> ScoreResult:
        ids = req.input_ids
        n = len(ids)
        first = req.logprob_start_len if req.logprob_start_len >= 0 else n - 1
        x = torch.tensor([ids], dtype=torch.int64, device=self.device)
        logits = self.model(x, logits_to_keep=n - first, use_cache=False).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)  # rows: positions first..n-1
        span = PromptSpan(req)
        span.add(logp, torch.tensor(ids[first + 1 :], dtype=torch.int64))
        c = self._counts
        c["requests"] += 1
        c["forwards"] += 1
        c["prompt"] += n
        c["computed"] += n  # no cache: every prompt token is computed
        return score_result(req, logp[-1], span, cached=0, last_logits=logits[-1])
