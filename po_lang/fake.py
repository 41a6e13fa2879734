"""A deterministic backend for tests: no model, no torch.

Tokenizer: GPT-2-like pre-tokenisation (a word keeps its leading space, so " Yes" and "Yes" are
different tokens; `<|...|>` is one special token), ids handed out in first-seen order. Scores:
log-softmax of pseudo-random logits seeded by the whole context, plus optional per-token biases;
the same context always gives the same numbers. It also models a prefix cache (for
`cached_tokens`) and the engine's validation, and records every batch it was sent.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from collections.abc import Mapping, Sequence
from functools import lru_cache

from po_lang.backends import LabelRequest, ScoreOutcome
from po_lang.errors import BackendError

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_PIECES = re.compile(r"<\|\w+\|>| ?[^\W\d]+| ?\d+| ?[^\s\w]+|\s+(?!\S)|\s+")


class Fake:
    def __init__(
        self,
        *,
        vocab_size: int = 1024,
        seed: int = 0,
        bos: str | None = "<s>",
        chat_template: str = CHATML,
        bias: Mapping[str, float] | None = None,
        max_input_len: int = 4096,
    ) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.bos = bos
        self.template = chat_template
        self.max_input_len = max_input_len
        self._vocab: dict[str, int] = {}
        self._pieces: list[str] = []
        for special in (bos, "<|im_start|>", "<|im_end|>"):
            if special:
                self.token_id(special)
        self.bias = {self.token_id(p): b for p, b in (bias or {}).items()}
        self.batches: list[list[LabelRequest]] = []  # what score() was sent, call by call
        self._cached: set[tuple[int, ...]] = set()
        self._logprobs = lru_cache(maxsize=4096)(self._compute_logprobs)

    def __repr__(self) -> str:
        return f"Fake(seed={self.seed})"

    # ---- tokenizer ----------------------------------------------------------------------------

    def token_id(self, piece: str) -> int:
        if piece not in self._vocab:
            if len(self._pieces) >= self.vocab_size:
                raise BackendError(f"the fake vocabulary is full ({self.vocab_size} pieces)")
            self._vocab[piece] = len(self._pieces)
            self._pieces.append(piece)
        return self._vocab[piece]

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = [self.token_id(self.bos)] if add_special_tokens and self.bos else []
        return ids + [self.token_id(p) for p in _PIECES.findall(text)]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self._pieces[i] for i in ids)

    def chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        import jinja2  # lazy: only chat tests need it

        env = jinja2.Environment(autoescape=False)
        return env.from_string(self.template).render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, bos_token=self.bos or ""
        )

    # ---- scoring ------------------------------------------------------------------------------

    def logprobs(self, context: Sequence[int]) -> tuple[float, ...]:
        """The full next-token distribution after `context` (log-probs over the vocabulary)."""
        return self._logprobs(tuple(context))

    def _compute_logprobs(self, context: tuple[int, ...]) -> tuple[float, ...]:
        digest = hashlib.blake2b(repr((self.seed, context)).encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "little"))
        logits = [rng.gauss(0.0, 2.0) for _ in range(self.vocab_size)]
        for t, b in self.bias.items():
            logits[t] += b
        m = max(logits)
        log_z = m + math.log(sum(math.exp(x - m) for x in logits))
        return tuple(x - log_z for x in logits)

    def score(self, requests: Sequence[LabelRequest]) -> list[ScoreOutcome | Exception]:
        self.batches.append(list(requests))
        return [self._score_one(r) for r in requests]

    def _score_one(self, r: LabelRequest) -> ScoreOutcome | Exception:
        ids = tuple(r.input_ids)
        n = len(ids)
        if n == 0:
            return BackendError("the prompt is empty (0 tokens)")
        if n > self.max_input_len:
            return BackendError(f"the prompt has {n} tokens, more than max_input_len={self.max_input_len}")
        if any(not 0 <= t < self.vocab_size for t in (*ids, *r.label_token_ids)):
            return BackendError("token ids outside the vocabulary")
        if not -1 <= r.logprob_start_len < n:
            return BackendError(f"logprob_start_len must be in [-1, {n - 1}], got {r.logprob_start_len}")
        if r.cache_prefix_len is not None and not 0 <= r.cache_prefix_len <= n:
            return BackendError(f"cache_prefix_len must be in [0, {n}], got {r.cache_prefix_len}")
        cached = max((len(p) for p in self._cached if ids[: len(p)] == p), default=0)
        if r.cache_prefix_len:
            self._cached.add(ids[: r.cache_prefix_len])
        last = self.logprobs(ids)
        span: tuple[float, ...] = ()
        if r.logprob_start_len >= 0:  # the engine's convention: positions after the start
            span = tuple(self.logprobs(ids[:i])[ids[i]] for i in range(r.logprob_start_len + 1, n))
        return ScoreOutcome(
            label_logprobs=tuple(last[t] for t in r.label_token_ids),
            input_token_logprobs=span,
            prompt_tokens=n,
            cached_tokens=min(cached, n),
        )
