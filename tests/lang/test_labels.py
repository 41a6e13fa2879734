"""Multi-token labels: every label's continuation is an item over the prompt, submitted together,
the prompt computed once; the scores are transformers' (fp32) and today's one-label-at-a-time."""

from __future__ import annotations

import pytest
import torch

from po_backend import Engine
from po_backend.core.labels import continuation_score, label_requests
from tests.conftest import hf_all_logprobs

PROMPT = tuple(range(3, 26))  # 23 tokens
# Two labels share their first tokens, one is a single token, one is long.
LABELS = ((5, 9, 2), (5, 9, 7), (11,), (3, 4, 5, 6))


def test_continuations_declare_the_shareable_prompt() -> None:
    reqs = label_requests(PROMPT, LABELS, cache_prefix_len=4, multi_token=True)
    n = len(PROMPT)
    assert [r.input_ids for r in reqs] == [PROMPT + c for c in LABELS]
    for r in reqs:
        # The last prompt token's hidden state scores the first label token: every item computes
        # it, so the prefix the items share (and the cache keeps) is the prompt minus that token.
        assert r.logprob_start_len == n - 1 and r.cache_prefix_len == n - 1 and r.label_token_ids == ()
    (single,) = label_requests(PROMPT, ((7,), (8,)), cache_prefix_len=4, multi_token=False)
    assert single.input_ids == PROMPT and single.label_token_ids == (7, 8) and single.cache_prefix_len == 4


@pytest.mark.parametrize("mode", ["hybrid", "chunked"])
def test_multi_token_labels_prompt_once(tiny_model, mode: str) -> None:
    path, hf = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=8, prefill_mode=mode)
    before = engine.stats()
    results = engine.run(label_requests(PROMPT, LABELS, None, multi_token=True))
    after = engine.stats()
    n = len(PROMPT)
    forwards = after.forwards - before.forwards
    # Hybrid: one forward, the first label's item computes the prompt and the others read it from
    # it in the same forward. Chunked reads prefixes before computing anything: the first label
    # caches the prompt, the rest are items over it in a second forward.
    assert forwards == (1 if mode == "hybrid" else 2)
    # The prompt's first n - 1 tokens computed once; each item its last prompt token and label.
    assert after.computed_tokens - before.computed_tokens == n - 1 + sum(1 + len(c) for c in LABELS)

    alone = Engine.from_pretrained(path, dtype="fp32", chunk_size=8, prefill_mode=mode, enable_cache=False)
    for cont, r in zip(LABELS, results, strict=True):
        ids = list(PROMPT + cont)
        ref = hf_all_logprobs(hf, ids)[n - 1 : -1].gather(1, torch.tensor(cont)[:, None]).squeeze(1)
        got = r.input_token_logprobs[-len(cont) :]
        assert torch.allclose(torch.tensor(got), ref, atol=1e-4)
        (today,) = alone.run(label_requests(PROMPT, (cont,), None, multi_token=True))
        assert continuation_score(got, "sum") == pytest.approx(
            continuation_score(today.input_token_logprobs[-len(cont) :], "sum"), abs=1e-4
        )


def test_labels_after_the_prompts_last_word_are_those_after_its_whole_end(tmp_path) -> None:
    """`label_key`'s short end (from the last whitespace before a word) gives each label the
    tokens the whole 64-character end gives it, or the same refusal, on random texts of words,
    digits, punctuation and whitespace runs (the tiny tokenizer's GPT-2-like pieces)."""
    import random
    import string

    from po_backend.core.labels import ANCHOR_CHARS, label_continuations, label_key
    from tests.tiny_tokenizer import build_tokenizer

    tok = build_tokenizer(tmp_path)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def derive(end: str, labels: list[str], leading: bool | None) -> object:
        try:
            return label_continuations(encode, end, labels, leading)
        except ValueError as e:
            return type(e).__name__

    rng = random.Random(0)
    chars = string.ascii_letters + string.digits + " \n\t:.,!?-'\""
    shorter = 0
    for _ in range(1500):
        text = "".join(rng.choice(chars) for _ in range(rng.randrange(1, 100)))
        labels = ["".join(rng.choice(chars) for _ in range(rng.randrange(1, 6))) for _ in range(3)]
        key = label_key(text)
        assert text.endswith(key) and len(key) <= ANCHOR_CHARS
        shorter += len(key) < len(text[-ANCHOR_CHARS:])
        for leading in (None, True, False):
            whole = derive(text[-ANCHOR_CHARS:], labels, leading)
            assert derive(key, labels, leading) == whole, (text, labels)
    assert shorter > 1000  # most texts have a shorter end than their last 64 characters
    assert label_key("Post 7: hello\nAnswer:") == label_key("Post 12345: bye\nAnswer:") == "\nAnswer:"
