"""What the compiler needs from a model: a tokenizer, a chat template, and label scoring.

Three implementations: `Local` (the in-process engine, `po_lang.local`), `Remote` (our HTTP
server, `po_lang.remote`) and `Fake` (deterministic, for tests, `po_lang.fake`). Backends are
keyed by identity in per-classifier caches, so they must be hashable and weak-referenceable
(any ordinary class instance is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class LabelRequest:
    """One prefill: the next-token log-probs of `label_token_ids` after `input_ids`."""

    input_ids: tuple[int, ...]
    label_token_ids: tuple[int, ...] = ()
    # Leading tokens worth keeping in the prefix cache (the shared segment); None = backend policy.
    cache_prefix_len: int | None = None
    # >= 0: also return log P(ids[i] | ids[:i]) for the prompt positions after it (multi-token
    # labels are scored this way); -1: none.
    logprob_start_len: int = -1
    # A classifier-head model (`Backend.head_labels`): score the prompt through its head and return
    # the log-probabilities of these head label indices, in this order (no label tokens).
    head_labels: tuple[int, ...] = ()
    # The LoRA adapter to score it with (its name as the backend loaded it); None: the base model.
    lora: str | None = None


@dataclass(frozen=True)
class ScoreOutcome:
    label_logprobs: tuple[float, ...]  # full-vocabulary log-probs, aligned with label_token_ids
    # Prompt-token log-probs, aligned to END at the last prompt token. Backends differ in whether
    # the position logprob_start_len itself is included (ours: no; SGLang: yes), so consumers only
    # read the tail they need.
    input_token_logprobs: tuple[float, ...] = ()
    prompt_tokens: int = 0
    cached_tokens: int = 0


@runtime_checkable
class Backend(Protocol):
    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer puts around a
        sequence (e.g. BOS)."""
        ...

    def chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The tokenizer's chat template rendered as text."""
        ...

    def score(self, requests: Sequence[LabelRequest]) -> list[ScoreOutcome | Exception]:
        """One outcome per request, in order; a bad request yields its exception in its place
        instead of failing the others."""
        ...


def head_labels(backend: Backend) -> tuple[str, ...] | None:
    """The labels of the backend's classifier head (its `id2label`), or None for a causal LM.
    Optional in a backend (`head_labels()`): one without it scores label tokens."""
    fn = getattr(backend, "head_labels", None)
    return fn() if callable(fn) else None
