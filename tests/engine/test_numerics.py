"""Our forward against transformers on the same weights (fp32, tight tolerance)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from po_backend import Engine, ScoreRequest
from tests.conftest import TINY_CONFIGS, hf_all_logprobs, hf_next_logprobs

KINDS = sorted(TINY_CONFIGS)


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_logprobs_match_transformers(tiny_model, kind: str, chunk_size: int) -> None:
    path, hf = tiny_model(kind)
    # Sized to the prompts (239 tokens in all): the start-up memory profile of each model and chunk
    # size runs shorter forwards (slow at chunk size 1).
    engine = Engine.from_pretrained(
        path, dtype="fp32", chunk_size=chunk_size, max_input_len=256, max_batch_tokens=256
    )
    vocab = engine.vocab_size
    prompts = _prompts(vocab, [1, 5, 33, 200])
    labels = [0, 7, vocab - 1]
    results = engine.score(prompts, labels, top_k=5)  # one packed forward of different lengths
    for ids, res in zip(prompts, results, strict=True):
        ref = hf_next_logprobs(hf, ids)
        assert res.prompt_tokens == len(ids)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref[labels].tolist(), strict=True)) <= 1e-4
        ref_top = ref.topk(5)
        assert [t for t, _ in res.top_logprobs] == ref_top.indices.tolist()
        assert torch.allclose(torch.tensor([v for _, v in res.top_logprobs]), ref_top.values, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_prompt_token_logprobs_match_transformers(tiny_model, kind: str) -> None:
    path, hf = tiny_model(kind)
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=16)
    (ids,) = _prompts(engine.vocab_size, [90], seed=3)
    start = 40
    (res,) = engine.run([ScoreRequest(tuple(ids), (1, 2), logprob_start_len=start)])
    ref = hf_all_logprobs(hf, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(start + 1, len(ids))]
    assert len(res.input_token_logprobs) == len(want)
    assert max(abs(a - b) for a, b in zip(res.input_token_logprobs, want, strict=True)) <= 1e-4
    assert max(abs(a - b) for a, b in zip(res.logprobs, ref[-1, [1, 2]].tolist(), strict=True)) <= 1e-4


def test_bf16_close_to_fp32(tiny_model) -> None:
    path, _ = tiny_model("llama")
    e32 = Engine.from_pretrained(path, dtype="fp32")
    e16 = Engine.from_pretrained(path, dtype="bf16")
    prompts = _prompts(e32.vocab_size, [50, 120])
    labels = list(range(0, 300, 30))
    for a, b in zip(e32.score(prompts, labels), e16.score(prompts, labels), strict=True):
        # bf16 keeps ~3 significant digits; the tiny random model has large logits.
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 0.5


@pytest.mark.embedded
def test_embedded_matches_transformers_gguf(embedded_fp32: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """Our forward on the embedded GGUF vs transformers loading the same GGUF file."""
    import functools

    import gguf
    import transformers

    # transformers rebuilds the same read-only GGUF->HF name map for every submodule (hundreds of
    # times, about a third of its load time here); one per (arch, layers) gives the same map.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    # It also parses the whole file (its 49k-token vocabulary field by field) twice, for the config
    # and for the weights: one read-only reader per path serves both.
    monkeypatch.setattr(gguf, "GGUFReader", functools.cache(gguf.GGUFReader))

    from po_backend.engine.models.loader import embedded_model_file

    gguf = embedded_model_file()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    tok = embedded_fp32.tokenizer
    texts = [
        "The capital of France is",
        "Classify the sentiment of this review as positive or negative.\nReview: I loved it.\nSentiment:",
        " ".join(["word"] * 700),
    ]
    prompts = [tok.encode(t) for t in texts]
    labels = [9230, 2838, 2731, 3524]
    results = embedded_fp32.score(prompts, labels, top_k=3)
    for ids, res in zip(prompts, results, strict=True):
        ref = hf_next_logprobs(hf, ids)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref[labels].tolist(), strict=True)) <= 1e-3
        assert [t for t, _ in res.top_logprobs] == ref.topk(3).indices.tolist()


@pytest.fixture(scope="module")
def embedded_bf16() -> Engine:
    """Short prompts only (under 30 tokens): a max_input_len just over them keeps the start-up
    memory profile's forwards short, and they are slow in bf16 on a CPU without bf16 units."""
    return Engine.from_pretrained("embedded", dtype="bf16", max_input_len=64, max_batch_tokens=64)


