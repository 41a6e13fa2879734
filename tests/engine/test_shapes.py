"""`shape:NAME` model paths: each registered shape is the published model's configuration (checked by
transformers' own classes and the published parameter counts, on the meta device), and a cut-down
shape runs end to end with our engine matching transformers on the same random checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from po_backend.core.errors import ModelNotFoundError
from po_backend.engine.config import ModelConfig
from po_backend.engine.engine import Engine
from po_backend.engine.models import model_class, shapes
from po_backend.engine.models.loader import load_model, resolve_model_dir

# Parameter counts as the model cards and `model.num_parameters()` of the real checkpoints give them.
PUBLISHED_PARAMS = {
    "qwen3-0.6b": 596_049_920,
    "qwen2.5-1.5b": 1_543_714_304,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.1-8b": 8_030_261_248,
    "gemma-2-2b": 2_614_341_888,
}
# A few layers of a small width keep every architecture feature of the shape (biases, q/k norms,
# llama3 RoPE scaling, tying, Gemma's windows and soft-caps) at a test's size.
TINY = "num_hidden_layers=2&hidden_size=64&intermediate_size=128&num_attention_heads=4"
TINY += "&num_key_value_heads=2&head_dim=16&vocab_size=320"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_registry_is_the_published_configuration(name: str) -> None:
    cfg = shapes.hf_config(name)
    assert type(cfg).__name__ == {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config"}.get(
        cfg.model_type, type(cfg).__name__
    )
    arch = getattr(transformers, cfg.architectures[0])
    with torch.device("meta"):
        hf = arch(cfg)
        ours = model_class(ModelConfig.from_hf(cfg.to_dict()))(
            ModelConfig.from_hf(cfg.to_dict()), torch.bfloat16
        )
    n_hf = sum(p.numel() for p in hf.parameters())
    if name in PUBLISHED_PARAMS:
        assert n_hf == PUBLISHED_PARAMS[name]
    # Our decoder holds the same weights (the classifier's one-row score head aside).
    head = cfg.hidden_size * cfg.num_labels if "SequenceClassification" in cfg.architectures[0] else 0
    assert sum(p.numel() for p in ours.parameters()) == n_hf - head
    mc = ModelConfig.from_hf(cfg.to_dict())
    assert (mc.num_layers, mc.hidden_size, mc.vocab_size) == (
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.vocab_size,
    )


def test_rope_scaling_and_windows_survive_the_config_class() -> None:
    rope = ModelConfig.from_hf(shapes.hf_config("llama-3.1-8b").to_dict()).rope
    assert (rope.kind, rope.factor, rope.theta, rope.original_max_position) == ("llama3", 8.0, 500000.0, 8192)
    gemma = ModelConfig.from_hf(shapes.hf_config("gemma-2-2b").to_dict())
    assert gemma.layer_window(0) == 4096 and gemma.layer_window(1) is None
    assert not shapes.hf_config("llama-3.1-8b").tie_word_embeddings
    assert shapes.hf_config("qwen2.5-1.5b").tie_word_embeddings


@pytest.mark.parametrize(
    "name,extra",
    [
        ("qwen2.5-1.5b", ""),
        ("qwen3-0.6b", ""),
        ("llama-3.2-1b", ""),
        ("llama-3.1-8b", ""),
        # a window shorter than the prompt, so the sliding layers differ from full attention
        ("gemma-2-2b", "&sliding_window=16&query_pre_attn_scalar=16"),
    ],
)
def test_tiny_shape_matches_transformers(name: str, extra: str, cache: Path) -> None:
    path = f"shape:{name}?{TINY}{extra}"
    engine = Engine.from_pretrained(path, dtype="fp32")
    folder = resolve_model_dir(path)
    assert folder.is_relative_to(cache / "shapes")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = engine.tokenizer.encode("A byte-level tokenizer: every id below 257. " * 2)
    assert 0 < max(ids) < 257 and len(ids) > 32
    got = engine.score([ids], [5, 300])[0].logprobs
    with torch.inference_mode():
        want = hf(torch.tensor([ids])).logits[0, -1].log_softmax(-1)[[5, 300]].tolist()
    assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= 1e-4
    # the same path twice is the same folder, built once
    assert resolve_model_dir(path) == folder


def test_reranker_shape_is_a_one_logit_classifier() -> None:
    path = f"shape:qwen3-reranker-0.6b?{TINY}"
    engine = Engine.from_pretrained(path, dtype="fp32")
    assert engine.task.kind == "classify" and engine.task.activation == "sigmoid"
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        resolve_model_dir(path), dtype=torch.float32
    ).eval()
    ids = list(range(40, 90))
    (probs,) = engine.classify([ids])
    with torch.inference_mode():
        want = torch.sigmoid(hf(torch.tensor([ids])).logits[0]).tolist()
    assert abs(probs[0] - want[0]) <= 1e-5


def test_in_memory_weights_write_nothing_and_are_seeded(cache: Path) -> None:
    """What the engine does on a GPU, on the CPU: parameters filled where they live."""
    path = f"shape:llama-3.2-1b?{TINY}"
    folder = resolve_model_dir(path, weights=False)
    assert not list(folder.glob("*.safetensors"))
    a = load_model(folder, torch.float32, torch.device("cpu"))
    b = load_model(folder, torch.float32, torch.device("cpu"))
    assert not list(folder.glob("*.safetensors"))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), n
    assert torch.equal(a.norm, torch.ones_like(a.norm)) and a.embed_tokens.std() > 0.01


def test_needs_weights_only_off_cuda() -> None:
    assert shapes.needs_weights(torch.device("cpu"))
    assert not shapes.needs_weights(torch.device("cuda", 0))


def test_bad_shape_paths_are_clear_errors() -> None:
    with pytest.raises(ModelNotFoundError, match="registered shapes: .*llama-3.1-8b"):
        Engine.from_pretrained("shape:llama-9b", dtype="fp32")
    assert shapes.parse("/some/folder") is None
    assert shapes.parse("shape:qwen3-0.6b?num_hidden_layers=2") == ("qwen3-0.6b", {"num_hidden_layers": 2})
    assert shapes.weights_note("shape:qwen3-0.6b") == "random weights, real shape"
    assert shapes.weights_note("embedded") is None


@pytest.mark.slow
@pytest.mark.embedded
def test_real_vocabulary_gets_the_embedded_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFILLONLY_CACHE")  # the embedded model's conversion is cached there
    small = "num_hidden_layers=1&hidden_size=64&intermediate_size=128&num_attention_heads=2"
    engine = Engine.from_pretrained(
        f"shape:qwen3-0.6b?{small}&num_key_value_heads=1&head_dim=32", dtype="fp32"
    )
    assert len(engine.tokenizer) == 49152 < engine.vocab_size == 151936
    ids = engine.tokenizer.encode("Will the user engage with this post? Your answer is: Yes")
    assert max(ids) < 49152 and len(ids) < 20  # BPE, not bytes
    assert len(engine.score([ids], [5])[0].logprobs) == 1


def test_transformers_baseline_takes_a_shape_path() -> None:
    from po_backend.core.request import ScoreRequest
    from po_backend.engine.hf_scorer import HFScorer

    path = f"shape:qwen2.5-1.5b?{TINY}"
    hf = HFScorer.from_pretrained(path, dtype="fp32", device="cpu")
    ours = Engine.from_pretrained(path, dtype="fp32")
    ids = list(range(10, 60))
    a, b = hf.score(ScoreRequest(tuple(ids), (5,))).logprobs, ours.score([ids], [5])[0].logprobs
    assert abs(a[0] - b[0]) <= 1e-4
