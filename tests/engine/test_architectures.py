"""Gemma, Gemma 2, Gemma 3 and Phi-3 / Phi-4-mini against transformers' own classes on the same tiny random
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
    # Gemma (1), bge-reranker-v2-gemma's base: Llama's layer order, Gemma's norms and MLP.
    "gemma": (
        transformers.GemmaConfig,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            tie_word_embeddings=True,
        ),
    ),
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
    # Mistral v0.1: a window on every layer; Qwen2 with use_sliding_window: on the layers from
    # max_window_layers on.
    "mistral-window": (
        transformers.MistralConfig,
        dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=WINDOW),
    ),
    "qwen2-window": (
        transformers.Qwen2Config,
        dict(
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
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
        assert cfg.hidden_act == "gelu_pytorch_tanh"
    if kind == "gemma":
        assert cfg.sliding_layers == () and cfg.scale == 16**-0.5 and cfg.final_softcap is None
    elif kind.startswith("gemma"):
        assert cfg.sliding_layers == (True, False, True) and cfg.sliding_window == WINDOW
    if kind == "gemma2":
        assert (cfg.attn_softcap, cfg.final_softcap, cfg.scale) == (3.0, 5.0, 24**-0.5)
    if kind == "gemma3":
        assert cfg.qk_norm and cfg.rope_local is not None and cfg.rope_local.theta == 100.0
        assert (cfg.rope.kind, cfg.rope.factor, cfg.attn_softcap) == ("linear", 2.0, None)
    if kind == "phi3":
        assert cfg.head_dim == 96 and cfg.sliding_layers == (True,) * 3
    if kind == "mistral-window":
        assert cfg.sliding_layers == (True,) * 3 and cfg.max_position_embeddings == 512
    if kind == "qwen2-window":
        assert cfg.sliding_layers == (False, True, True) and cfg.sliding_window == WINDOW
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
        ModelConfig.from_hf({**base, "model_type": "recurrent_gemma"})


def _build_head(kind: str, root: Path, auto: type, **extra: object) -> tuple[Path, torch.nn.Module]:
    """A tiny random `<Arch>ForSequenceClassification` (auto = AutoModelForSequenceClassification)
    or bare decoder (AutoModel), saved with transformers."""
    cls, base = ARCHS[kind]
    cfg = cls(**{**BASE, **base, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = auto.from_config(cfg, dtype=torch.float32)
    randomize_(model, 3)
    if kind.startswith("gemma"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    path = root / f"{kind}-{auto.__name__}"
    model.save_pretrained(path)
    return path, model.eval()


# Every architecture here whose transformers has a sequence-classification class.
HEAD_KINDS = ["gemma2", "gemma3", "phi3"]


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_classifier_head_matches_transformers(kind: str, tmp_path: Path) -> None:
    """Gemma2/Gemma3Text/Phi3ForSequenceClassification: the score head on the last token's final
    hidden state (Gemma's (1 + w) final norm, no logit soft-cap), cold, over a cached prefix longer
    than the window, and as one multi-item forward."""
    id2label = {0: "neg", 1: "neu", 2: "pos"}
    path, hf = _build_head(
        kind, tmp_path, transformers.AutoModelForSequenceClassification, num_labels=3, id2label=id2label
    )
    eng = _engine(path, chunk_size=16, cache_policy="declared")
    assert eng.task.kind == "classify" and eng.task.labels == ("neg", "neu", "pos")
    prefix = [t for t in _rand(PREFIX, 800) if t != 0]  # pad_token_id 0 must not end a prompt
    items = [prefix + [t or 1 for t in _rand(n, 900 + n)] for n in (2, WINDOW + 4, 21)]
    cold = [_rand(30, 7)]
    reqs = [ScoreRequest(tuple(p), pool=True, cache_prefix_len=len(prefix)) for p in items]
    results = eng.run([ScoreRequest(tuple(cold[0]), pool=True), *reqs])
    assert [r.cached_tokens for r in results[1:]] == [0, len(prefix), len(prefix)]
    again = eng.run(reqs[1:2])
    assert again[0].cached_tokens == len(prefix)
    for ids, res in zip([*cold, *items, items[1]], [*results, *again], strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0].float()
        assert max(abs(a - b) for a, b in zip(res.outputs, want.tolist(), strict=True)) <= TOL


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_mean_pooled_embedding_matches_transformers(kind: str, tmp_path: Path) -> None:
    """A bare Gemma2Model / Gemma3TextModel / Phi3Model as an embedder (mean pooling, forced by the
    task setting): the mean over a cached prefix read through sliding windows equals the cold one."""
    path, hf = _build_head(kind, tmp_path, transformers.AutoModel)
    eng = _engine(path, chunk_size=16, cache_policy="declared", task="embed", pooling="mean")
    prefix = _rand(PREFIX, 1000)
    items = [prefix + _rand(n, 1100 + n) for n in (3, 17)]
    got = eng.embed(items, cache_prefix_len=PREFIX) + eng.embed(items[1:], cache_prefix_len=PREFIX)
    for ids, vec in zip([*items, items[1]], got, strict=True):
        with torch.no_grad():
            want = hf(torch.tensor([ids])).last_hidden_state[0].float().mean(0)
        if eng.task.normalize:  # a forced embed task normalises, as vLLM's default does
            want = torch.nn.functional.normalize(want, dim=0)
        assert max(abs(a - b) for a, b in zip(vec, want.tolist(), strict=True)) <= TOL


# The families' chat formats (as their tokenizer_config.json ships them), their turn markers
# added to the embedded model's tokenizer as special tokens, as the real tokenizers have them.
CHAT = {
    "gemma": (
        ["<start_of_turn>", "<end_of_turn>"],
        "{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' "
        "else m['role'] %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n"
        "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    ),
    "phi": (
        ["<|user|>", "<|assistant|>", "<|end|>"],
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    ),
}


@pytest.mark.embedded
@pytest.mark.parametrize("kind", ["gemma2", "gemma3", "phi3"])
def test_real_tokenizer_and_chat_template(kind: str, tmp_path: Path) -> None:
    """Text end to end with a real tokenizer (the embedded model's, nothing downloaded) and the
    family's chat template: a yes/no reranker prompt per passage, the query's turn shared as the
    cached prefix, scored in one multi-item forward, each equal to transformers on the same ids."""
    from po_backend.engine.models.loader import converted_gguf_dir, embedded_model_file

    src = converted_gguf_dir(embedded_model_file())
    tok = transformers.AutoTokenizer.from_pretrained(src)
    markers, template = CHAT["phi" if kind.startswith("phi") else "gemma"]
    tok.add_special_tokens({"additional_special_tokens": markers})
    tok.chat_template = template
    cls, base = ARCHS[kind]
    cfg = cls(**{**BASE, **base, "vocab_size": len(tok)})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(hf, 4)
    if kind.startswith("gemma"):
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.sub_(1.0)
    hf.save_pretrained(tmp_path / kind)
    tok.save_pretrained(tmp_path / kind)
    hf.eval()

    eng = _engine(tmp_path / kind, chunk_size=16, cache_policy="declared")
    assert eng.tokenizer.chat_template == template
    query = "A: what do hikers carry on long trails?\nB: "
    passages = ["water, maps and a first aid kit", "the stock market fell today", "boots"]
    texts = [
        eng.tokenizer.apply_chat_template(
            [{"role": "user", "content": query + p + "\nDoes B answer A? Yes or No."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for p in passages
    ]
    ids = [eng.tokenizer.encode(t) for t in texts]
    assert all(markers[0] in t for t in texts)
    assert all(eng.tokenizer.convert_tokens_to_ids(markers[0]) in i for i in ids)  # one token each
    shared = next(n for n in range(min(map(len, ids))) if len({tuple(i[: n + 1]) for i in ids}) > 1)
    assert shared > WINDOW  # the query's turn is longer than the window
    yes, no = eng.tokenizer.encode("Yes")[-1], eng.tokenizer.encode("No")[-1]
    results = eng.run([ScoreRequest(tuple(i), (yes, no), cache_prefix_len=shared) for i in ids])
    assert [r.cached_tokens for r in results] == [0, shared, shared]
    for i, res in zip(ids, results, strict=True):
        want = _hf(hf, i)[[yes, no]].tolist()
        assert max(abs(a - b) for a, b in zip(res.logprobs, want, strict=True)) <= TOL


def _dense_reference(q, k, v, pk, pv, scale, window, softcap) -> torch.Tensor:
    """Masked softmax over the prefix and own keys concatenated, as transformers' eager path."""
    n, heads, d = q.shape
    keys, vals = torch.cat([pk, k]), torch.cat([pv, v])
    g = heads // k.shape[1]
    keys, vals = keys.repeat_interleave(g, dim=1), vals.repeat_interleave(g, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q, keys) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    qpos = torch.arange(pk.shape[0], pk.shape[0] + n)[:, None]
    kpos = torch.arange(keys.shape[0])[None, :]
    seen = kpos <= qpos
    if window is not None:
        seen &= qpos - kpos < window
    s = s.masked_fill(~seen, -torch.inf)
    return torch.einsum("hnm,mhd->nhd", torch.softmax(s, -1), vals).reshape(n, heads * d)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (None, 2.0), (7, 3.0), (1, None)])
