"""SGLang's offline Python API on our engine: code written against `sglang.Engine` runs by
changing the import.

    from po_backend.compat.sglang import Engine      # instead of: from sglang import Engine
    engine = Engine(model_path="embedded")
    engine.score(query="Is Paris the capital of France? ", items=["Yes.", "No."],
                 label_token_ids=[yes, no], apply_softmax=True)   # -> [[p_yes, p_no], ...]
    engine.shutdown()

`score` follows SGLang's `TokenizerManager.score_request` (0.5.x): a text prompt is the plain
string join `query + item` (`item + query` with item_first), token ids are concatenated; no items
-> []; apply_softmax normalises over the labels (with `temperature`), otherwise each label's
full-vocabulary probability. The query is declared as the cached shared prefix, so the items
after the first run as one multi-item forward over it. The numbers equal the server's /v1/score.

The result is a list of rows (`list[list[float]]`, what SGLang returned before 0.5.2x) that also
carries SGLang 0.5.23's `ScoreResult` fields (`.scores`, `.prompt_tokens`, `.token_logprobs`),
so code written against either version runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from po_backend.compat.local_runtime import LocalRuntime
from po_backend.core.errors import EmptyPromptError, InvalidRequestError, LoRAError
from po_backend.core.request import ScoreRequest, common_prefix, pooled_requests
from po_backend.core.task import ModelTask, probabilities

TextOrIds = str | Sequence[int]


class ScoreOutput(list[list[float]]):
    """`[num_items][num_labels]` scores; also SGLang 0.5.23's ScoreResult attributes."""

    def __init__(
        self,
        rows: Sequence[list[float]] = (),
        prompt_tokens: int = 0,
        token_logprobs: list[list[float]] | None = None,
    ) -> None:
        super().__init__(rows)
        self.prompt_tokens = prompt_tokens
        self.token_logprobs = token_logprobs

    @property
    def scores(self) -> list[list[float]]:
        return list(self)


