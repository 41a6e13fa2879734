"""W8A8 int8 (`--quantization w8a8_int8`): the int8 linear against dequantized fp32 math, the
quantized model against transformers (the same int8 rounding emulated in fp32, tightly; plain fp32,
within a stated tolerance), the int8 cache, GGUF Q8_0, and the GEMM dispatch per CPU class."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from po_backend import Engine
from po_backend.core import cpu
from po_backend.engine.models import int8
from po_backend.engine.models.int8 import Int8Linear, gemm_backend, quantize_rows
from po_backend.engine.models.loader import INT8_CACHE_ENV
from tests.conftest import TINY_CONFIGS, hf_next_logprobs

KINDS = sorted(TINY_CONFIGS)


def _fake_quant_rows(x: torch.Tensor) -> torch.Tensor:
    """x quantized per row to symmetric int8 (rounded in fp32, as the engine rounds) and back in
    fp64: the reference of the int8 math."""
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    return (xf / s).round().clamp(-127, 127).double() * s.double()


@pytest.mark.parametrize("backend", ["int_mm", "reference"])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 24), (37, 576, 960), (300, 1536, 40)])
def test_int8_linear_matches_dequantized_reference(backend: int8.GemmBackend, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4  # rows of different scales
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    lin = Int8Linear.from_float(w, backend)
    ref = _fake_quant_rows(x) @ _fake_quant_rows(w).t()
    got = lin(x)
    assert got.dtype == torch.float32
    # The int32 sums are exact; what differs from fp64 is the final fp32 rounding of two products.
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
    # A bf16 output buffer gets the fp32 result rounded once.
    out = torch.empty(m, n, dtype=torch.bfloat16)
    lin(x.bfloat16(), out=out)
    torch.testing.assert_close(out.float(), lin(x.bfloat16().float()), rtol=2**-8, atol=0)
    # Against the unquantized product: the error of 8-bit rounding of both operands.
    exact = x.double() @ w.double().t()
    assert (got.double() - exact).abs().max() <= 0.05 * exact.abs().max()


def test_backends_give_the_same_int32_sums() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (19, 4096), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (4096, 40), dtype=torch.int8, generator=g)
    ref = (q.long() @ w.long()).to(torch.int32)  # sums up to 4096 * 127^2: beyond fp32's 2^24
    assert torch.equal(int8._gemm(q, w, "int_mm"), ref)
    assert torch.equal(int8._gemm(q, w, "reference"), ref)


def test_quantize_rows_is_symmetric_per_row() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0], [-3.0, 3.0, 1.5]])
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.abs().amax(1).tolist() == [127, 0, 127]
    torch.testing.assert_close(s, torch.tensor([2 / 127, 1e-12 / 127, 3 / 127]))


@pytest.mark.parametrize(
    ("flags", "backend"),
    [
        (frozenset({"avx2", "avx512f", "avx512_vnni", "amx_int8", "amx_bf16"}), "int_mm"),  # AMX
        (frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}), "int_mm"),  # AVX512-VNNI
        (frozenset({"avx2", "avx_vnni"}), "int_mm"),  # AVX-VNNI
        (frozenset({"avx2", "fma"}), "fbgemm"),  # AVX2-only
        (frozenset(), "reference"),  # no x86 flags
    ],
)
def test_dispatch_per_cpu_class(
    monkeypatch: pytest.MonkeyPatch, tiny_model, flags: frozenset[str], backend: str
) -> None:
    assert gemm_backend(flags).backend == backend
    # The engine asks the (patchable) flags at load. int_mm and reference compute the same int32
    # sums (equal answers); fbgemm's activations are 7-bit (answers within int8's error).
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(int8, "cpu_flags", lambda: flags)
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.PER_CHANNEL)  # blocks run one GEMM everywhere
    path, _ = tiny_model("qwen2")
    engine = _engine(path)
    layer = engine.model.decoder_layers[0]
    assert isinstance(layer.gate_up_proj, Int8Linear) and layer.gate_up_proj.backend == backend
    monkeypatch.setattr(int8, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    base = _engine(path)
    assert base.model.decoder_layers[0].gate_up_proj.backend == "int_mm"
    ids = _prompts(engine.vocab_size, [70])[0]
    got, ref = engine.score([ids], [0, 3])[0].logprobs, base.score([ids], [0, 3])[0].logprobs
    assert got == pytest.approx(ref, abs=0.25 if backend == "fbgemm" else 1e-5)


def test_fbgemm_linear_within_int8_error() -> None:
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(300, 576, generator=g), torch.randn(960, 576, generator=g)
    x[:, 3] *= 30  # an outlier channel, as trained models have
    exact = x.double() @ w.double().t()
    lin = Int8Linear.from_float(w, "fbgemm")
    assert int(lin.qweight.abs().max()) == int8.FBGEMM_WMAX
    got = lin(x).double()
    # 8-bit activations: the error of the same rounding emulated in fp64 (7-bit ones double it).
    emulated = _fake_quant_rows(x) @ lin.dequantized().double().t()
    assert (got - exact).norm() <= 1.05 * (emulated - exact).norm()
    assert (got - exact).abs().max() <= 0.05 * exact.abs().max()


def test_fbgemm_never_saturates() -> None:
    # fbgemm's AVX2 kernel adds u8 x s8 pairs in int16: rows at full range times full-range
    # weights are its worst case (8-bit weights there would read 2 instead of 256).
    w = torch.ones(64, 256)
    x = torch.ones(3, 256)
    x[1] = -1
    x[2, ::2] = -1
    lin = Int8Linear.from_float(w, "fbgemm")
    torch.testing.assert_close(lin(x), x @ w.t(), rtol=0.01, atol=0.01)
    # A weight stored at +-127 (the int8 cache of another backend, a GGUF) is re-rounded to +-63.
    q, scale = quantize_rows(w)
    assert int(Int8Linear(q.t().contiguous(), scale, "fbgemm").qweight.abs().max()) == 63


@pytest.mark.parametrize("backend", ["fbgemm", "int_mm", "reference"])
def test_a_tokens_output_does_not_depend_on_its_batch(backend: int8.GemmBackend) -> None:
    # Per-token activations: a row gives the same bits alone, among ordinary rows, or beside an
    # outlier row 1000x larger (one scale per tensor would crush its precision).
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(40, 576, generator=g), torch.randn(96, 576, generator=g)
    lin = Int8Linear.from_float(w, backend)
    alone = lin(x[7:8].clone())
    with_outlier = lin(torch.cat([x[:10], x[10:11] * 1000]))
    assert torch.equal(lin(x)[7:8], alone)
    assert torch.equal(with_outlier[7:8], alone)


def _engine(path: Path, **kw: object) -> Engine:
    opts = {"dtype": "fp32", "quantization": "w8a8_int8", "max_input_len": 256, "max_batch_tokens": 256}
    return Engine.from_pretrained(path, **{**opts, **kw})


def _prompts(vocab: int, lengths: list[int], seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _emulate_int8(hf: torch.nn.Module) -> torch.nn.Module:
    """transformers' model with every decoder projection's weight replaced by its per-channel int8
    value and its input by its per-token int8 value (fp32 math): what W8A8 computes."""
    import copy

    model = copy.deepcopy(hf)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}":
            with torch.no_grad():
                mod.weight.copy_(_fake_quant_rows(mod.weight).float())
            mod.register_forward_pre_hook(lambda _m, args: (_fake_quant_rows(args[0]).float(),))
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_model_matches_transformers(tiny_model, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Per-token activations (int_mm, as on a VNNI or AMX CPU; exact int32 sums wherever it runs).
    monkeypatch.setattr(int8, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.PLAIN)  # the emulation rounds plain per-token int8
    path, hf = tiny_model(kind)
    engine = _engine(path, chunk_size=64)
    assert all(
        isinstance(getattr(engine.model.decoder_layers[0], n), Int8Linear) for n in int8.QUANTIZED_PROJECTIONS
    )
    _assert_matches_emulation(engine, hf, _emulate_int8(hf))


def _assert_matches_emulation(engine, hf, emulated) -> None:
    prompts = _prompts(engine.vocab_size, [1, 2, 5, 33, 200])
    labels = [0, 7, engine.vocab_size - 1]
    exact = 0
    for ids, res in zip(prompts, engine.score(prompts, labels), strict=True):
        got = torch.tensor(res.logprobs)
        # The same int8 rounding in fp32 transformers: equal up to fp32 summation order, except
        # where that order moves an activation across a rounding boundary (one int8 step of one
        # value), which the layers after it carry on as a small difference.
        err = (got - hf_next_logprobs(emulated, ids)[labels]).abs().max().item()
        exact += err <= 1e-5
        assert err <= 0.05
        # Plain fp32 transformers: int8's own error on these random weights (std 0.15, larger than a
        # trained model's), stated as 0.25 nats at most.
        assert (got - hf_next_logprobs(hf, ids)[labels]).abs().max() <= 0.25
    assert exact >= 3, "most prompts cross no rounding boundary: their answers must be the emulation's"


def test_int8_cache_skips_quantizing_and_gives_the_same_answers(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.delenv(INT8_CACHE_ENV)  # the int8 files under that root, not the session folder
    # Plain int8 (no float outlier columns): the weights' memory below is the int8 format's own.
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.PLAIN)
    path, _ = tiny_model("llama")
    cold = _engine(path)
    files = list((tmp_path / "int8").glob("*-w8a8_int8-*.safetensors"))
    assert len(files) == 1
    ids = _prompts(cold.vocab_size, [90])[0]
    expected = cold.score([ids], [0, 5])[0].logprobs

    def refuse(*_a: object, **_k: object) -> None:
        raise AssertionError("quantized again despite the cache")

    from po_backend.engine.models import loader

    monkeypatch.setattr(loader, "quantize_model", refuse)
    warm = _engine(path)
    assert warm.score([ids], [0, 5])[0].logprobs == expected
    # Weights' memory: int8 projections (plus fp32 scales) next to the fp32 rest.
    qw = int8.weight_bytes(warm.model.layers)
    fw = int8.weight_bytes(Engine.from_pretrained(path, dtype="fp32", max_input_len=256).model.layers)
    assert qw < 0.3 * fw


def _cold_answers(engine: Engine, prefix: list[int], items: list[list[int]], labels: list[int]) -> list:
    """Each item over the prefix with an empty cache: the cold runs' log-probs."""
    cold = []
    for it in items:
        engine.flush_cache()
        cold += [r.logprobs for r in engine.score([prefix + it], labels, cache_prefix_len=len(prefix))]
    return cold


