"""Bad input gets a typed error that names the problem, before any work is done."""

from __future__ import annotations

import json

import pytest
import transformers

from po_backend import (
    EmptyPromptError,
    Engine,
    InvalidRequestError,
    InvalidTokenError,
    ModelNotFoundError,
    PromptTooLongError,
    ScoreRequest,
    UnsupportedModelError,
)
from po_backend.core.settings import CPU_HYBRID_CHUNK_SIZE


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    path, _ = tiny_model("llama")
    return Engine.from_pretrained(path, dtype="fp32", memory_budget=64 << 20)


def test_empty_prompt(engine: Engine) -> None:
    with pytest.raises(EmptyPromptError, match="empty"):
        engine.score([[]], [1])


def test_prompt_longer_than_context(engine: Engine) -> None:
    n = engine.model_config.max_position_embeddings + 1
    with pytest.raises(PromptTooLongError, match=f"{n} tokens.*max_input_len=1024"):
        engine.score([[1] * n], [1])


def test_label_and_prompt_ids_outside_vocab(engine: Engine) -> None:
    with pytest.raises(
        InvalidTokenError, match=r"label token ids outside the vocabulary \[0, 300\): \[300\]"
    ):
        engine.score([[1, 2, 3]], [5, 300])
    with pytest.raises(InvalidTokenError, match="prompt"):
        engine.score([[1, -2, 3]], [5])


def test_text_without_tokenizer(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.score("hello", [1])


def test_bad_request_fields(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="logprob_start_len"):
        engine.run([ScoreRequest((1, 2, 3), (1,), logprob_start_len=3)])
    with pytest.raises(InvalidRequestError, match="cache_prefix_len"):
        engine.run([ScoreRequest((1, 2, 3), (1,), cache_prefix_len=4)])
    with pytest.raises(InvalidRequestError, match="top_k"):
        engine.run([ScoreRequest((1, 2, 3), (1,), top_k=-1)])


def test_max_input_len_override_warns(tiny_model, caplog) -> None:
    path, _ = tiny_model("llama")
    with caplog.at_level("WARNING"):
        eng = Engine.from_pretrained(path, dtype="fp32", max_input_len=1500, memory_budget=256 << 20)
    assert "exceeds the model's context" in caplog.text
    assert len(eng.score([[1] * 1200], [1])[0].logprobs) == 1


def test_unknown_architecture(tmp_path) -> None:
    cfg = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match="unsupported architecture.*gpt2"):
        Engine.from_pretrained(tmp_path)


def test_missing_weights(tiny_model, tmp_path) -> None:
    path, _ = tiny_model("llama")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ModelNotFoundError, match="safetensors"):
        Engine.from_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")
    cfg = json.loads((path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="yarn"):
        Engine.from_pretrained(tmp_path)


def test_config_and_overrides(tiny_model) -> None:
    """`from_pretrained(path, config, **overrides)`: EngineConfig field names, strings for dtype and
    device, model-dependent defaults for what is unset, and a bad value is a ValueError."""
    import torch

    from po_backend.engine.config import EngineConfig

    path, _ = tiny_model("llama")
    eng = Engine.from_pretrained(path, dtype="fp32", device="cpu", chunk_size=8, max_input_len=300)
    cfg = eng.config
    assert (cfg.dtype, cfg.device, cfg.chunk_size, cfg.max_input_len) == (
        torch.float32,
        torch.device("cpu"),
        8,
        300,
    )
    assert cfg.max_batch_tokens == 2048 and cfg.profile_full is False  # defaults for CPU
    base = EngineConfig(
        dtype=torch.float32, device=torch.device("cpu"), max_input_len=200, max_batch_tokens=400
    )
    again = Engine.from_pretrained(path, base, cache_policy="declared")
    assert again.config == EngineConfig(
        dtype=torch.float32,
        device=torch.device("cpu"),
        chunk_size=CPU_HYBRID_CHUNK_SIZE,  # the CPU hybrid default
        max_input_len=200,
        max_batch_tokens=400,
        cache_policy="declared",
        profile_full=False,
    )
    # One default per setting: a config that leaves max_input_len unset gets the model's context,
    # as the settings and the overrides do, and max_batch_tokens follows it.
    bare = Engine.from_pretrained(path, EngineConfig(dtype=torch.float32, device=torch.device("cpu")))
    assert bare.config.max_input_len == bare.model_config.max_position_embeddings == eng_context(path)
    assert bare.config.max_batch_tokens == max(bare.config.max_input_len, 2048)
    with pytest.raises(TypeError, match="max_input_length"):
        Engine.from_pretrained(path, dtype="fp32", max_input_length=10)
    for bad in (
        {"chunk_size": -1},
        {"cache_policy": "lru"},
        {"max_batch_tokens": 0},
        {"prefix_pool_tokens": 0},
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Engine.from_pretrained(path, dtype="fp32", **bad)


def test_prefix_pool_tokens_caps_the_pool(tiny_model) -> None:
    path, _ = tiny_model("llama")
    eng = Engine.from_pretrained(path, dtype="fp32", max_input_len=256, prefix_pool_tokens=100)
    assert eng.cache is not None and eng.cache.pool.num_total == 100
    prefix = list(range(1, 81))
    eng.score([prefix + [5], prefix + [6]], [1], cache_prefix_len=80)
    assert eng.stats().cached_tokens == 80  # the capped pool still serves a prefix that fits
    free = Engine.from_pretrained(path, dtype="fp32", max_input_len=256)
    assert free.cache is not None and free.cache.pool.num_total > 100


def eng_context(path) -> int:
    import json

    return int(json.loads((path / "config.json").read_text())["max_position_embeddings"])
