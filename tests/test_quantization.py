"""W8A8 int8 (`--quantization w8a8_int8`): the int8 linear against dequantized fp32 math, the
quantized model against transformers (the same int8 rounding emulated in fp32, tightly; plain fp32,
within a stated tolerance), the int8 cache, GGUF Q8_0, and the GEMM dispatch per CPU class."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from po_backend import Engine
from po_backend.core import cpu
from po_backend.engine.models import int8
from po_backend.engine.models.int8 import Int8Linear, gemm_backend, quantize_rows
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
        (frozenset({"avx2", "fma"}), "int_mm"),  # AVX2-only
        (frozenset(), "reference"),  # no x86 flags
    ],
)
def test_dispatch_per_cpu_class(
    monkeypatch: pytest.MonkeyPatch, tiny_model, flags: frozenset[str], backend: str
) -> None:
    assert gemm_backend(flags).backend == backend
    # The engine asks the (patchable) flags at load, and every class gives the same answers: the
    # backends compute the same int32 sums.
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)
    monkeypatch.setattr(int8, "cpu_flags", lambda: flags)
    path, _ = tiny_model("qwen2")
    engine = _engine(path)
    layer = engine.model.decoder_layers[0]
    assert isinstance(layer.gate_up_proj, Int8Linear) and layer.gate_up_proj.backend == backend
    monkeypatch.undo()
    base = _engine(path)
    ids = _prompts(engine.vocab_size, [70])[0]
    assert engine.score([ids], [0, 3])[0].logprobs == base.score([ids], [0, 3])[0].logprobs


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
def test_quantized_model_matches_transformers(tiny_model, kind: str) -> None:
    path, hf = tiny_model(kind)
    engine = _engine(path, chunk_size=64)
    assert all(
        isinstance(getattr(engine.model.decoder_layers[0], n), Int8Linear) for n in int8.QUANTIZED_PROJECTIONS
    )
    emulated = _emulate_int8(hf)
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
    path, _ = tiny_model("llama")
    cold = _engine(path)
    files = list((tmp_path / "int8").glob("*.safetensors"))
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


def test_cache_hit_equals_cold_run(tiny_model) -> None:
    path, _ = tiny_model("llama")
    engine = _engine(path)
    prefix = _prompts(engine.vocab_size, [60], seed=3)[0]
    items = _prompts(engine.vocab_size, [9, 14], seed=4)
    cold = []
    for it in items:
        engine.flush_cache()
        cold += engine.score([prefix + it], [0, 5], cache_prefix_len=len(prefix))
    engine.flush_cache()
    engine.score([prefix], [0], cache_prefix_len=len(prefix))
    hit = engine.score([prefix + it for it in items], [0, 5], cache_prefix_len=len(prefix))
    assert all(r.cached_tokens == len(prefix) for r in hit)
    for a, b in zip(cold, hit, strict=True):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_bad_quantization_is_a_value_error(tiny_model) -> None:
    path, _ = tiny_model("llama")
    with pytest.raises(ValueError, match="quantization must be one of"):
        _engine(path, quantization="int4")