def _hit_answers(engine: Engine, prefix: list[int], items: list[list[int]], labels: list[int]) -> list:
    """The prefix cached first, then all items over it in one call (every one a hit): their log-probs."""
    engine.flush_cache()
    engine.score([prefix], labels[:1], cache_prefix_len=len(prefix))
    hit = engine.score([prefix + it for it in items], labels, cache_prefix_len=len(prefix))
    assert all(r.cached_tokens == len(prefix) for r in hit)
    return [r.logprobs for r in hit]


@pytest.mark.parametrize("recipe", [int8.PER_CHANNEL, int8.DEFAULT_RECIPE])
@pytest.mark.parametrize("flags", [{"avx2"}, {"avx2", "avx512_vnni"}, set()])
def test_cache_hit_equals_cold_run(
    tiny_model, flags: set[str], recipe: int8.Int8Recipe, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every backend (fbgemm, _int_mm, reference), per channel and blocked: per-token int8 and items
    # attended as they are alone make a hit compute the cold run's arithmetic, so no rounding
    # boundary can differ.
    monkeypatch.setattr(int8, "cpu_flags", lambda: frozenset(flags))
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", recipe)
    path, _ = tiny_model("llama")
    engine = _engine(path)
    prefix = _prompts(engine.vocab_size, [60], seed=3)[0]
    items = _prompts(engine.vocab_size, [9, 14], seed=4)
    # The same arithmetic: the same bits.
    assert _hit_answers(engine, prefix, items, [0, 5]) == _cold_answers(engine, prefix, items, [0, 5])


def test_bad_quantization_is_a_value_error(tiny_model) -> None:
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="quantization must be one of"):
        _engine(path, quantization="int4")
    with pytest.raises(ValueError, match="enable_lora does not combine with quantization"):
        _engine(path, enable_lora=True)


