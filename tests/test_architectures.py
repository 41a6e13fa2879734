"""Gemma 2, Gemma 3 and Phi-3 / Phi-4-mini against transformers' own classes on the same tiny random
weights (fp32, max |d| <= 1e-4 on label log-probs), through every path a prompt can take: cold,
a cached prefix (a later request reads it from the cache), items over a shared prefix in one
forward, small chunks, and the chunked-prefill baseline. Sliding windows are smaller than the
cached prefix, so a window crosses it; soft-capping is set low enough to bend the scores."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import transformers

from po_backend import Engine, ScoreRequest, UnsupportedModelError
from po_backend.engine.config import ModelConfig
from tests.conftest import randomize_

TOL = 1e-4
WINDOW = 8
PREFIX = 40  # > WINDOW: items' windows reach into the cached prefix, then leave it
VOCAB = 300
LABELS = (0, 7, 123, VOCAB - 1)
BASE = dict(
    vocab_size=VOCAB,
    intermediate_size=96,
    num_hidden_layers=3,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]

ARCHS: dict[str, tuple[type, dict]] = {
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING,
            query_pre_attn_scalar=24,  # != head_dim: the scale must come from it
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=WINDOW,
            layer_types=SLIDING,
            query_pre_attn_scalar=20,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            },
            tie_word_embeddings=False,
        ),
    ),
    # Phi-3-mini's shape: head dim 96, a sliding window over every layer.
    "phi3": (
        transformers.Phi3Config,
        dict(hidden_size=192, num_attention_heads=2, num_key_value_heads=1, sliding_window=WINDOW),
    ),
    # Phi-4-mini's: partial rotary, longrope (short factors within the pretraining length, and
    # the attention factor from the context's growth), tied embeddings.
    "phi4-mini": (
        transformers.Phi3Config,
        dict(
            hidden_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=128,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0 + 0.15 * i for i in range(12)],
                "long_factor": [3.0 + 0.5 * i for i in range(12)],
            },
            tie_word_embeddings=True,
        ),
    ),
}


def build(kind: str, root: Path, seed: int = 0) -> tuple[Path, torch.nn.Module]:
    cls, extra = ARCHS[kind]
    cfg = cls(**{**BASE, **extra})
    cfg._attn_implementation = "eager"  # the reference: transformers' plain masked softmax
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, seed)
    if kind.startswith("gemma"):  # Gemma norms scale by (1 + w): centre w on 0, not 1
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    path = root / kind
    model.save_pretrained(path)
    return path, model.eval()


@pytest.fixture(scope="module")
def arch(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("arch")
    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(kind: str) -> tuple[Path, torch.nn.Module]:
        if kind not in built:
            built[kind] = build(kind, root)
        return built[kind]

    return get


def _rand(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(n)]


def _hf(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)


def _engine(path: Path, **kw) -> Engine:
    return Engine.from_pretrained(path, dtype="fp32", max_input_len=256, max_batch_tokens=512, **kw)


def _check(model: torch.nn.Module, prompts: list[list[int]], results) -> None:
    for ids, res in zip(prompts, results, strict=True):
        ref = _hf(model, ids)
        worst = max(abs(a - b) for a, b in zip(res.logprobs, ref[list(LABELS)].tolist(), strict=True))
        assert worst <= TOL, f"{len(ids)} tokens: max |d| = {worst:.2e}"
        assert [t for t, _ in res.top_logprobs] == ref.topk(3).indices.tolist()


def _reqs(prompts: list[list[int]], cache_len: int | None = None) -> list[ScoreRequest]:
    return [ScoreRequest(tuple(p), LABELS, top_k=3, cache_prefix_len=cache_len) for p in prompts]


KINDS = sorted(ARCHS)


@pytest.mark.parametrize("kind", KINDS)
def test_config_reads_the_architecture(arch, kind: str) -> None:
    path, _ = arch(kind)
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()))
    if kind.startswith("gemma"):
        assert cfg.sliding_layers == (True, False, True) and cfg.sliding_window == WINDOW
        assert cfg.hidden_act == "gelu_pytorch_tanh"
    if kind == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.scale) == (3.0, 5.0, 24**-0.5)
    if kind == "gemma3":
        assert cfg.qk_norm and cfg.rope_local is not None and cfg.rope_local.theta == 100.0
        assert (cfg.rope.kind, cfg.rope.factor, cfg.attn_softcap) == ("linear", 2.0, None)
    if kind == "phi3":
        assert cfg.head_dim == 96 and cfg.sliding_layers == (True,) * 3
    if kind == "phi4-mini":
        assert cfg.rope.kind == "longrope" and cfg.rope.rotary_dim(cfg.head_dim) == 24
        assert cfg.rope.attention_factor > 1.0
        # Past the pretraining length transformers switches every position to the long factors:
        # the context is capped there, where cached prefixes stay exact.
        assert cfg.max_position_embeddings == 128


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("chunk_size", [7, 4096])
def test_cold_matches_transformers(arch, kind: str, chunk_size: int) -> None:
    path, hf = arch(kind)
    eng = _engine(path, chunk_size=chunk_size, enable_cache=False)
    prompts = [_rand(n, n) for n in (1, 5, WINDOW, WINDOW + 1, 33, 120)]
    _check(hf, prompts, eng.run(_reqs(prompts)))  # one packed forward of different lengths


@pytest.mark.parametrize("kind", KINDS)
def test_cached_prefix_and_items_match_transformers(arch, kind: str) -> None:
    """A prefix cached by one request and read by the next; then items over a shared prefix in
    one forward (the first computes it, the rest read it in the same forward); item lengths
    below, at and beyond the window."""
    path, hf = arch(kind)
    eng = _engine(path, chunk_size=16, cache_policy="declared")
    prefix = _rand(PREFIX, 100)
    seq = [prefix + _rand(n, 200 + n) for n in (3, 20)]
    warm = [eng.run(_reqs([p], PREFIX))[0] for p in seq]
    assert [r.cached_tokens for r in warm] == [0, PREFIX]
    _check(hf, seq, warm)

    other = _rand(PREFIX, 300)
    items = [other + _rand(n, 400 + n) for n in (1, WINDOW - 1, WINDOW + 3, 30)]
    forwards = eng.stats().forwards
    batched = eng.run(_reqs(items, PREFIX))
    assert eng.stats().forwards == forwards + 1
    assert [r.cached_tokens for r in batched] == [0, PREFIX, PREFIX, PREFIX]
    _check(hf, items, batched)
    # The same items again: every one reads the prefix from the cache.
    again = eng.run(_reqs(items, PREFIX))
    assert [r.cached_tokens for r in again] == [PREFIX] * 4
    _check(hf, items, again)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_baseline_matches_transformers(arch, kind: str) -> None:
    """Sarathi-style chunked prefill: each chunk attends to earlier chunks and a cached prefix
    (concatenated), so windows cross chunk and prefix boundaries."""
    path, hf = arch(kind)
    eng = _engine(path, chunk_size=6, cache_policy="declared", prefill_mode="chunked")
    prefix = _rand(PREFIX, 500)
    items = [prefix + _rand(n, 600 + n) for n in (2, 13, 25)]
    results = eng.run(_reqs(items, PREFIX))
    assert [r.cached_tokens for r in results] == [0, PREFIX, PREFIX]
    _check(hf, items, results)


def test_multimodal_gemma3_checkpoint_serves_its_text_model(arch, tmp_path: Path) -> None:
    """Gemma3ForConditionalGeneration (a `gemma3` config with text_config, the text model's
    tensors under language_model) loads as its text model, the vision tower ignored."""
    path, hf = arch("gemma3")
    text_cfg = json.loads((path / "config.json").read_text())
    cfg = transformers.Gemma3Config(
        text_config=text_cfg,
        vision_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),  # fmt: skip
        mm_tokens_per_image=4,
        image_token_index=VOCAB - 3,
        boi_token_index=VOCAB - 2,
        eoi_token_index=VOCAB - 1,
        tie_word_embeddings=False,
    )
    mm = transformers.Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        mm.model.language_model.load_state_dict(hf.model.state_dict())
        mm.lm_head.weight.copy_(hf.lm_head.weight)
    mm.save_pretrained(tmp_path / "mm")
    eng = _engine(tmp_path / "mm", enable_cache=False)
    prompts = [_rand(n, 700 + n) for n in (4, 50)]
    _check(hf, prompts, eng.run(_reqs(prompts)))


def test_unsupported_gemma_features_are_refused(arch) -> None:
    path, _ = arch("gemma3")
    base = json.loads((path / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="bidirectional"):
        ModelConfig.from_hf({**base, "use_bidirectional_attention": True})
    with pytest.raises(UnsupportedModelError, match="hidden_act 'relu'"):
        ModelConfig.from_hf({**base, "hidden_activation": "relu"})
    with pytest.raises(UnsupportedModelError, match="supported model types.*gemma2.*phi3"):
        ModelConfig.from_hf({**base, "model_type": "gemma"})