@pytest.mark.parametrize("block", [1 << 22, 400])  # one block, and blocks of a few rows
def test_windowed_attend_matches_dense(window, softcap, block, monkeypatch) -> None:
    from po_backend.engine import attention

    monkeypatch.setattr(attention, "FALLBACK_BLOCK_ELEMS", block)
    g = torch.Generator().manual_seed(0)
    heads, kv, d, n, p = 6, 2, 16, 23, 19
    q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, kv, kv))
    pk, pv = torch.randn(p, kv, d, generator=g), torch.randn(p, kv, d, generator=g)
    for prefix in (0, 3, p):  # no prefix, one the window covers, one it crosses
        out = torch.empty(n, heads * d)
        attention.attend(q, k, v, out, 0.3, pk[:prefix], pv[:prefix], window=window, softcap=softcap)
        want = _dense_reference(q, k, v, pk[:prefix], pv[:prefix], 0.3, window, softcap)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # Items over the prefix: each sees the prefix and itself only.
    bounds = [(0, 4), (4, 5), (5, 23)]
    out = torch.empty(n, heads * d)
    attention.attend_items(q, k, v, out, 0.3, bounds, pk, pv, window=window, softcap=softcap)
    for a, b in bounds:
        want = _dense_reference(q[a:b], k[a:b], v[a:b], pk, pv, 0.3, window, softcap)
        torch.testing.assert_close(out[a:b], want, atol=1e-5, rtol=1e-5)


