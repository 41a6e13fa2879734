"""Labels as the tokens that would follow a prompt, and the prefills that score them.

One implementation for both users: po_lang's compiler (`@po.classify`) and the server's
`/v1/classify`. Torch-free (po_lang imports it; po_backend never imports po_lang).

A label's tokens are found by tokenising the prompt's tail with and without the label, so the
tokenizer itself decides the boundary (" Yes" after "Answer:", "Yes" after "assistant\\n"). Labels
that are one distinct token each are scored from one next-token distribution; otherwise each
label's continuation is prefilled after the prompt and its tokens' log-probs are summed (or
averaged, like `sgl.select`'s token-length normalisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Literal

from po_backend.core.errors import InvalidRequestError
from po_backend.core.request import ScoreRequest

# The tail only has to be long enough for the tokenizer's decision at the boundary to be local.
ANCHOR_CHARS = 64

ChoicesMethod = Literal["sum", "mean"]
Encode = Callable[[str], Sequence[int]]  # text -> ids, without special tokens (no BOS)
LabelIds = tuple[tuple[int, ...], ...]


class LabelTokenError(InvalidRequestError):
    """A label cannot be scored as a continuation of this prompt (HTTP 400; po_lang's LabelError)."""


def label_text(label: str, prompt_text: str, leading_space: bool | None) -> str:
    """The label as it is appended: with a space before it unless the prompt ends in whitespace
    (leading_space=None), or as `leading_space` says; an explicit leading space is kept as is."""
    if leading_space is None:
        leading_space = bool(prompt_text) and not prompt_text[-1].isspace()
    if leading_space and not label[:1].isspace():
        return " " + label
    return label


def label_key(prompt_text: str) -> str:
    """The end of `prompt_text` its labels' tokens are derived after: from the last whitespace
    before a word on. A tokenizer that splits text into pieces that never run from a word into
    the whitespace after it (GPT-2's, Llama 3's, Qwen's regexes) splits the prompt there whatever
    came before, so prompts ending alike (a template's "\\nAnswer:") share one derivation whatever
    their other text. Without such a whitespace in the last ANCHOR_CHARS, those characters."""
    anchor = prompt_text[-ANCHOR_CHARS:]
    for i in range(len(anchor) - 1, 0, -1):
        if anchor[i - 1].isspace() and not anchor[i].isspace():
            start = i - 1
            while start > 0 and anchor[start - 1].isspace():
                start -= 1
            return anchor[start:]
    return anchor


def label_continuations(
    encode: Encode, prompt_text: str, labels: Sequence[str], leading_space: bool | None
) -> LabelIds:
    """Each label's token ids as they would follow `prompt_text`: the tokens `tail + label` has
    beyond `tail` alone. Raises LabelTokenError when a label merges with the prompt's end (its
    tokens would then not be a continuation) or tokenises to nothing."""
    anchor = prompt_text[-ANCHOR_CHARS:]
    base = tuple(encode(anchor))
    out: list[tuple[int, ...]] = []
    for label in labels:
        full = tuple(encode(anchor + label_text(label, prompt_text, leading_space)))
        if full[: len(base)] != base:
            raise LabelTokenError(
                f"label {label!r} merges with the end of the prompt ({anchor[-20:]!r}) into "
                "different tokens, so it cannot be scored as a continuation; end the prompt with "
                "a separator such as ':' or a newline"
            )
        cont = full[len(base) :]
        if not cont:
            raise LabelTokenError(f"label {label!r} tokenises to nothing after this prompt")
        out.append(cont)
    return tuple(out)


def check_distinct(labels: Sequence[str], label_ids: LabelIds) -> None:
    """Two labels with the same tokens cannot be told apart by any score."""
    seen: dict[tuple[int, ...], str] = {}
    for label, cont in zip(labels, label_ids, strict=True):
        if cont in seen:
            raise LabelTokenError(f"labels {seen[cont]!r} and {label!r} tokenise identically: {list(cont)}")
        seen[cont] = label


def single_tokens(label_ids: LabelIds) -> tuple[int, ...] | None:
    """Each label's one token, when every label is a single token distinct from the others (then
    one next-token distribution scores them all); else None."""
    firsts = tuple(c[0] for c in label_ids)
    if all(len(c) == 1 for c in label_ids) and len(set(firsts)) == len(firsts):
        return firsts
    return None


def label_requests(
    prompt_ids: tuple[int, ...], label_ids: LabelIds, cache_prefix_len: int | None, multi_token: bool
) -> tuple[ScoreRequest, ...]:
    """The prefills that score the labels after `prompt_ids`. Single-token: one request reading
    the labels' next-token log-probs. Multi-token: one per label over prompt + continuation,
    reading the continuation tokens' log-probs, all submitted together as items over the prompt.

    Each continuation request declares the prompt minus its last token as its cache prefix: the
    most an item can read from the cache, since the last prompt token's hidden state gives the
    first label token's log-prob (`logprob_start_len` = n - 1) and so is computed in every item.
    Declaring exactly the shareable part lets the engine compute it once for the whole group
    (and, where it groups waiting requests by a shared prefix, in the same forward as the items)
    without storing a token no item can read."""
    if not multi_token:
        return (ScoreRequest(prompt_ids, tuple(c[0] for c in label_ids), cache_prefix_len=cache_prefix_len),)
    n = len(prompt_ids)
    return tuple(
        ScoreRequest(prompt_ids + cont, (), logprob_start_len=n - 1, cache_prefix_len=max(n - 1, 0))
        for cont in label_ids
    )


def continuation_score(token_logprobs: Sequence[float], method: ChoicesMethod) -> float:
    """A multi-token label's score from its tokens' log-probs: their sum, or with "mean" the sum
    per token (so long labels are not penalised for their length)."""
    total = math.fsum(token_logprobs)
    return total / len(token_logprobs) if method == "mean" else total
