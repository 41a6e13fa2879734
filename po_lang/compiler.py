"""Compile a prompt and its labels into backend requests, and scores back out of the outcomes.

Invariants the compiler guarantees:
- The shared segments' token ids are an exact prefix of the call's ids: each segment is tokenised
  on its own and the ids are joined, so a BPE merge across the shared/private boundary can never
  change the prefix (and silently break cache reuse) from one call to the next.
- Special tokens (BOS) appear only at the start: later segments are tokenised without them.
- Each label compiles to the tokens it would be *after this prompt* (see `label_ids`); the rule
  and the prefills that score labels live in `po_backend.core.labels`, shared with the server's
  `/v1/classify`.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from po_backend.core.labels import (
    ANCHOR_CHARS,
    ChoicesMethod,
    LabelTokenError,
    check_distinct,
    continuation_score,
    label_continuations,
    label_requests,
)
from po_backend.core.labels import label_text as label_text  # re-exported: part of this module's API
from po_lang.backends import Backend, LabelRequest, ScoreOutcome, head_labels
from po_lang.errors import BackendError, LabelError, PromptError
from po_lang.ir import Prompt, Segment

# Stands in for the user message while rendering a chat template, to split it into head and tail.
PLACEHOLDER = "@@Po_Lang_Content_7f3A@@"  # mixed case: any case change shows


@dataclass(frozen=True)
class ClassifySpec:
    """How one decorated function compiles (everything but the prompt text)."""

    labels: tuple[str, ...]
    chat: bool = False
    system: str | None = None
    multi_token: bool = False
    choices_method: ChoicesMethod = "sum"
    # None: auto (a space before the label unless the prompt ends in whitespace).
    leading_space: bool | None = None

    def __post_init__(self) -> None:
        labels = self.labels
        if isinstance(labels, str) or len(labels) < 2:
            raise LabelError(f"classify needs a list of at least two labels, got {labels!r}")
        if any(not isinstance(x, str) or not x.strip() for x in labels):
            raise LabelError(f"labels must be non-empty strings, got {labels!r}")
        if len(set(labels)) != len(labels):
            raise LabelError(f"labels must be distinct, got {labels!r}")
        if self.choices_method not in ("sum", "mean"):
            raise ValueError(f"choices_method must be 'sum' or 'mean', got {self.choices_method!r}")
        if self.choices_method != "sum" and not self.multi_token:
            raise ValueError("choices_method only applies with multi_token=True")
        if self.system is not None and not self.chat:
            raise ValueError("system= needs chat=True (it is a chat-template system message)")


@dataclass(frozen=True)
class CompiledPrompt:
    ids: tuple[int, ...]
    cache_prefix_len: int | None  # tokens of the shared part; None = nothing marked shared
    text: str  # the full prompt text (after the chat template, when there is one)


@dataclass(frozen=True)
class Program:
    """One call, compiled: its prompt, each label's token ids, and the requests to send."""

    prompt: CompiledPrompt
    label_ids: tuple[tuple[int, ...], ...]
    requests: tuple[LabelRequest, ...]