def test_windows_that_cover_every_key_keep_the_fast_paths(monkeypatch) -> None:
    from po_backend.engine import attention

    assert not attention.needs_masking(10, 10, None) and attention.needs_masking(11, 10, None)
    assert attention.needs_masking(3, None, 50.0) and not attention.needs_masking(10**6, None, None)

    def boom(*args, **kwargs):
        raise AssertionError("the plain causal path should run")

    monkeypatch.setattr(attention, "windowed_attend", boom)
    q, k, v = torch.randn(8, 4, 16), torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    attention.attend(
        q, k, v, torch.empty(8, 64), 0.25, torch.randn(2, 2, 16), torch.randn(2, 2, 16), window=10
    )


def test_kernel_fallbacks_are_logged(monkeypatch, caplog) -> None:
    """Where the bf16 CPU kernel would run, a head dim it does not take (Phi-3's 96) and a layer
    it cannot mask (a window, soft-capping) each say why once, and run elsewhere."""
    from po_backend.engine import attention, attention_cpu

    monkeypatch.setattr(attention_cpu, "choose", lambda dtype, device: "kernel")
    monkeypatch.setattr(attention_cpu, "load_kernel", lambda: False)  # no build needed here
    attention_cpu._note_head_dim.cache_clear()
    attention._log_once.cache_clear()
    q = torch.randn(12, 2, 96, dtype=torch.bfloat16)
    with caplog.at_level("INFO"):
        assert not attention_cpu.supported(q)
        attention.attend(q, q[:, :1], q[:, :1], torch.empty(12, 192, dtype=torch.bfloat16), 0.1, softcap=5.0)
    assert "head dim 96 is not a multiple of 64" in caplog.text
    assert "takes neither sliding windows nor soft-capping" in caplog.text