def _write_q8_0_gguf(hf: torch.nn.Module, path: Path) -> None:
    """A llama GGUF's tensors as llama.cpp writes them: q/k rows permuted, every projection Q8_0,
    the rest F32 (no tokenizer: the test places the converted folder itself)."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)  # transformers' LlamaConfig default
    w.add_vocab_size(cfg.vocab_size)

    def permute(t: np.ndarray, heads: int) -> np.ndarray:  # llama.cpp's convert_hf_to_gguf
        return t.reshape(heads, 2, t.shape[0] // heads // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)

    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[pre + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[pre + "post_attention_layernorm.weight"])
        for ours, theirs in names.items():
            part = "self_attn" if theirs.startswith("attn") else "mlp"
            t = sd[f"{pre}{part}.{ours}.weight"]
            if ours in ("q_proj", "k_proj"):
                t = permute(t, cfg.num_attention_heads if ours == "q_proj" else cfg.num_key_value_heads)
            q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(
                f"blk.{i}.{theirs}.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
            )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_q8_0_gguf_loads_its_integers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    # A VNNI CPU keeps the file's integers as they are (fbgemm re-rounds them to +-63).
    monkeypatch.setattr(int8, "cpu_flags", lambda: frozenset({"avx2", "avx512_vnni"}))
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.PLAIN)  # smoothing would change the integers
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # one scale per row in each row's blocks: Q8_0's integers are exactly ours
        for name, p in hf.named_parameters():
            if "proj" in name:
                p.copy_(torch.randn(p.shape).sign() * 0.05)
    gguf_path = tmp_path / "tiny-q8_0.gguf"
    _write_q8_0_gguf(hf, gguf_path)
    # The folder a GGUF converts into (transformers' float copy), naming its source as
    # `converted_gguf_dir` does: the int8 mode reads the Q8_0 integers from there.
    from po_backend.engine.models import loader

    folder = tmp_path / "converted"
    hf.save_pretrained(folder)
    loader.record_gguf_source(folder, gguf_path)

    def refuse(layers: list[torch.nn.Module], backend: object, *_: object) -> None:
        assert all(isinstance(getattr(x, n), Int8Linear) for x in layers for n in int8.QUANTIZED_PROJECTIONS)

    monkeypatch.setattr(loader, "quantize_model", refuse)  # nothing is left to quantize from floats
    engine = _engine(folder)
    layer = engine.model.decoder_layers[1]
    # The fused qkv rows in transformers' order: q's first row is the first row of q_proj.
    for ours, ref in (("qkv_proj", torch.cat([hf.model.layers[1].self_attn.__getattr__(p).weight for p in ("q_proj", "k_proj", "v_proj")])),
                      ("down_proj", hf.model.layers[1].mlp.down_proj.weight)):  # fmt: skip
        lin = getattr(layer, ours)
        assert isinstance(lin, Int8Linear)
        assert torch.equal(lin.qweight.t(), (ref.sign() * 127).to(torch.int8))
        torch.testing.assert_close(lin.dequantized(), ref.float(), rtol=1e-3, atol=0)
    ids = _prompts(engine.vocab_size, [40])[0]
    got = torch.tensor(engine.score([ids], [0, 9, 99])[0].logprobs)
    assert (got - hf_next_logprobs(hf, ids)[[0, 9, 99]]).abs().max() <= 0.05


def test_labeling_cli_and_bench_take_the_setting() -> None:
    from benchmarks import bench_int8  # noqa: F401  # importable without torchao
    from po_lang.label.cli import engine_options, parse_args

    args = parse_args(["x.jsonl", "--labels", "a,b", "--quantization", "w8a8_int8"])
    assert engine_options(args) == {"quantization": "w8a8_int8"}
    assert engine_options(parse_args(["x.jsonl", "--labels", "a,b"])) == {}
    with pytest.raises(SystemExit):
        parse_args(["x.jsonl", "--labels", "a,b", "--server", "http://h", "--quantization", "w8a8_int8"])


@pytest.mark.embedded
def test_embedded_int8_cache_hit_equals_cold_run() -> None:
    """On the real model (outlier channels, so a last-bit difference that crossed an int8 rounding
    boundary would show): items scored over a cached prefix, together, give the cold run's answers."""
    engine = Engine.from_pretrained(
        "embedded", dtype="fp32", quantization="w8a8_int8", max_input_len=128, max_batch_tokens=256
    )
    tok = engine.tokenizer
    prefix = tok.encode("Profile: Ana bakes bread, hikes on weekends and reads about astronomy.\n")
    items = [
        tok.encode(f"Item: {t}\nWould she like it? Answer Yes or No.\nAnswer:", add_special_tokens=False)
        for t in ("A sourdough starter guide.", "Stargazing in the desert.", "Celebrity gossip weekly.")
    ]
    labels = [tok.encode(" Yes")[0], tok.encode(" No")[0]]
    cold = _cold_answers(engine, prefix, items, labels)
    for a, b in zip(cold, _hit_answers(engine, prefix, items, labels), strict=True):
        assert a == pytest.approx(b, abs=1e-5)


# ---- calibration, smoothing and outlier channels ------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_smoothing_leaves_the_fp32_model_unchanged(tiny_model, kind: str) -> None:
    # SmoothQuant folded into the norms, v rows and up rows is an identity on the float model
    # (GQA's shared kv channels, qwen2's v bias, qwen3's q/k norms included): only int8 sees it.
    from po_backend.engine.calibration import activation_maxima, calibration_ids

    path, _ = tiny_model(kind)
    engine = Engine.from_pretrained(path, dtype="fp32", max_input_len=256)
    prompts = _prompts(engine.vocab_size, [3, 40, 120], seed=7)
    labels = list(range(0, engine.vocab_size, 17))
    before = [torch.tensor(r.logprobs) for r in engine.score(prompts, labels)]
    maxima = activation_maxima(engine.model, torch.device("cpu"), calibration_ids(None, engine.vocab_size))
    recipe = int8.Int8Recipe(alpha=(0.5, 0.7, 0.4, 0.6))
    layers = engine.model.decoder_layers
    old = [{n: getattr(x, n).detach().clone() for n in int8.QUANTIZED_PROJECTIONS} for x in layers]
    for layer, m in zip(layers, maxima, strict=True):
        after = int8.smooth_layer(layer, m, recipe)
        assert set(after) == set(int8.QUANTIZED_PROJECTIONS)
    for layer, w in zip(layers, old, strict=True):  # every projection's input was rescaled
        for n in int8.QUANTIZED_PROJECTIONS:
            assert not torch.equal(getattr(layer, n), w[n]), n
    engine.flush_cache()
    for b, r in zip(before, engine.score(prompts, labels), strict=True):
        torch.testing.assert_close(torch.tensor(r.logprobs), b, rtol=0, atol=1e-5)