@pytest.mark.embedded
def test_embedded_bf16_close_to_fp32(embedded_fp32: Engine, embedded_bf16: Engine) -> None:
    """bf16 (the default where the CPU has AMX/AVX512-bf16) is reported against fp32."""
    e16 = embedded_bf16
    tok = embedded_fp32.tokenizer
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode("Is this review positive? I loved it. Answer:"),
    ]
    labels = [9230, 2838, 7042]
    worst = 0.0
    for a, b in zip(embedded_fp32.score(prompts, labels), e16.score(prompts, labels), strict=True):
        worst = max(worst, max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)))
    print(f"embedded bf16 vs fp32: max |d logprob| = {worst:.3f}")
    assert worst < 0.5


@pytest.mark.embedded
def test_bf16_scores_do_not_tie(embedded_fp32: Engine, embedded_bf16: Engine) -> None:
    """A bf16 head rounded every logit to 8 mantissa bits, so P(Yes) over the labels (a function of
    the Yes-No logit difference) took few values: 10 posts for one profile got 6 distinct ones,
    five posts tied at 0.5927. The scored rows' norm and head now run in fp32: every post its own
    score, close to fp32's."""
    engines = {"bf16": embedded_bf16, "fp32": embedded_fp32}
    tok = engines["fp32"].tokenizer
    yes, no = tok.encode(" Yes")[0], tok.encode(" No")[0]
    profile = tok.encode("User profile: likes hiking, coffee and camping.\nWill the user like this post?\n")
    posts = ["trail guide", "espresso beans", "betting tips", "celebrity news", "camping stove",
             "stock market", "sunrise photos", "a cat video", "tax changes", "hiking boots"]  # fmt: skip
    reqs = [ScoreRequest(tuple(profile + tok.encode(f"Post: {p}\nAnswer:")), (yes, no)) for p in posts]
    p_yes = {
        d: [1 / (1 + math.exp(r.logprobs[1] - r.logprobs[0])) for r in e.run(reqs)]
        for d, e in engines.items()
    }
    assert len(set(p_yes["bf16"])) == len(posts)
    assert max(abs(a - b) for a, b in zip(p_yes["bf16"], p_yes["fp32"], strict=True)) < 0.1


def _hit_and_cold(engine: Engine, prefix: list[int], items: list[list[int]], labels: list[int]) -> float:
    """Largest |log-prob difference| between items scored over their cached prefix and the same
    prompts computed from scratch, on one engine."""
    lab = tuple(labels)
    cold = []
    for s in items:
        engine.flush_cache()
        cold += engine.run([ScoreRequest(tuple(prefix + s), lab)])
    engine.flush_cache()
    engine.run([ScoreRequest(tuple(prefix), lab, cache_prefix_len=len(prefix))])
    hit = engine.run([ScoreRequest(tuple(prefix + s), lab, cache_prefix_len=len(prefix)) for s in items])
    assert all(r.cached_tokens == len(prefix) for r in hit), "the prefix was not read from the cache"
    return max(
        abs(a - b)
        for h, c in zip(hit, cold, strict=True)
        for a, b in zip(h.logprobs, c.logprobs, strict=True)
    )


def test_bf16_residual_stream_is_fp32(tiny_model) -> None:
    """bf16 weights and matmuls, fp32 residual stream (the default): the hidden states the runner
    returns are fp32, a cache hit agrees with the cold run within 0.02 log-prob, and the result is
    closer to fp32 than the all-bf16 stream's. (CPUs without the bf16 kernel also run attention's
    softmax in fp32 then: SDPA's bf16 rounding depends on how the keys are split.)"""
    path, _ = tiny_model("llama")
    e32 = Engine.from_pretrained(path, dtype="fp32")
    e16 = Engine.from_pretrained(path, dtype="bf16")
    all16 = Engine.from_pretrained(path, dtype="bf16", residual_dtype="model")
    chunked = Engine.from_pretrained(path, dtype="bf16", prefill_mode="chunked")
    assert e16.config.residual_dtype == "fp32" and e16.runner.resid_dtype == torch.float32
    assert chunked.runner.resid_dtype == torch.float32
    assert all16.runner.resid_dtype == torch.bfloat16 and e32.runner.resid_dtype == torch.float32
    seen: list[torch.dtype] = []
    forward = e16.runner.forward
    e16.runner.forward = lambda *a: seen.append((h := forward(*a)).dtype) or h  # type: ignore[method-assign]
    prefix, *items = _prompts(e16.vocab_size, [120, 5, 17, 40, 1], seed=7)
    labels = list(range(0, 300, 30))
    assert _hit_and_cold(e16, prefix, items, labels) <= 0.02
    assert seen and set(seen) == {torch.float32}
    prompts = [prefix + s for s in items]

    def worst(e: Engine) -> float:
        return max(
            abs(x - y)
            for a, b in zip(e32.score(prompts, labels), e.score(prompts, labels), strict=True)
            for x, y in zip(a.logprobs, b.logprobs, strict=True)
        )

    assert worst(e16) < worst(all16)
    assert worst(chunked) < worst(all16)