@pytest.mark.parametrize("kind", ["gemma2", "phi3"])
def test_bf16_close_to_fp32(arch, kind: str) -> None:
    path, _ = arch(kind)
    prompts = [_rand(n, 10 + n) for n in (30, 90)]
    e32 = _engine(path, enable_cache=False)
    e16 = Engine.from_pretrained(
        path, dtype="bf16", max_input_len=256, max_batch_tokens=512, enable_cache=False
    )
    for a, b in zip(e32.run(_reqs(prompts)), e16.run(_reqs(prompts)), strict=True):
        # bf16 keeps ~3 significant digits; the tiny random model has large logits.
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 0.5


# config.json as checkpoints on the hub spell them (transformers 4.x keys: rope_theta, rope_scaling,
# rope_local_base_freq, sliding_window_pattern, no layer_types), shrunk to the tiny sizes.
LEGACY: dict[str, tuple[type, dict]] = {
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            model_type="gemma2", hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16,
            attn_logit_softcapping=4.0, final_logit_softcapping=6.0, sliding_window=WINDOW,
            cache_implementation="hybrid", rope_theta=10000.0, tie_word_embeddings=True,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            model_type="gemma3_text", hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16, sliding_window=WINDOW,
            sliding_window_pattern=2, rope_theta=1000000.0, rope_local_base_freq=10000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, attn_logit_softcapping=None,
            final_logit_softcapping=None, tie_word_embeddings=True,
        ),
    ),
    "phi4-mini": (
        transformers.Phi3Config,
        dict(
            model_type="phi3", hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
            partial_rotary_factor=0.75, original_max_position_embeddings=128, rope_theta=10000.0,
            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(12)],
                          "long_factor": [4.0] * 12},
            sliding_window=262144, hidden_act="silu", tie_word_embeddings=True,
        ),
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(LEGACY))
def test_hub_style_configs_match_transformers(kind: str, tmp_path: Path) -> None:
    """transformers reads these legacy keys into its own layout; our reader must agree with it on
    every layer's RoPE base, scaling and window (the model saved, then its config.json replaced by
    the legacy one)."""
    cls, legacy = LEGACY[kind]
    cfg = cls(**{**BASE, **legacy})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(hf, 5)
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **legacy}))
    eng = _engine(tmp_path, chunk_size=16, enable_cache=False)
    if kind != "phi4-mini":
        want = [t == "sliding_attention" for t in cfg.layer_types]
        assert list(eng.model_config.sliding_layers) == want
    prompts = [_rand(n, 1200 + n) for n in (6, 70)]
    _check(hf.eval(), prompts, eng.run(_reqs(prompts)))


def test_measured_peak_within_activation_budget_with_softcap_and_windows(tmp_path: Path) -> None:
    """The soft-capped full layer's score blocks and the sliding layers' windows are counted: a
    full-length forward that also fills the pool stays within the profile run's budget (both
    measured in one fresh interpreter: tests/memory_probe.py)."""
    from po_backend.engine.attention import masked_scratch_bytes
    from tests.memory_probe import in_fresh_process

    n = 3072
    cfg = transformers.Gemma2Config(
        vocab_size=4000, hidden_size=256, intermediate_size=768, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, sliding_window=512,
        max_position_embeddings=n, attn_logit_softcapping=50.0,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path)
    got = in_fresh_process(
        "request_peak", tmp_path / "memory", model=str(tmp_path), n=n, prefix_len=n - 1,
        dtype="fp32", max_input_len=n, chunk_size=256, memory_budget=1 << 30,
    )  # fmt: skip
    assert got["bound"] >= masked_scratch_bytes(8, n, torch.float32)
    assert got["peak"] <= got["budget"] + got["pool_written"], got
