"""GGUF export of a checkpoint (`gguf_export.write_gguf`): our engine loads the written file and
gives the safetensors checkpoint's log-probs (bf16: the same weights bit for bit; Q8_0: within its
rounding), and llama.cpp (where llama-cpp-python is installed) scores the same tokens alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import llamacpp
from po_backend.core.errors import UnsupportedModelError
from po_backend.engine.engine import Engine
from po_backend.engine.models.gguf_export import write_gguf

# Qwen3's q/k norms and a head size that is not hidden / heads' default; a vocabulary that holds
# the shapes' real BPE tokenizer, padded in the GGUF as llama.cpp pads it.
TINY = "shape:qwen3-0.6b?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
TINY += "&num_key_value_heads=2&head_dim=24&vocab_size=49200"
IDS = list(range(100, 160))
LABELS = list(range(0, 49200, 997))


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gguf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PREFILLONLY_CACHE", str(root / "cache"))
        yield root


@pytest.fixture(scope="module")
def reference(cache: Path) -> torch.Tensor:
    engine = Engine.from_pretrained(TINY, dtype="float32", enable_cache=False)
    return torch.tensor(engine.score([IDS], LABELS)[0].logprobs)


def _ours(path: Path) -> torch.Tensor:
    engine = Engine.from_pretrained(str(path), dtype="float32", enable_cache=False)
    return torch.tensor(engine.score([IDS], LABELS)[0].logprobs)


@pytest.mark.parametrize(("kind", "atol"), [("bf16", 1e-4), ("q8_0", 2e-2)])
def test_engine_loads_the_written_gguf(cache: Path, reference: torch.Tensor, kind: str, atol: float) -> None:
    out = write_gguf(TINY, cache / f"tiny.{kind}.gguf", kind)
    got = _ours(out)
    torch.testing.assert_close(got, reference, atol=atol, rtol=0)
    if kind == "q8_0":  # rounded, not the same weights
        assert (got - reference).abs().max() > 1e-6


@pytest.mark.skipif(not llamacpp.available(), reason="llama-cpp-python is not installed (extra `llamacpp`)")
@pytest.mark.parametrize(("kind", "atol"), [("f16", 5e-3), ("q8_0", 2e-2)])
def test_llama_cpp_scores_the_same_tokens(
    cache: Path, reference: torch.Tensor, kind: str, atol: float
) -> None:
    out = write_gguf(TINY, cache / f"tiny.{kind}.gguf", kind)
    llm = llamacpp.load(out, n_ctx=256, n_batch=64)  # several batches
    got = torch.tensor(llamacpp.last_logprobs(llm, IDS)[LABELS], dtype=torch.float32)
    torch.testing.assert_close(got, reference, atol=atol, rtol=0)
    # The first 40 tokens' cache reused: the same answer.
    again = torch.tensor(llamacpp.last_logprobs(llm, IDS, keep=40)[LABELS], dtype=torch.float32)
    torch.testing.assert_close(again, got, atol=1e-5, rtol=0)
    # What the context holds of the next prompt: its shared head, never its last token.
    assert llamacpp.shared_prefix(llm, [*IDS[:30], 7, 8]) == 30
    assert llamacpp.shared_prefix(llm, IDS) == len(IDS) - 1
    assert llamacpp.shared_prefix(llm, [1, *IDS]) == 0


def test_unsupported_architecture_is_refused(cache: Path) -> None:
    gemma = "shape:gemma-2-2b?num_hidden_layers=1&hidden_size=32&intermediate_size=64&num_attention_heads=2"
    gemma += "&num_key_value_heads=1&head_dim=16&vocab_size=320"
    with pytest.raises(UnsupportedModelError, match="GGUF export"):
        write_gguf(gemma, cache / "gemma.gguf")
    with pytest.raises(ValueError, match="GGUF type"):
        write_gguf(TINY, cache / "x.gguf", "q4_0")


# Llama-3 RoPE scaling whose pretraining context (16) is short enough that the prompt's positions
# meet the scaled frequencies: written as llama.cpp's `rope_freqs` tensor.
LLAMA = "shape:llama-3.2-1b?num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
LLAMA += "&num_key_value_heads=2&head_dim=16&vocab_size=49200"
SCALED = LLAMA + (
    '&rope_scaling={"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,'
    '"original_max_position_embeddings":16}'
)


def test_scaled_llama_rope_round_trips(cache: Path) -> None:
    reference = _ours_of(SCALED)
    unscaled = _ours_of(LLAMA + '&rope_scaling={"rope_type":"default"}')
    # The same weights (each tensor seeded by its name): only the scaling differs. Random weights
    # attend almost uniformly, so it moves these log-probs by ~2e-3.
    assert (reference - unscaled).abs().max() > 1e-3
    out = write_gguf(SCALED, cache / "llama3.bf16.gguf", "bf16")
    torch.testing.assert_close(_ours(out), reference, atol=1e-4, rtol=0)
    if llamacpp.available():  # llama.cpp applies rope_freqs: nearer the scaled model than the unscaled
        llm = llamacpp.load(out, n_ctx=256, n_batch=64)
        got = torch.tensor(llamacpp.last_logprobs(llm, IDS)[LABELS], dtype=torch.float32)
        assert (got - reference).abs().mean() < 0.5 * (got - unscaled).abs().mean()


def _ours_of(model: str) -> torch.Tensor:
    engine = Engine.from_pretrained(model, dtype="float32", enable_cache=False)
    return torch.tensor(engine.score([IDS], LABELS)[0].logprobs)
