"""prefill_mode="chunked" (the Sarathi-style baseline): numerics against transformers in fp32, and
memory that grows with the context by every layer's K/V (what hybrid prefilling avoids)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from po_backend import Engine, ScoreRequest
from po_backend.engine.activations import activation_bytes, chunked_activation_bytes
from po_backend.engine.config import ModelConfig
from po_backend.engine.models.loader import read_config
from po_backend.entrypoints.launch_server import build_parser, server_args
from tests.conftest import hf_all_logprobs, hf_next_logprobs, save_llama
from tests.memory_probe import in_fresh_process


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


# 7 and 64 divide neither 33 nor 200, and chunks span sequence boundaries of the packed batch;
# 0 = one chunk; 1 = every token its own chunk.
@pytest.mark.parametrize(
    "kind, chunk_size", [("llama", 1), ("llama", 7), ("llama", 64), ("llama", 0), ("qwen3", 7), ("qwen3", 0)]
)
def test_chunked_matches_transformers(tiny_model, kind: str, chunk_size: int) -> None:
    path, hf = tiny_model(kind)
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=chunk_size, prefill_mode="chunked")
    assert engine.config.prefill_mode == "chunked" and engine.runner.prefill_mode == "chunked"
    vocab = engine.vocab_size
    prompts = _prompts(vocab, [1, 5, 33, 200])
    labels = [0, 7, vocab - 1]
    for ids, res in zip(prompts, engine.score(prompts, labels, top_k=5), strict=True):
        ref = hf_next_logprobs(hf, ids)
        assert _max_diff(res.logprobs, ref[labels].tolist()) <= 1e-4
        assert [t for t, _ in res.top_logprobs] == ref.topk(5).indices.tolist()


@pytest.mark.parametrize("chunk_size", [7, 16])
def test_chunked_prompt_logprobs_match_transformers(tiny_model, chunk_size: int) -> None:
    """Rows wanted from several chunks come back in order."""
    path, hf = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=chunk_size, prefill_mode="chunked")
    (ids,) = _prompts(engine.vocab_size, [90], seed=3)
    start = 40
    (res,) = engine.run([ScoreRequest(tuple(ids), (1, 2), logprob_start_len=start)])
    ref = hf_all_logprobs(hf, ids)
    want = [ref[i - 1, ids[i]].item() for i in range(start + 1, len(ids))]
    assert _max_diff(res.input_token_logprobs, want) <= 1e-4
    assert _max_diff(res.logprobs, ref[-1, [1, 2]].tolist()) <= 1e-4


@pytest.mark.parametrize("chunk_size", [5, 32])
def test_chunked_with_prefix_cache_hit(tiny_model, chunk_size: int) -> None:
    """Items after a cached prefix: chunks attend to the prefix K/V read from the pool (and the
    chunked mode's stored prefix is what a later hybrid-shaped read expects)."""
    path, hf = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", chunk_size=chunk_size, prefill_mode="chunked")
    vocab = engine.vocab_size
    (prefix,) = _prompts(vocab, [70], seed=5)
    items = _prompts(vocab, [9, 23, 40], seed=6)
    labels = [3, 11]
    first = engine.score([prefix + items[0]], labels, cache_prefix_len=len(prefix))[0]
    assert first.cached_tokens == 0
    rest = engine.score([prefix + it for it in items[1:]], labels, cache_prefix_len=len(prefix))
    for it, res in zip(items[1:], rest, strict=True):
        assert res.cached_tokens == len(prefix), "the second round must hit the cached prefix"
        ref = hf_next_logprobs(hf, prefix + it)
        assert _max_diff(res.logprobs, ref[labels].tolist()) <= 1e-4
    ref0 = hf_next_logprobs(hf, prefix + items[0])
    assert _max_diff(first.logprobs, ref0[labels].tolist()) <= 1e-4


def test_chunked_equals_hybrid(tiny_model) -> None:
    path, _ = tiny_model("qwen2")
    hybrid = Engine.from_pretrained(path, dtype="fp32", chunk_size=16)
    chunked = Engine.from_pretrained(path, dtype="fp32", chunk_size=16, prefill_mode="chunked")
    prompts = _prompts(hybrid.vocab_size, [3, 50, 129], seed=9)
    labels = list(range(0, 300, 37))
    for a, b in zip(hybrid.score(prompts, labels), chunked.score(prompts, labels), strict=True):
        assert _max_diff(a.logprobs, b.logprobs) <= 1e-4


def test_prefill_mode_validated_and_exposed_by_launcher() -> None:
    with pytest.raises(ValueError, match="prefill_mode"):
        from po_backend.engine.config import EngineConfig

        EngineConfig(dtype=torch.float32, device=torch.device("cpu"), prefill_mode="sarathi")  # type: ignore[arg-type]

    def launched(*flags: str) -> str:
        return server_args(build_parser().parse_args(["--model-path", "x", *flags])).engine.prefill_mode

    assert launched("--prefill-mode", "chunked") == "chunked"
    assert launched() == "hybrid"


# ---- memory ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Enough layers that every layer's K/V (8 KiB per token in fp32) dominates the growth."""
    return save_llama(
        tmp_path_factory.mktemp("deep"),
        vocab_size=2000,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
    )


def _kv_bytes_per_token(m: ModelConfig) -> int:
    return 2 * m.num_layers * m.kv_size * 4  # K and V, every layer, fp32


def test_chunked_memory_grows_by_all_layer_kv(deep_model: str, tmp_path: Path) -> None:
    # Each engine's budget profile and peaks measured in one fresh interpreter of its own
    # (tests/memory_probe.py): in this worker a peak would also count what earlier tests left.
    kw = dict(dtype="fp32", chunk_size=256, enable_cache=False, memory_budget=1 << 30, max_input_len=4096)
    lo, hi = 1024, 4096
    chunked = in_fresh_process(
        "forward_peaks",
        tmp_path / "chunked",
        model=deep_model,
        lengths=[lo, hi],
        prefill_mode="chunked",
        **kw,
    )
    hybrid = in_fresh_process("forward_peaks", tmp_path / "hybrid", model=deep_model, lengths=[lo, hi], **kw)
    (c_lo, c_hi), (h_lo, h_hi) = chunked["peaks"], hybrid["peaks"]
    cfg = read_config(Path(deep_model))
    per_token = _kv_bytes_per_token(cfg)
    print(f"chunked {c_lo >> 10} -> {c_hi >> 10} KiB, hybrid {h_lo >> 10} -> {h_hi >> 10} KiB")
    # Measured: the resident all-layer K/V grows with the context ...
    assert c_hi - c_lo >= 0.9 * per_token * (hi - lo), (c_lo, c_hi, per_token)
    # ... and hybrid prefilling, which keeps one layer's K/V, grows by less at the same chunk size.
    assert h_hi - h_lo < c_hi - c_lo
    # Declared: the profile-run budget bounds the measured peak and carries the K/V term.
    assert c_hi <= chunked["budget"], (c_hi, chunked["budget"])
    declared = [chunked_activation_bytes(cfg, torch.float32, n, 256) for n in (lo, hi)]
    assert declared[1] - declared[0] >= per_token * (hi - lo)
    assert chunked_activation_bytes(cfg, torch.float32, hi, 256) > activation_bytes(
        cfg, torch.float32, hi, 256
    )