class SGLangEngine:
    """`sglang.Engine` for prefill-only scoring (importable as `Engine`, the drop-in name).
    Keyword arguments are SGLang's ServerArgs names (`model_path`, `dtype`, `context_length`,
    `chunked_prefill_size`, `max_prefill_tokens`, `disable_radix_cache`, `schedule_policy`,
    `max_queued_requests`, `mem_fraction_static`, ...) or ours, mapped by
    `core.settings.resolve` exactly as the server's flags; those that change nothing here
    (`log_level`, `random_seed`, ...) are ignored, unknown ones raise TypeError."""

    def __init__(self, runtime: LocalRuntime | None = None, **kwargs: Any) -> None:
        self.runtime = runtime if runtime is not None else LocalRuntime.launch(**kwargs)
        self.tokenizer = self.runtime.tokenizer

    @classmethod
    def from_engine(cls, engine: Any, **settings: Any) -> SGLangEngine:
        """Serve a `po_backend.Engine` already loaded (`jct=`, and loop settings such as
        `schedule_policy`; see LocalRuntime.wrap)."""
        return cls(LocalRuntime.wrap(engine, **settings))

    # ---- scoring ------------------------------------------------------------------------------

    def score(
        self,
        query: TextOrIds | None = None,
        items: str | Sequence[TextOrIds] | None = None,
        label_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        embed_override_token_id: int | None = None,
        query_embed_overrides: Any = None,
        item_embed_overrides: Any = None,
        return_pooled_hidden_states: bool = False,
        score_extraction_token_id: int | None = None,
        temperature: float = 1.0,
        return_token_logprobs: bool = False,
        stacked_query_item_embed_overrides: Any = None,
        priority: int | None = None,
        lora_path: str | None = None,
    ) -> ScoreOutput:
        """P(label | query + item) per item and label; see the module docstring."""
        for name, value in (
            ("embed_override_token_id", embed_override_token_id),
            ("query_embed_overrides", query_embed_overrides),
            ("item_embed_overrides", item_embed_overrides),
            ("stacked_query_item_embed_overrides", stacked_query_item_embed_overrides),
            ("score_extraction_token_id", score_extraction_token_id),
        ):
            if value is not None:
                raise InvalidRequestError(f"{name} is not supported by the prefill-only engine")
        if return_pooled_hidden_states:
            raise InvalidRequestError("return_pooled_hidden_states is not supported for CausalLM models")
        if not math.isfinite(temperature) or temperature <= 0:
            raise InvalidRequestError("temperature must be finite and greater than zero")
        if temperature != 1.0 and not apply_softmax:
            raise InvalidRequestError("temperature requires apply_softmax=True")
        head = self.task.kind == "classify"  # a classifier: its head's probabilities, no labels
        if label_token_ids is None and not head:
            raise InvalidRequestError("label_token_ids is required for generation (CausalLM) models.")
        if items is None:
            raise InvalidRequestError("items must be provided")
        if not items:
            return ScoreOutput([], 0, [] if return_token_logprobs else None)
        item_list: list[TextOrIds] = [items] if isinstance(items, str) else list(items)
        labels: list[tuple[int, ...]] = (
            [()] * len(item_list) if head else self._labels(label_token_ids or [], len(item_list))
        )
        reqs = self._requests(query, item_list, item_first, labels)
        if lora_path is not None:  # a loaded adapter's name (SGLang's lora_path)
            reqs = [replace(r, lora=lora_path) for r in reqs]
        if head:
            reqs = [replace(r, pool=True) for r in reqs]
            results = self.runtime.run(reqs, priority)
            rows = [probabilities(self.task, r.outputs) for r in results]
            return ScoreOutput(rows, sum(r.prompt_tokens for r in results), None)
        results = self.runtime.run(reqs, priority)
        rows = [
            _softmax(r.logprobs, temperature) if apply_softmax else [math.exp(x) for x in r.logprobs]
            for r in results
        ]
        token_logprobs = [list(r.logprobs) for r in results] if return_token_logprobs else None
        return ScoreOutput(rows, sum(r.prompt_tokens for r in results), token_logprobs)

    async def async_score(self, **kwargs: Any) -> ScoreOutput:
        """score() without blocking the event loop (it waits on the engine loop's futures)."""
        import asyncio

        return await asyncio.to_thread(self.score, **kwargs)

    def _labels(self, label_token_ids: Sequence[Any], n: int) -> list[tuple[int, ...]]:
        """SGLang's checks: one shared list or one per item, nonempty, no duplicates, in vocab."""
        if not isinstance(label_token_ids, list | tuple) or not label_token_ids:
            raise InvalidRequestError("label_token_ids must be a nonempty list")
        if isinstance(label_token_ids[0], list | tuple):
            if len(label_token_ids) != n:
                raise InvalidRequestError("label_token_ids must have one list per item")
            per_item = [tuple(x) for x in label_token_ids]
        else:
            per_item = [tuple(label_token_ids)] * n
        vocab = self.runtime.vocab_size
        for ls in per_item:
            if not ls:
                raise InvalidRequestError("each item must have a nonempty candidate list")
            if any(type(t) is not int or t < 0 for t in ls):
                raise InvalidRequestError("label_token_ids must contain nonnegative integers")
            if len(set(ls)) != len(ls):
                raise InvalidRequestError("label_token_ids must not contain duplicate tokens")
            for t in ls:
                if t >= vocab:
                    raise InvalidRequestError(f"Token ID {t} is out of vocabulary (vocab size: {vocab})")
        return per_item

    def _requests(
        self,
        query: TextOrIds | None,
        items: list[TextOrIds],
        item_first: bool,
        labels: list[tuple[int, ...]],
    ) -> list[ScoreRequest]:
        """One request per item, built as the server's /v1/score builds them: the query's tokens
        (the item's with item_first) are the cache prefix."""
        if query is None:  # SGLang normalises an omitted query by the items' type
            query = [] if not isinstance(items[0], str) else ""
        reqs = []
        if isinstance(query, str):
            if not all(isinstance(x, str) for x in items):
                raise InvalidRequestError("Invalid combination of query/items types for score_request.")
            prefix = self.runtime.encode(query) if not item_first else None
            for item, ls in zip(items, labels, strict=True):
                text = f"{item}{query}" if item_first else f"{query}{item}"
                if not text:
                    raise EmptyPromptError("the prompt is empty (empty query and item)")
                ids = self.runtime.encode(text)
                # A BPE merge across the join can only shorten the shared part.
                shared = prefix if prefix is not None else self.runtime.encode(item)  # type: ignore[arg-type]
                reqs.append(ScoreRequest(ids, ls, cache_prefix_len=common_prefix(shared, ids)))
            return reqs
        if not all(isinstance(x, list | tuple) for x in items):
            raise InvalidRequestError("Invalid combination of query/items types for score_request.")
        q = tuple(int(t) for t in query)
        for item, ls in zip(items, labels, strict=True):
            it = tuple(int(t) for t in item)
            ids = it + q if item_first else q + it
            n_shared = len(it) if item_first else len(q)
            reqs.append(ScoreRequest(ids, ls, cache_prefix_len=n_shared or None))
        return reqs

    # ---- pooling models (--is-embedding): embedders and classifier heads -------------------------

    @property
    def task(self) -> ModelTask:
        return getattr(self.runtime.scorer, "task", None) or ModelTask()

    def encode(
        self,
        prompt: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        lora_path: str | None = None,
        **ignored: Any,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """SGLang's `Engine.encode` on an embedding or classifier model: per prompt
        `{"embedding": the pooled output (a classifier: its logits), "meta_info": {...}}`, one
        dict for one prompt. Prompts sharing leading tokens share them as the cache prefix."""
        if not self.task.pooled:
            raise InvalidRequestError("encode needs an embedding or classifier model (is_embedding=True)")
        single = isinstance(prompt, str) or bool(prompt and isinstance(prompt[0], int))
        rows: list[Any] = [prompt] if single else list(prompt)
        ids = [self.runtime.encode(p) if isinstance(p, str) else tuple(int(t) for t in p) for p in rows]
        results = self.runtime.run([replace(r, lora=lora_path) for r in pooled_requests(ids)])
        out = [
            {
                "embedding": r.outputs,
                "meta_info": {"prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens},
            }
            for r in results
        ]
        return out[0] if single else out

    # ---- the rest of sglang.Engine's surface that a prefill-only engine has ----------------------

    def flush_cache(self) -> None:
        self.runtime.flush_cache()

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> None:
        """SGLang's: load a PEFT adapter folder under `lora_name` (LoRAError naming what is wrong)."""
        self._loras().load(lora_name, lora_path)

    def unload_lora_adapter(self, lora_name: str) -> None:
        self._loras().unload(lora_name)

    def _loras(self) -> Any:
        loras = getattr(self.runtime.scorer, "loras", None)
        if loras is None:
            raise LoRAError("LoRA is off: create the Engine with enable_lora=True (or lora_paths)")
        return loras

    def get_server_info(self) -> dict[str, Any]:
        """The resolved settings and the counters, as JSON: the same keys and values as the
        server's /server_info for the same arguments (which adds the HTTP edge's settings)."""
        return self.runtime.server_info()

    def shutdown(self) -> None:
        """Finish what is queued and stop the engine loop (idempotent)."""
        self.runtime.shutdown()

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


Engine = SGLangEngine  # SGLang's name: `from po_backend.compat.sglang import Engine` is the drop-in


def _softmax(xs: Sequence[float], temperature: float) -> list[float]:
    """SGLang's `_convert_logprobs_to_scores` with apply_softmax: centred before scaling."""
    m = max(xs)
    w = [math.exp((x - m) / temperature) for x in xs]
    s = math.fsum(w)
    return [x / s for x in w]
