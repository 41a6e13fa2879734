"""Built-in prompts of the LLM rerankers people deploy: Qwen3-Reranker, bge-reranker-v2-gemma and
mxbai-rerank-v2, each tokenised and scored the way its model card's reference code does it.

A preset lays a prompt out as pieces that are tokenised one by one (without special tokens) and
concatenated, as the reference code does: fixed texts (a chat-template prefix, a separator, the
task line) and texts with the query or the document filled in. The pieces before the document are
the same for all of a call's documents, so they are the call's shared cache prefix.

Scores: Qwen3-Reranker and mxbai-rerank-v2 compare two answer tokens, sigmoid(logit(yes) -
logit(no)) = P(yes) / (P(yes) + P(no)); bge-reranker-v2-gemma reads one token's raw logit,
normalised by a sigmoid (FlagEmbedding's `normalize=True`, what vLLM serves).

A preset is chosen by `--rerank-preset NAME`, or read from the model folder's name hints (its path,
`config.json`'s and `tokenizer_config.json`'s recorded names) with `--rerank-preset auto`.
Torch-free.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

# One piece of a prompt: a fixed text, or a text with the call's instruct / query / document in it.
Piece = tuple[Literal["fixed", "query", "doc"], str]
Score = Literal["pair", "logit"]

QWEN3_INSTRUCT = "Given a web search query, retrieve relevant passages that answer the query"
QWEN3_PREFIX = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and "
    'the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n"
)
QWEN3_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
BGE_PROMPT = (
    "Given a query A and a passage B, determine whether the passage contains an answer to the query "
    "by providing a prediction of either 'Yes' or 'No'."
)
MXBAI_TASK = (
    "You are a search relevance expert who evaluates how well documents match search queries. For "
    "each query-document pair, carefully analyze the semantic relationship between them, then "
    "provide your binary relevance judgment (0 for not relevant, 1 for relevant).\nRelevance:"
)
MXBAI_PREFIX = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n<|im_start|>user\n"
)
MXBAI_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class RerankPreset:
    """One reranker's prompt layout, answer tokens and score.

    `pieces(instruct)` gives the prompt's pieces for a call's instruction (None: the model's
    default); "query" pieces hold `{query}`, the one "doc" piece holds `{doc}`. `answers` are the
    relevant answer's token and, for "pair" scores, the irrelevant one's. `vocab_answers`: the
    answer ids are vocabulary lookups (Qwen3's `convert_tokens_to_ids`), else the first token of
    the answer's encoding (bge's and mxbai's `tokenizer(x)["input_ids"][0]`).
    """

    name: str
    hints: tuple[str, ...]  # lower-case substrings of a model folder's recorded names
    pieces: Callable[[str | None], tuple[Piece, ...]]
    answers: tuple[str, ...]
    score: Score
    bos: bool = False
    vocab_answers: bool = False


def _qwen3(instruct: str | None) -> tuple[Piece, ...]:
    text = f"<Instruct>: {instruct or QWEN3_INSTRUCT}\n<Query>: {{query}}\n<Document>: {{doc}}"
    # The whole pair is one tokenizer call in the reference (format_instruction).
    return (("fixed", QWEN3_PREFIX), ("doc", text), ("fixed", QWEN3_SUFFIX))


def _bge(instruct: str | None) -> tuple[Piece, ...]:
    return (
        ("query", "A: {query}"),
        ("fixed", "\n"),
        ("doc", "B: {doc}"),
        ("fixed", "\n"),
        ("fixed", instruct or BGE_PROMPT),
    )


def _mxbai(instruct: str | None) -> tuple[Piece, ...]:
    query = f"instruction: {instruct}\nquery: {{query}}" if instruct else "query: {query}"
    return (
        ("fixed", MXBAI_PREFIX),
        ("query", query),
        ("fixed", "\n"),
        ("doc", "document: {doc}"),
        ("fixed", "\n"),
        ("fixed", MXBAI_TASK),
        ("fixed", MXBAI_SUFFIX),
    )


PRESETS: dict[str, RerankPreset] = {
    p.name: p
    for p in (
        RerankPreset("qwen3-reranker", ("qwen3-reranker",), _qwen3, ("yes", "no"), "pair", vocab_answers=True),
        RerankPreset("bge-reranker-v2-gemma", ("bge-reranker-v2-gemma",), _bge, ("Yes",), "logit", bos=True),
        RerankPreset("mxbai-rerank-v2", ("mxbai-rerank-base-v2", "mxbai-rerank-large-v2"), _mxbai, ("1", "0"), "pair"),
    )
}  # fmt: skip
# --rerank-preset: a preset's name, "auto" (the folder's hints, else the generic template) or
# "none" (the generic template whatever the folder says).
CHOICES = ("auto", "none", *PRESETS)


def _fill(piece: Piece, query: str, doc: str) -> str:
    # str.replace, not format: a query or document may hold braces.
    return piece[1].replace("{query}", query).replace("{doc}", doc) if piece[0] != "fixed" else piece[1]


def prompt_ids(
    preset: RerankPreset,
    encode: Callable[[str], Sequence[int]],
    bos_id: int | None,
    instruct: str | None,
    query: str,
    doc: str,
) -> tuple[int, ...]:
    """The prompt's token ids; `encode` tokenises without special tokens."""
    ids: list[int] = [bos_id] if preset.bos and bos_id is not None else []
    for piece in preset.pieces(instruct):
        ids += encode(_fill(piece, query, doc))
    return tuple(ids)


def head_ids(
    preset: RerankPreset,
    encode: Callable[[str], Sequence[int]],
    bos_id: int | None,
    instruct: str | None,
    query: str,
) -> tuple[int, ...]:
    """The ids every document's prompt of a call starts with, up to the document's piece's text
    before the document (its trailing space dropped: it may merge with the document's first word)."""
    ids: list[int] = [bos_id] if preset.bos and bos_id is not None else []
    for piece in preset.pieces(instruct):
        if piece[0] == "doc":
            head = piece[1].split("{doc}")[0].replace("{query}", query).rstrip()
            return (*ids, *encode(head)) if head else tuple(ids)
        ids += encode(_fill(piece, query, ""))
    raise AssertionError(f"rerank preset {preset.name} has no document piece")


def answer_ids(preset: RerankPreset, tokenizer: Any) -> tuple[int, ...]:
    """The answer tokens' ids, looked up as the model card does."""
    if preset.vocab_answers:
        ids = [tokenizer.convert_tokens_to_ids(a) for a in preset.answers]
        unk = getattr(tokenizer, "unk_token_id", None)
        if any(i is None or i == unk for i in ids):
            raise ValueError(f"rerank preset {preset.name}: the vocabulary lacks one of {preset.answers}")
        return tuple(int(i) for i in ids)
    out = []
    for a in preset.answers:
        enc = tokenizer(a, add_special_tokens=False)["input_ids"]
        if not enc:
            raise ValueError(f"rerank preset {preset.name}: {a!r} tokenises to nothing")
        out.append(int(enc[0]))
    if len(set(out)) != len(out):
        raise ValueError(f"rerank preset {preset.name}: the answers {preset.answers} share a token")
    return tuple(out)


def _names(model_path: str) -> list[str]:
    """The names a model folder records for itself: its path, and `_name_or_path` / `name_or_path`
    in its config and tokenizer config (a copied folder keeps its hub name there)."""
    names = [model_path]
    folder = Path(model_path)
    for file, key in (("config.json", "_name_or_path"), ("tokenizer_config.json", "name_or_path")):
        try:
            value = json.loads((folder / file).read_text()).get(key)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(value, str):
            names.append(value)
    return names


def detect(model_path: str) -> RerankPreset | None:
    """The preset a model folder names (the first hint found in its recorded names), or None."""
    for name in _names(model_path):
        flat = re.sub(r"[_\s]+", "-", name.lower())
        for preset in PRESETS.values():
            if any(h in flat for h in preset.hints):
                return preset
    return None


def choose(setting: str, model_path: str) -> RerankPreset | None:
    """The preset for `--rerank-preset` (a name, auto or none) and the model folder."""
    if setting == "none":
        return None
    if setting == "auto":
        return detect(model_path)
    if setting not in PRESETS:
        raise ValueError(f"rerank_preset must be one of {CHOICES}, got {setting!r}")
    return PRESETS[setting]