def test_smoothing_flattens_the_activations_int8_sees(tiny_model) -> None:
    from po_backend.engine.calibration import activation_maxima, calibration_ids

    path, _ = tiny_model("llama")
    engine = Engine.from_pretrained(path, dtype="fp32", max_input_len=256)
    ids = calibration_ids(None, engine.vocab_size)
    maxima = activation_maxima(engine.model, torch.device("cpu"), ids)
    recipe = int8.Int8Recipe(alpha=(0.5, 0.5, 0.5, 0.5))
    predicted = [
        int8.smooth_layer(x, m, recipe) for x, m in zip(engine.model.decoder_layers, maxima, strict=True)
    ]
    # The smoothed model's own calibration maxima are what smooth_layer said they would be.
    again = activation_maxima(engine.model, torch.device("cpu"), ids)
    for p, a in zip(predicted, again, strict=True):
        for n in int8.QUANTIZED_PROJECTIONS:
            torch.testing.assert_close(a[n], p[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["int_mm", "fbgemm", "reference"])
def test_outlier_channels_run_in_float_beside_the_int8_gemm(backend: int8.GemmBackend) -> None:
    g = torch.Generator().manual_seed(11)
    x, w = torch.randn(50, 576, generator=g), torch.randn(200, 576, generator=g) * 0.1
    idx = torch.tensor([3, 100, 575])
    x[:, idx] *= 1000  # massive outliers, as before SmolLM2's down_proj
    lin = Int8Linear.from_float(w, backend, idx)
    assert lin.outlier_w is not None and torch.equal(lin.outlier_w, w[:, idx].t())
    assert not lin.qweight[idx].any(), "outlier columns are out of the int8 weight"
    got = lin(x).double()
    # Reference: the int8 part (rows quantized without the outlier channels) plus the float part.
    xm = x.index_fill(1, idx, 0)
    wq = (lin.qweight.double() * lin.scale.double()).t()
    ref = _fake_quant_rows(xm) @ wq.t() + x[:, idx].double() @ w[:, idx].double().t()
    exact = x.double() @ w.double().t()
    if backend == "fbgemm":  # fbgemm's activation steps are 2/255 of the row's max, not 1/127
        assert (got - exact).norm() <= 1.05 * (ref - exact).norm()
    else:  # exact int32 sums: fp32 rounding only
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # Without the split one activation step is 1/127 of the outliers: the rest are lost.
    plain = Int8Linear.from_float(w, backend)(x).double()
    assert (got - exact).norm() * 20 < (plain - exact).norm()
    # A token's answer still does not depend on the rows beside it.
    torch.testing.assert_close(lin(x[7:8]), lin(x)[7:8], rtol=0, atol=0)


def test_calibration_is_cached_reused_and_invalidated(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import shutil

    from po_backend.engine import calibration
    from po_backend.engine.models import loader

    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(INT8_CACHE_ENV)  # the int8 files under that root, not the session folder
    src, _ = tiny_model("llama")
    path = tmp_path / "model"
    shutil.copytree(src, path)
    runs = []
    real = calibration.activation_maxima
    monkeypatch.setattr(calibration, "activation_maxima", lambda *a: runs.append(1) or real(*a))
    first = _engine(path)
    ids = _prompts(first.vocab_size, [50])[0]
    expected = first.score([ids], [0, 5])[0].logprobs
    assert runs == [1] and len(list((tmp_path / "cache" / "int8").glob("model-calibration-*"))) == 1
    # A second start reads the int8 weights (and smoothed norms) without calibrating or quantizing.
    monkeypatch.setattr(loader, "quantize_model", lambda *a: pytest.fail("quantized again"))
    assert _engine(path).score([ids], [0, 5])[0].logprobs == expected
    monkeypatch.undo()
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(INT8_CACHE_ENV)  # the int8 files under that root, not the session folder
    monkeypatch.setattr(calibration, "activation_maxima", lambda *a: runs.append(1) or real(*a))
    # Another recipe quantizes again, from the cached maxima.
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.Int8Recipe(alpha=(0.3, 0.3, 0.3, 0.3)))
    _engine(path)
    assert runs == [1]
    # Changed weights: calibrated again.
    import safetensors.torch

    (file,) = path.glob("*.safetensors")
    state = safetensors.torch.load_file(file)
    state["model.layers.0.mlp.down_proj.weight"] *= 2
    safetensors.torch.save_file(state, str(file), metadata={"format": "pt"})
    changed = _engine(path)
    assert runs == [1, 1]
    assert changed.score([ids], [0, 5])[0].logprobs != expected


def test_default_recipe_is_close_to_fp32_and_keeps_outliers_in_float(
    tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int8, "cpu_flags", lambda: frozenset({"avx2"}))
    path, hf = tiny_model("qwen2")
    engine = _engine(path, chunk_size=64)
    k = int8.DEFAULT_RECIPE.of("down_proj")[1]
    down = engine.model.decoder_layers[0].down_proj
    assert isinstance(down, Int8Linear) and down.outlier_idx is not None and down.outlier_idx.numel() == k
    assert down.block == int8.DEFAULT_RECIPE.block == 32  # Q8_0's blocks
    labels = [0, 7, engine.vocab_size - 1]
    for ids, res in zip(
        prompts := _prompts(engine.vocab_size, [5, 33, 200]), engine.score(prompts, labels), strict=True
    ):
        assert (torch.tensor(res.logprobs) - hf_next_logprobs(hf, ids)[labels]).abs().max() <= 0.25


# ---- blocked int8 (Q8_0's format: weights and activations in blocks along k) ------------------------


def _fp16_at_least(d: torch.Tensor) -> torch.Tensor:
    """The smallest fp16 value >= each of d's (fp32) values, in fp32."""
    h = d.numpy().astype(np.float16)
    low = h.astype(np.float32) < d.numpy()
    h[low] = np.nextafter(h[low], np.float16(np.inf))
    return torch.from_numpy(h.astype(np.float32))


def _fake_quant_blocks(x: torch.Tensor, block: int, weight: bool = False) -> torch.Tensor:
    """x [m, k] quantized to symmetric int8 per block of `block` columns (padded with zeros to whole
    blocks, rounded in fp32 as the engine rounds) and back in fp64; `weight`: with the weights'
    fp16 scales (d rounded up to fp16, the block quantized with it)."""
    k = x.shape[1]
    kp = -(-k // block) * block
    xb = torch.nn.functional.pad(x.detach().float(), (0, kp - k)).view(x.shape[0], -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    if weight:
        d = _fp16_at_least(d)
    q = (xb / torch.where(d == 0, 1.0, d)).round().clamp(-127, 127)
    return (q.double() * d.double()).view(x.shape[0], kp)[:, :k]


def test_quantize_blocks_follows_q8_0() -> None:
    x = torch.zeros(2, 64)
    x[0, :4] = torch.tensor([0.25, -2.0, 0.5, 2.0])
    x[0, 32:36] = torch.tensor([0.0, 127.0, 0.5, -63.5])  # d = 1: halves go to even (0, -64)
    for quantize in (int8.quantize_blocks, int8.reference_quantize_blocks):  # C++ pass, torch
        q, d = quantize(x, 32)
        assert q.dtype == torch.int8 and d.dtype == torch.float32 and d.shape == (2, 2)
        assert torch.equal(d, torch.tensor([[2 / 127, 1.0], [0.0, 0.0]]))  # all zeros: d = 0, q = 0
        assert q[0, :4].tolist() == [16, -127, 32, 127] and q[0, 32:36].tolist() == [0, 127, 0, -64]
        assert not q[0, 4:32].any() and not q[0, 36:].any() and not q[1].any()


def test_weight_blocks_keep_fp16_scales() -> None:
    """Q8_0's weight format: one fp16 scale per block, the smallest fp16 >= max |w| / 127, and the
    block quantized with it (|q| <= 127); blocks below fp16's normal range keep a tiny absolute
    error; a blocked layer holds the int8 values and the fp16 scales once (2 bytes per block)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 128, generator=g) * 0.05
    w[0, :32] = torch.randn(32, generator=g) * 1e-7  # d ~ 2e-9: an fp16 subnormal
    w[1, 32:64] = 0.0
    q, d = int8.quantize_weight_blocks(w, 32)
    assert q.dtype == torch.int8 and d.dtype == torch.float16 and d.shape == (48, 4)
    exact = w.view(48, 4, 32).abs().amax(-1) / 127
    below = torch.nextafter(d, torch.zeros_like(d)).float()
    assert (d.float() >= exact).all() and ((below < exact) | (d == 0)).all()
    assert d[1, 1] == 0 and not q[1, 32:64].any() and int(q.abs().max()) <= 127
    deq = (q.float().view(48, 4, 32) * d.float()[..., None]).view(48, 128)
    assert ((deq - w).abs().view(48, 4, 32) <= d.float()[..., None] / 2 + 1e-12).all()
    assert (deq[0, :32] - w[0, :32]).abs().max() < 2**-25
    with pytest.raises(ValueError, match="fp16"):
        int8.quantize_weight_blocks(torch.full((1, 32), 1e7), 32)
    lin = Int8Linear.from_float(w, "int_mm", block=32)
    assert lin.scale.dtype == torch.float16 and torch.equal(lin.scale, d) and torch.equal(lin.qweight, q)
    holder = torch.nn.Module()
    holder.lin = lin
    assert int8.weight_bytes(holder) == 48 * 128 + 2 * 48 * 4


def test_reference_blocked_matmul_is_exact_per_block() -> None:
    g = torch.Generator().manual_seed(3)
    m, n, k, block = 9, 13, 256, 32
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    xs, ws = torch.rand(m, k // block, generator=g), torch.rand(n, k // block, generator=g)
    xs[2, 1] = 0  # a zero block of one row
    # The contract, spelled out: int64 dots per block, fp32 terms added in increasing b.
    ref = torch.zeros(m, n)
    for b in range(k // block):
        cols = slice(b * block, (b + 1) * block)
        dot = (xq[:, cols].long() @ wq[:, cols].long().t()).float()
        ref = ref + xs[:, b, None] * ws[None, :, b] * dot
    got = int8.reference_blocked_matmul(xq, xs, wq, ws, block)
    assert got.dtype == torch.float32 and torch.equal(got, ref)
    assert torch.equal(int8.reference_blocked_matmul(xq[4:5], xs[4:5], wq, ws, block), ref[4:5])


@pytest.mark.parametrize("block", [32, 64, 128])
@pytest.mark.parametrize(("m", "k", "n"), [(1, 64, 24), (37, 576, 96), (70, 1536, 40)])
def test_blocked_int8_linear_matches_dequantized_reference(block: int, m: int, k: int, n: int) -> None:
    g = torch.Generator().manual_seed(m + k + n + block)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4
    x[:, 5] *= 30  # an outlier channel: only its own block's steps widen
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)
    lin = Int8Linear.from_float(w, "fbgemm", block=block)  # blocked: the same path on every backend
    assert (lin.in_features, lin.out_features) == (k, n) and lin.scale.shape == (n, -(-k // block))
    ref = _fake_quant_blocks(x, block) @ _fake_quant_blocks(w, block, weight=True).t()
    got = lin(x).double()
    # Exact int32 sums per block; fp32 rounding of the scale products and of the sum over blocks.
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(lin.dequantized().double(), _fake_quant_blocks(w, block, weight=True))
    # Finer scales than one per token and channel: a smaller error than per-channel W8A8's (the
    # same where one block spans the row).
    exact = x.double() @ w.double().t()
    per_channel = Int8Linear.from_float(w, "reference")(x).double()
    if k > block:
        assert (got - exact).norm() < (per_channel - exact).norm()
    else:  # per channel with the same int8 weights and (fp16) scales: the same arithmetic
        same = Int8Linear(lin.qweight[:, :k].t().contiguous(), lin.scale[:, 0].float(), "reference")
        torch.testing.assert_close(got, same(x).double(), rtol=1e-6, atol=1e-6 * exact.abs().max().item())
    # A row's bits do not depend on the rows beside it (a cache hit must equal the cold run).
    assert torch.equal(lin(x[m // 2 : m // 2 + 1].clone()), lin(x)[m // 2 : m // 2 + 1])
    assert torch.equal(lin(torch.cat([x, x[:1] * 1000]))[:m], lin(x))


def test_weight_scales_spanning_two_activation_blocks() -> None:
    """weight_block 64 with 32-wide activation blocks: one fp16 scale per 64 weights (8.25 bits a
    weight), the activations' steps per 32; against fp64 emulation, batch invariant."""
    g = torch.Generator().manual_seed(8)
    x, w = torch.randn(25, 600, generator=g), torch.randn(48, 600, generator=g) * 0.1
    x[:, 7] *= 40
    lin = Int8Linear.from_float(w, "int_mm", block=32, activation_passes=2, weight_block=64)
    assert lin.qweight.shape == (48, 640) and lin.scale.shape == (48, 10) and lin.scale.dtype == torch.float16
    assert torch.equal(lin.dequantized().double(), _fake_quant_blocks(w, 64, weight=True))
    hi = _fake_quant_blocks(x, 32)
    act = hi + _fake_quant_blocks((x.double() - hi).float(), 32)
    ref = act @ _fake_quant_blocks(w, 64, weight=True).t()
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(lin(x[4:6].clone()), lin(x)[4:6])
    holder = torch.nn.Module()
    holder.lin = lin
    assert int8.weight_bytes(holder) == 48 * 640 + 2 * 48 * 10


def test_weight_scales_in_fp8() -> None:
    """e4m3 block scales (1 byte) times one power of two per projection: each d the smallest such
    value >= max |w| / 127 (at most 1/8 above it), |q| <= 127, the kernel equal to the reference,
    and the pair kept through the int8 cache's tensors."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, 320, generator=g) * torch.rand(40, 1, generator=g) * 0.1
    w[3, :32] = 0.0
    q, code, mul = int8.quantize_weight_blocks_e4m3(w, 32)
    assert code.dtype == torch.float8_e4m3fn and q.dtype == torch.int8 and math.log2(mul).is_integer()
    d, exact = code.float() * mul, w.view(40, 10, 32).abs().amax(-1) / 127
    assert (d >= exact).all() and (d <= exact * 1.125).all() and d[3, 0] == 0 and int(q.abs().max()) <= 127
    assert float(code.float().max()) <= 448
    x = torch.randn(9, 320, generator=g)
    lin = Int8Linear.from_float(w, "int_mm", block=32, activation_passes=2, weight_scales="e4m3")
    ref = Int8Linear.from_float(w, "reference", block=32, activation_passes=2, weight_scales="e4m3")
    assert torch.equal(lin(x), ref(x)) and torch.equal(lin.scale.view(torch.uint8), code.view(torch.uint8))
    deq = (q.float().view(40, 10, 32) * d[..., None]).view(40, 320)
    assert torch.equal(lin.dequantized(), deq)
    holder = torch.nn.Module()
    holder.lin = lin
    assert int8.weight_bytes(holder) == 48 * 320 + 48 * 10  # 8.25 bits a weight (3 panels of 16 rows)
    state = {f"0.{k}": v for k, v in (("x.qweight", lin.qweight), ("x.scale", lin.scale))}
    again = Int8Linear(state["0.x.qweight"], state["0.x.scale"], "int_mm", None, None, 32, 320, 2, None, mul)
    assert torch.equal(again(x), lin(x))


def test_int8_outlier_weights() -> None:
    """Outlier channels' weights in Q8_0 blocks along the output (their activations float): the
    product against fp64 math on those weights, and 1 byte a weight plus 2 per 32."""
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(20, 576, generator=g), torch.randn(70, 576, generator=g) * 0.1
    idx = torch.tensor([3, 100, 575])
    x[:, idx] *= 1000
    lin = Int8Linear.from_float(w, "int_mm", idx, block=32, outlier_weights="int8")
    assert lin.outlier_w is not None and lin.outlier_s is not None
    assert (
        lin.outlier_w.dtype == torch.int8 and lin.outlier_w.shape == (3, 96) and lin.outlier_s.shape == (3, 3)
    )
    w_out = _fake_quant_blocks(w[:, idx].t(), 32, weight=True)  # [3, 70]
    ref = (
        _fake_quant_blocks(x.index_fill(1, idx, 0), 32)
        @ _fake_quant_blocks(w.index_fill(1, idx, 0), 32, weight=True).t()
    )
    ref += x[:, idx].double() @ w_out
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(lin.dequantized()[:, idx].double(), w_out.t())
    again = Int8Linear(
        lin.qweight, lin.scale, "int_mm", lin.outlier_idx, lin.outlier_w, 32, 576, 1, None, 1.0, lin.outlier_s
    )  # what the int8 cache holds
    assert torch.equal(again(x), lin(x))


def test_blocked_outlier_channels_run_in_float() -> None:
    g = torch.Generator().manual_seed(12)
    x, w = torch.randn(20, 576, generator=g), torch.randn(64, 576, generator=g) * 0.1
    idx = torch.tensor([3, 100, 575])
    x[:, idx] *= 1000
    lin = Int8Linear.from_float(w, "int_mm", idx, block=32)
    assert not lin.qweight[:, idx].any()
    ref = (
        _fake_quant_blocks(x.index_fill(1, idx, 0), 32)
        @ _fake_quant_blocks(w.index_fill(1, idx, 0), 32, weight=True).t()
    )
    ref += x[:, idx].double() @ w[:, idx].double().t()
    torch.testing.assert_close(lin(x).double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_blocked_linear_output_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel writing into the caller's fp32 `out`, into a fresh tensor, or into a strided
    `out` (through a copy), and the outlier channels' fp64 part made in one piece or 3 rows at a
    time: the same bits."""
    g = torch.Generator().manual_seed(13)
    x, w = torch.randn(20, 576, generator=g), torch.randn(64, 576, generator=g) * 0.1
    idx = torch.tensor([3, 100, 575])
    x[:, idx] *= 1000
    lin = Int8Linear.from_float(w, "int_mm", idx, block=32)
    whole = lin(x)
    out = torch.full((20, 64), float("nan"))
    assert lin(x, out=out) is out and torch.equal(out, whole)
    strided = torch.full((64, 20), float("nan")).t()
    lin(x, out=strided)
    assert torch.equal(strided, whole)
    monkeypatch.setattr(int8, "_OUTLIER_PART_BYTES", 3 * 8 * 64)  # 3 rows per fp64 part
    assert torch.equal(lin(x), whole)


def _emulate_blocked_int8(hf: torch.nn.Module, block: int, weight_rows: bool = False) -> torch.nn.Module:
    """transformers' model with every decoder projection's weight and input replaced by their
    blocked int8 values (fp32 math): what the blocked W8A8 computes; `weight_rows`: the weights
    per output channel instead (fp32 scales)."""
    import copy

    model = copy.deepcopy(hf)
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}":
            with torch.no_grad():
                deq = (
                    _fake_quant_rows(mod.weight)
                    if weight_rows
                    else _fake_quant_blocks(mod.weight, block, True)
                )
                mod.weight.copy_(deq.float())
            mod.register_forward_pre_hook(
                lambda _m, args: (
                    _fake_quant_blocks(args[0].reshape(-1, args[0].shape[-1]), block)
                    .float()
                    .view(args[0].shape),
                )  # fmt: skip
            )
    return model


BLOCKED = int8.Int8Recipe(block=32)


@pytest.mark.parametrize("kind", KINDS)
def test_blocked_model_matches_transformers(tiny_model, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", BLOCKED)
    path, hf = tiny_model(kind)
    engine = _engine(path, chunk_size=64)
    lin = engine.model.decoder_layers[0].down_proj
    assert isinstance(lin, Int8Linear) and lin.block == 32
    _assert_matches_emulation(engine, hf, _emulate_blocked_int8(hf, 32))


def test_blocked_cache_and_prefix_hit_equal_the_cold_run(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from po_backend.engine.models import loader

    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.Int8Recipe((0.5,) * 4, (2, 2, 2, 4), 32))
    path, _ = tiny_model("qwen2")
    cold = _engine(path)
    prefix = _prompts(cold.vocab_size, [60], seed=3)[0]
    items = _prompts(cold.vocab_size, [9, 14], seed=4)
    expected = _cold_answers(cold, prefix, items, [0, 5])
    # The int8 cache: a second start quantizes nothing and answers the same.
    monkeypatch.setattr(loader, "quantize_model", lambda *a: pytest.fail("quantized again"))
    warm = _engine(path)
    assert isinstance(warm.model.decoder_layers[1].qkv_proj, Int8Linear)
    assert warm.model.decoder_layers[1].qkv_proj.block == 32
    # A prefix-cache hit: the items over the cached prefix, together, give the cold run's bits.
    assert _hit_answers(warm, prefix, items, [0, 5]) == expected


def test_parse_float_projections() -> None:
    assert int8.parse_float_projections("down_proj@2-4; o_proj;qkv_proj@0,7") == (
        "down_proj@2", "down_proj@3", "down_proj@4", "o_proj", "qkv_proj@0", "qkv_proj@7",
    )  # fmt: skip
    recipe = int8.Int8Recipe((0.5,) * 4, block=32, float_projections=("down_proj@1", "o_proj"))
    assert recipe.keeps_float(1, "down_proj") and not recipe.keeps_float(0, "down_proj")
    assert recipe.keeps_float(0, "o_proj") and recipe.for_layer(1).alpha == (0.5, None, 0.5, None)
    with pytest.raises(ValueError, match="unknown projection"):
        int8.parse_float_projections("lm_head")


def test_projections_kept_in_float_are_the_checkpoints(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A recipe's float projections are neither smoothed nor quantized: the checkpoint's weights,
    read again (not cached) on a start from the int8 cache; a prefix hit equals the cold run."""
    from po_backend.engine.models import loader

    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    recipe = int8.Int8Recipe((0.5,) * 4, (2, 2, 2, 4), 32, 2, float_projections=("down_proj@1", "o_proj"))
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", recipe)
    path, hf = tiny_model("qwen2")
    cold = _engine(path)
    layers = cold.model.decoder_layers
    assert isinstance(layers[0].down_proj, Int8Linear) and isinstance(layers[1].qkv_proj, Int8Linear)
    for i, name, ref in (
        (1, "down_proj", hf.model.layers[1].mlp.down_proj),
        (0, "o_proj", hf.model.layers[0].self_attn.o_proj),
    ):
        w = getattr(layers[i], name)
        assert not isinstance(w, Int8Linear) and torch.equal(w.data, ref.weight.data)
    prefix = _prompts(cold.vocab_size, [60], seed=3)[0]
    items = _prompts(cold.vocab_size, [9, 14], seed=4)
    expected = _cold_answers(cold, prefix, items, [0, 5])
    monkeypatch.setattr(loader, "quantize_model", lambda *a: pytest.fail("quantized again"))
    warm = _engine(path)
    assert not isinstance(warm.model.decoder_layers[1].down_proj, Int8Linear)
    assert _hit_answers(warm, prefix, items, [0, 5]) == expected


def test_q8_0_gguf_loads_as_its_own_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf
    import transformers

    from po_backend.engine.models import loader

    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", BLOCKED)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(1)
    hf = transformers.LlamaForCausalLM(cfg).eval()  # any weights: the blocks are read bit for bit
    gguf_path = tmp_path / "tiny-q8_0.gguf"
    _write_q8_0_gguf(hf, gguf_path)
    folder = tmp_path / "converted"
    hf.save_pretrained(folder)
    loader.record_gguf_source(folder, gguf_path)
    monkeypatch.setattr(loader, "quantize_model", lambda *a: None)  # nothing is quantized from floats
    engine = _engine(folder)
    layer, ref = engine.model.decoder_layers[1], hf.model.layers[1]

    def q8_0(t: torch.Tensor) -> torch.Tensor:  # the file's values: gguf's own Q8_0 round trip
        qt = gguf.GGMLQuantizationType.Q8_0
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(t.detach().numpy(), qt), qt))

    qkv, down = layer.qkv_proj, layer.down_proj
    assert isinstance(qkv, Int8Linear) and isinstance(down, Int8Linear) and qkv.block == down.block == 32
    assert torch.equal(down.dequantized(), q8_0(ref.mlp.down_proj.weight))
    v_rows = slice(cfg.hidden_size + 32, None)  # q (64 rows) and k (2 kv heads x 16) come first
    assert torch.equal(qkv.dequantized()[v_rows], q8_0(ref.self_attn.v_proj.weight))
    # q and k, read in llama.cpp's rotary order, are put back in transformers': the answers agree.
    ids = _prompts(engine.vocab_size, [40])[0]
    got = torch.tensor(engine.score([ids], [0, 9, 99])[0].logprobs)
    emulated = _emulate_blocked_int8(hf, 32)
    assert (got - hf_next_logprobs(emulated, ids)[[0, 9, 99]]).abs().max() <= 0.02


def test_two_activation_passes_add_the_int8_residual() -> None:
    g = torch.Generator().manual_seed(21)
    x, w = torch.randn(30, 576, generator=g), torch.randn(80, 576, generator=g)
    x[:, 40] *= 50
    one = Int8Linear.from_float(w, "reference", block=32)
    two = Int8Linear.from_float(w, "reference", block=32, activation_passes=2)
    assert torch.equal(one.qweight, two.qweight)  # the same int8 weights
    hi = _fake_quant_blocks(x, 32)
    act = hi + _fake_quant_blocks((x.double() - hi).float(), 32)  # value + its quantized residual
    ref = act @ two.dequantized().double().t()
    got = two(x).double()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    # About 15-bit activations: the error is the int8 weights' alone, far below one pass's.
    exact = x.double() @ w.double().t()
    weights_only = x.double() @ two.dequantized().double().t()
    assert (got - exact).norm() <= 1.01 * (weights_only - exact).norm()
    assert (got - exact).norm() < 0.5 * (one(x).double() - exact).norm()
    assert torch.equal(two(x[3:4].clone()), two(x)[3:4])  # batch invariant
    with pytest.raises(AssertionError, match="blocked"):
        Int8Linear.from_float(w, "reference", activation_passes=2)


def test_two_activation_passes_cache_and_prefix_hit(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from po_backend.engine.models import loader

    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.Int8Recipe(block=32, activation_passes=2))
    path, hf = tiny_model("llama")
    cold = _engine(path)
    prefix = _prompts(cold.vocab_size, [60], seed=3)[0]
    items = _prompts(cold.vocab_size, [9, 14], seed=4)
    expected = _cold_answers(cold, prefix, items, [0, 5])
    # transformers with the same int8 weights and float activations: only the activations' second
    # rounding (1/127 of a step) is left.
    import copy

    weights_only = copy.deepcopy(hf)
    for name, mod in weights_only.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".layers." in f".{name}":
            with torch.no_grad():
                mod.weight.copy_(_fake_quant_blocks(mod.weight, 32, weight=True).float())
    for it, lp in zip(items, expected, strict=True):
        assert (torch.tensor(lp) - hf_next_logprobs(weights_only, prefix + it)[[0, 5]]).abs().max() <= 0.01
    monkeypatch.setattr(loader, "quantize_model", lambda *a: pytest.fail("quantized again"))
    warm = _engine(path)
    lin = warm.model.decoder_layers[0].gate_up_proj
    assert isinstance(lin, Int8Linear) and lin.activation_passes == 2
    assert _hit_answers(warm, prefix, items, [0, 5]) == expected


def test_each_quantization_mode_runs_its_recipe(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    monkeypatch.delenv(INT8_CACHE_ENV)  # the int8 files under that root, not the session folder
    path, hf = tiny_model("qwen3")
    one, two = _engine(path), _engine(path, quantization="w8a8x2_int8")
    for engine, passes in ((one, 1), (two, 2)):
        lin = engine.model.decoder_layers[0].qkv_proj
        assert isinstance(lin, Int8Linear) and (lin.block, lin.activation_passes) == (32, passes)
    assert len(list((tmp_path / "int8").glob("*-w8a8_int8-*.safetensors"))) == 1
    assert len(list((tmp_path / "int8").glob("*-w8a8x2_int8-*.safetensors"))) == 1
    # Q8_0's blocks of 32 for w8a8_int8's weights, one fp32 scale per output channel for
    # w8a8x2_int8's; the second activation pass brings the answers closer to fp32's.
    down = one.model.decoder_layers[1].down_proj, two.model.decoder_layers[1].down_proj
    assert down[0].scale.shape == (down[0].out_features, -(-down[0].in_features // 32))
    assert down[0].scale.dtype == torch.float16
    assert down[1].scale.shape == (down[1].out_features, 1) and down[1].scale.dtype == torch.float32
    ids, labels = _prompts(one.vocab_size, [80])[0], list(range(0, 96, 3))
    ref = hf_next_logprobs(hf, ids)[labels]
    err = [(torch.tensor(e.score([ids], labels)[0].logprobs) - ref).abs().mean() for e in (one, two)]
    assert err[1] < err[0]


@pytest.mark.parametrize("passes", [1, 2])
def test_per_channel_weights_over_blocked_activations(passes: int) -> None:
    """weight_scales="channel": one fp32 scale per output channel over its whole row (outlier
    columns excluded), the activations in 32-wide blocks (one or two passes): the kernel bit-equal
    to the torch reference path, against fp64 emulation, batch invariant, one scale per row in
    the packed store, kept through the cache's tensors."""
    g = torch.Generator().manual_seed(31 + passes)
    x = torch.randn(23, 600, generator=g)
    w = torch.randn(48, 600, generator=g) * torch.rand(48, 1, generator=g)
    idx = torch.tensor([7, 300, 599])
    x[:, idx] *= 500
    x[:, 40] *= 20  # a large channel left in int8: only its own activation block's steps widen
    opts: dict = {"block": 32, "activation_passes": passes, "weight_scales": "channel"}
    lin = Int8Linear.from_float(w, "int_mm", idx, **opts)
    ref_lin = Int8Linear.from_float(w, "reference", idx, **opts)
    assert lin.blocks is not None and ref_lin.blocks is None and lin.weight_block == 608
    assert lin.qweight.shape == (48, 608) and lin.scale.shape == (48, 1) and lin.scale.dtype == torch.float32
    assert lin.blocks.scales.numel() == 48 and torch.equal(lin.qweight, ref_lin.qweight)
    wz = w.index_fill(1, idx, 0)
    d = wz.abs().amax(1, keepdim=True) / 127
    q = (wz / d).round().clamp(-127, 127)
    assert torch.equal(lin.qweight[:, :600].float(), q) and torch.equal(lin.scale, d)
    got = lin(x)
    assert torch.equal(got, ref_lin(x))  # the C++ kernel and the torch reference: the same bits
    xz = x.index_fill(1, idx, 0)
    hi = _fake_quant_blocks(xz, 32)
    act = hi if passes == 1 else hi + _fake_quant_blocks((xz.double() - hi).float(), 32)
    ref = act @ (q.double() * d.double()).t() + x[:, idx].double() @ w[:, idx].double().t()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    deq = q * d
    deq[:, idx] = w[:, idx]
    assert torch.equal(lin.dequantized(), deq)
    assert torch.equal(lin(x[5:6].clone()), got[5:6])
    assert torch.equal(lin(torch.cat([x, x[:1] * 1000]))[:23], got)
    again = Int8Linear(lin.qweight, lin.scale, "int_mm", lin.outlier_idx, lin.outlier_w, 32, 600, passes)
    assert again.weight_block == 608 and torch.equal(again(x), got)  # what the int8 cache holds


def test_per_channel_weights_bytes() -> None:
    """Per output channel: 1 byte a weight and 4 a row (fp32 scale), against Q8_0's 2 bytes per
    32 weights; the outlier channels' float weights and indices counted beside them."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(64, 576, generator=g)
    holder = torch.nn.Module()
    for scales, per_weight in (("channel", 1 + 4 / 576), ("fp16", 1 + 2 / 32)):
        holder.lin = Int8Linear.from_float(w, "int_mm", block=32, weight_scales=scales)
        assert int8.weight_bytes(holder) == 64 * 576 * per_weight
    idx = torch.tensor([1, 2])
    holder.lin = Int8Linear.from_float(w, "int_mm", idx, block=32, weight_scales="channel")
    assert int8.weight_bytes(holder) == 64 * 576 + 4 * 64 + 2 * 64 * 4 + 2 * 8
    with pytest.raises(AssertionError, match="no weight blocks"):
        Int8Linear.from_float(w, "int_mm", block=32, weight_block=64, weight_scales="channel")


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_per_channel_weights_model_matches_transformers(
    tiny_model, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(int8, "DEFAULT_RECIPE", int8.Int8Recipe(block=32, weight_scales="channel"))
    path, hf = tiny_model(kind)
    engine = _engine(path, chunk_size=64)
    lin = engine.model.decoder_layers[0].gate_up_proj
    assert isinstance(lin, Int8Linear) and lin.scale.shape == (lin.out_features, 1)
    _assert_matches_emulation(engine, hf, _emulate_blocked_int8(hf, 32, weight_rows=True))


@pytest.mark.parametrize("passes", [1, 2])
def test_per_channel_weights_cache_and_prefix_hit(
    tiny_model, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, passes: int
) -> None:
    """The calibrated per-channel recipe: its own int8 cache (a second start quantizes nothing and
    answers the same), and a prefix hit equal to the cold run."""
    from po_backend.engine.models import loader

    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path))
    recipe = int8.Int8Recipe((0.5,) * 4, (2, 2, 2, 4), 32, passes, weight_scales="channel")
    monkeypatch.setattr(int8, "TWO_PASS_RECIPE" if passes == 2 else "DEFAULT_RECIPE", recipe)
    mode = "w8a8x2_int8" if passes == 2 else "w8a8_int8"
    path, _ = tiny_model("qwen2")
    cold = _engine(path, quantization=mode)
    prefix = _prompts(cold.vocab_size, [60], seed=3)[0]
    items = _prompts(cold.vocab_size, [9, 14], seed=4)
    expected = _cold_answers(cold, prefix, items, [0, 5])
    monkeypatch.setattr(loader, "quantize_model", lambda *a: pytest.fail("quantized again"))
    warm = _engine(path, quantization=mode)
    lin = warm.model.decoder_layers[1].down_proj
    assert isinstance(lin, Int8Linear) and lin.scale.shape == (lin.out_features, 1)
    assert lin.activation_passes == passes and lin.outlier_idx is not None
    assert _cold_answers(warm, prefix, items, [0, 5]) == expected
    assert _hit_answers(warm, prefix, items, [0, 5]) == expected