class LruMemo:
    """A small LRU map (tokenisations that repeat across calls: shared segments, label probes)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[Hashable, object] = OrderedDict()

    def get(self, key: Hashable) -> object | None:
        if key in self._d:
            self._d.move_to_end(key)
            return self._d[key]
        return None

    def put(self, key: Hashable, value: object) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)


class Compiler:
    """Compiles for one backend; memoises the tokenisations that repeat (over HTTP each one is a
    round trip)."""

    def __init__(self, backend: Backend, memo_size: int = 256) -> None:
        self.backend = backend
        self._memo = LruMemo(memo_size)

    def compile(self, prompt: Prompt, spec: ClassifySpec) -> Program:
        compiled = self.prompt_ids(prompt, spec)
        head = self._head_order(spec)
        if head is not None:  # a classifier head scores the prompt itself: no label tokens
            req = LabelRequest(compiled.ids, (), compiled.cache_prefix_len, head_labels=head)
            return Program(compiled, tuple(() for _ in spec.labels), (req,))
        labels = self.label_ids(compiled.text, spec)
        return Program(compiled, labels, build_requests(compiled, labels, spec))

    def _head_order(self, spec: ClassifySpec) -> tuple[int, ...] | None:
        """On a classifier-head model: the head index of each of the function's labels, which
        must be the model's own (`id2label`, any order); None on a causal LM."""
        own = self._memo.get(("head",))
        if own is None:
            own = head_labels(self.backend) or ()
            self._memo.put(("head",), own)
        if not own:
            return None
        own = tuple(own)  # type: ignore[arg-type]
        if sorted(spec.labels) != sorted(own):
            raise LabelError(
                f"the model is a classifier with its own labels {list(own)} (config.json id2label); "
                f"the function's labels {list(spec.labels)} must be those (any order)"
            )
        return tuple(own.index(label) for label in spec.labels)

    # ---- prompt -------------------------------------------------------------------------------

    def prompt_ids(self, prompt: Prompt, spec: ClassifySpec) -> CompiledPrompt:
        if spec.chat:
            head, tail = self._chat_frame(spec.system)
            # The template head (system message, role markers) is shared by every call too.
            prompt = Prompt.of([Segment(head, shared=True), *prompt.segments, Segment(tail)])
            ids: list[int] = []  # a rendered template carries its own BOS, if any
        else:
            ids = list(self._special_prefix())
        cache_len: int | None = None
        for seg in prompt.segments:
            ids.extend(self._segment_ids(seg))
            if seg.shared:
                cache_len = len(ids)
        return CompiledPrompt(tuple(ids), cache_len, prompt.text)

    def _segment_ids(self, seg: Segment) -> tuple[int, ...]:
        if not seg.shared:  # private text rarely repeats: not worth memory
            return tuple(self.backend.tokenize(seg.text, add_special_tokens=False))
        key = ("segment", seg.text)
        hit = self._memo.get(key)
        if hit is None:
            hit = tuple(self.backend.tokenize(seg.text, add_special_tokens=False))
            self._memo.put(key, hit)
        return hit  # type: ignore[return-value]

    def _special_prefix(self) -> tuple[int, ...]:
        """What the tokenizer puts before a sequence (e.g. BOS), found by tokenising a probe with
        and without special tokens. Anything it appends (EOS) is dropped: we score what follows."""
        hit = self._memo.get(("special",))
        if hit is None:
            with_sp = self.backend.tokenize("a", add_special_tokens=True)
            bare = self.backend.tokenize("a", add_special_tokens=False)
            starts = [i for i in range(len(with_sp) - len(bare) + 1) if with_sp[i : i + len(bare)] == bare]
            hit = tuple(with_sp[: starts[0]]) if starts else ()
            self._memo.put(("special",), hit)
        return hit  # type: ignore[return-value]

    def _chat_frame(self, system: str | None) -> tuple[str, str]:
        """The chat template rendered around a placeholder user message: (head, tail)."""
        key = ("chat", system)
        hit = self._memo.get(key)
        if hit is None:
            messages = [{"role": "system", "content": system}] if system is not None else []
            messages.append({"role": "user", "content": PLACEHOLDER})
            rendered = self.backend.chat_template(messages, add_generation_prompt=True)
            if rendered.count(PLACEHOLDER) != 1:
                raise PromptError(
                    "the chat template does not render the user message verbatim, so the shared "
                    "prefix cannot be placed inside it; use chat=False and write the template text"
                )
            head, _, tail = rendered.partition(PLACEHOLDER)
            hit = (head, tail)
            self._memo.put(key, hit)
        return hit  # type: ignore[return-value]

    # ---- labels -------------------------------------------------------------------------------

    def label_ids(self, prompt_text: str, spec: ClassifySpec) -> tuple[tuple[int, ...], ...]:
        """Each label's token ids as they would follow `prompt_text`.

        The label text gets a leading space unless the prompt ends in whitespace (after "Answer:"
        the next word is " Yes"; after a chat template's "assistant\\n" it is "Yes"), and its ids
        are the tokens that `tail + label` has beyond `tail` alone, so the tokenizer decides.
        """
        key = ("labels", prompt_text[-ANCHOR_CHARS:], spec.labels, spec.leading_space, spec.multi_token)
        hit = self._memo.get(key)
        if hit is not None:
            return hit  # type: ignore[return-value]

        def encode(text: str) -> list[int]:
            return self.backend.tokenize(text, add_special_tokens=False)

        try:
            result = label_continuations(encode, prompt_text, spec.labels, spec.leading_space)
            _check_labels(spec, result)
        except LabelTokenError as e:
            raise LabelError(str(e)) from e
        self._memo.put(key, result)
        return result


def _check_labels(spec: ClassifySpec, ids: tuple[tuple[int, ...], ...]) -> None:
    if spec.multi_token:
        check_distinct(spec.labels, ids)
        return
    for label, cont in zip(spec.labels, ids, strict=True):
        if len(cont) > 1:
            raise LabelError(
                f"label {label!r} is {len(cont)} tokens {list(cont)} after this prompt, but single-token "
                "scoring needs one token per label; use multi_token=True to score each label's full "
                "continuation in the same prefill, or choose a one-token label"
            )
    first: dict[int, str] = {}
    for label, cont in zip(spec.labels, ids, strict=True):
        if cont[0] in first:
            raise LabelError(
                f"labels {first[cont[0]]!r} and {label!r} both start with token {cont[0]}, so one "
                "next-token distribution cannot tell them apart; use multi_token=True or distinct labels"
            )
        first[cont[0]] = label


def build_requests(
    prompt: CompiledPrompt, label_ids: tuple[tuple[int, ...], ...], spec: ClassifySpec
) -> tuple[LabelRequest, ...]:
    reqs = label_requests(prompt.ids, label_ids, prompt.cache_prefix_len, spec.multi_token)
    return tuple(
        LabelRequest(r.input_ids, r.label_token_ids, r.cache_prefix_len, r.logprob_start_len) for r in reqs
    )


def label_scores(
    outcomes: Sequence[ScoreOutcome], label_ids: tuple[tuple[int, ...], ...], spec: ClassifySpec
) -> tuple[float, ...]:
    """Log-score per label: the next-token log-prob, or with multi_token the continuation's summed
    (or mean, like sgl.select's token-length normalisation) log-prob."""
    if not spec.multi_token or not any(label_ids):  # one distribution (a head's: no label ids)
        (o,) = outcomes
        if len(o.label_logprobs) != len(label_ids):
            raise BackendError(f"expected {len(label_ids)} label log-probs, got {len(o.label_logprobs)}")
        return tuple(o.label_logprobs)
    scores = []
    for cont, o in zip(label_ids, outcomes, strict=True):
        tail = o.input_token_logprobs[-len(cont) :]
        if len(tail) != len(cont) or any(math.isnan(x) for x in tail):
            raise BackendError(f"expected {len(cont)} continuation log-probs, got {list(tail)}")
        scores.append(continuation_score(tail, spec.choices_method))
    return tuple(scores)
