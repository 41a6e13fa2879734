"""The request vocabulary: what a client asks to score and what it gets back.

Torch-free on purpose: the server, the scheduler, the JCT model, the simulator and clients import
it without pulling in the engine.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from po_backend.core.errors import (
    EmptyPromptError,
    InvalidRequestError,
    InvalidTokenError,
    PromptTooLongError,
)

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
    # At the same prompt positions as the prompt-token log-probs: the k most likely tokens, and
    # the log-probs of these token ids (SGLang's input_top_logprobs / input_token_ids_logprobs,
    # OpenAI's echo with logprobs). Bounded per position, so a long span stays cheap.
    input_top_k: int = 0
    input_token_ids: tuple[int, ...] = ()
    # The model's pooled output instead of next-token log-probs: a classifier head's logits or an
    # embedding (`ScoreResult.outputs`), whichever the loaded model's task is.
    pool: bool = False
    # SGLang's / vLLM's request priority (None: the default, 0). Which values run first, and
    # whether it counts at all, is the server's setting (`enable_priority_scheduling`).
    priority: int | None = None
    # The LoRA adapter to run it with, by its loaded name (SGLang's `lora_path`, vLLM's `model`);
    # None: the base model.
    lora: str | None = None

    @property
    def reusable_len(self) -> int:
        """Longest prefix whose K/V may come from the cache or a batch-mate: at least one token is
        computed (its hidden state gives the next-token log-probs), and prompt log-probs need
        hidden states from their start."""
        n = len(self.input_ids)
        return min(n - 1, self.logprob_start_len) if self.logprob_start_len >= 0 else n - 1


@dataclass(frozen=True)
class StepInfo:
    """The engine step a request ran in, as the serving loop saw it (what traces report)."""

    index: int  # the loop's step counter
    requests: int  # requests in the step (its batch size)
    seconds: float  # the step's measured time
    predicted_seconds: float  # the scheduler's JCT prediction of the step (nan: no JCT model)
    priority_class: str  # the request's class in the scheduler


@dataclass(frozen=True)
class ScoreResult:
    logprobs: list[float]  # full-vocabulary log P(label | prompt), aligned with label_token_ids
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # (token id, log-prob)
    input_token_logprobs: list[float] = field(default_factory=list)  # see logprob_start_len
    # One row per prompt-token log-prob above: (token id, log-prob) of the top `input_top_k`, and
    # the log-probs of `input_token_ids` in their order.
    input_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_ids_logprobs: list[list[float]] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    outputs: list[float] = field(default_factory=list)  # pooled requests: head logits or embedding
    queue_seconds: float = 0.0  # from submission to the start of its step (the serving loop's)
    step: StepInfo | None = None  # the serving loop's step it ran in
    # The same labels' raw logits (a reranker scored by one token's logit, bge-reranker-v2-gemma).
    label_logits: list[float] = field(default_factory=list)


def validate_request(req: ScoreRequest, vocab_size: int, max_input_len: int) -> None:
    """Every check a request must pass before any work; shared by all executors so they reject
    the same requests with the same typed errors."""
    n = len(req.input_ids)
    if n == 0:
        raise EmptyPromptError("the prompt is empty (0 tokens)")
    if n > max_input_len:
        raise PromptTooLongError(f"the prompt has {n} tokens, more than max_input_len={max_input_len}")
    for ids, what in (
        (req.input_ids, "prompt"),
        (req.label_token_ids, "label"),
        (req.input_token_ids, "input_token_ids"),
    ):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidTokenError(f"{what} token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    if not 0 <= req.top_k <= vocab_size:
        raise InvalidRequestError(f"top_k must be in [0, {vocab_size}], got {req.top_k}")
    if not 0 <= req.input_top_k <= vocab_size:
        raise InvalidRequestError(f"input_top_k must be in [0, {vocab_size}], got {req.input_top_k}")
    if not -1 <= req.logprob_start_len < n:
        raise InvalidRequestError(
            f"logprob_start_len must be in [-1, {n - 1}] for a {n}-token prompt, got {req.logprob_start_len}"
        )
    if req.priority is not None and (type(req.priority) is not int or abs(req.priority) >= 2**63):
        raise InvalidRequestError(f"priority must be a 64-bit integer, got {req.priority!r}")
    if req.cache_prefix_len is not None and not 0 <= req.cache_prefix_len <= n:
        raise InvalidRequestError(f"cache_prefix_len must be in [0, {n}], got {req.cache_prefix_len}")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids `a` and `b` share (the prefix a request built after another declares
    as cacheable, what two waiting requests could compute once). Slice comparisons keep the work
    in C (prompts are thousands of tokens and the scheduler asks this every step): windows growing
    4x from 16 tokens, so two prompts that part after a template's few tokens cost little, then
    halving inside the first window that differs."""
    if not (type(a) is type(b) and isinstance(a, tuple | list)):
        a, b = tuple(a), tuple(b)  # a tuple never equals a list; arrays compare elementwise
    n = min(len(a), len(b))
    lo, width = 0, 16
    while lo < n:
        hi = min(n, lo + width)
        if a[lo:hi] != b[lo:hi]:
            break
        lo, width = hi, width * 4
    else:
        return n
    while hi - lo > 1:  # a[:lo] == b[:lo] and a[lo:hi] != b[lo:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def pooled_requests(prompts: Sequence[tuple[int, ...]]) -> list[ScoreRequest]:
    """One pooled request (embedding or classifier head) per prompt, the leading ids all of them
    share (an instruction, a query) declared as the cache prefix: computed once for the call,
    read from the cache by later calls. At least the last token of each is computed."""
    shared = 0
    if len(prompts) > 1:
        shared = min(len(x) for x in prompts)
        for x in prompts[1:]:
            shared = common_prefix(prompts[0][:shared], x[:shared])
    return [ScoreRequest(x, pool=True, cache_prefix_len=min(shared, len(x) - 1) or None) for x in prompts]


def sorted_neighbours(
    keys: Sequence[Any],
    ids: tuple[int, ...],
    floor: int | None = None,
    key: Callable[[Any], tuple[int, ...]] | None = None,
) -> Iterator[tuple[int, int]]:
    """(index, leading ids shared with `ids`) of the entries of `keys` (sorted by token ids; `key`
    gives an entry's ids) around where `ids` sorts. In sorted order an entry shares less with `ids`
    the further it is, so the longest prefix `ids` shares with any entry it shares with one of the
    two next to it: without `floor` only those two are yielded (a longest-prefix lookup in two
    comparisons, however many entries); with it, each direction is walked on until an entry shares
    fewer than `floor` ids (every entry sharing at least that much)."""
    i = bisect.bisect_left(keys, ids, key=key)
    for j, step in ((i - 1, -1), (i, 1)):
        while 0 <= j < len(keys):
            n = common_prefix(ids, keys[j] if key is None else key(keys[j]))
            if floor is not None and n < floor:
                break
            yield j, n
            if floor is None:
                break
            j += step
