"""The bf16 CPU attention kernel (po_backend.engine.attention_cpu) against SDPA and transformers, its
dispatch, and the SDPA fallback where it cannot run or cannot be built.

bf16 tolerance, as for the other bf16 paths (tests/engine/test_attention_items.py): against an fp32
SDPA reference on the same (bf16-rounded) inputs, the kernel's error is at most twice SDPA-bf16's
own plus 1e-2. Both round P and the output to bf16; the kernel's scores stay fp32."""

from __future__ import annotations

import logging
import math
import os
import shutil

import pytest
import torch
import transformers

from po_backend.engine import attention, attention_cpu, kernels
from po_backend.engine.attention_cpu import choose
from tests.conftest import hf_next_logprobs, randomize_
from tests.deps import missing

CPU = torch.device("cpu")
EPYC = frozenset({"avx2", "avx512f", "avx512_bf16"})  # AVX512-BF16, no AMX
XEON = EPYC | {"amx_bf16", "amx_tile"}


def _kernel_or_skip(monkeypatch: pytest.MonkeyPatch) -> None:
    """Skip where the kernel cannot exist (no avx512_bf16, no compiler); where it can, a build
    failure fails the test. With PO_KERNEL_EMULATE=1 (tests/engine/test_kernel_build.py runs this file
    so in a child process on CPUs without avx512_bf16) the emulated build stands in for it."""
    if os.environ.get("PO_KERNEL_EMULATE") == "1":
        monkeypatch.setattr(attention_cpu, "cpu_flags", lambda: EPYC)
    elif "avx512_bf16" not in attention_cpu.cpu_flags():
        pytest.skip("the CPU has no avx512_bf16")
    if shutil.which("c++") is None:
        missing("no C++ compiler to build the kernel")
    assert attention_cpu.load_kernel(), "the kernel failed to build (see the logged warning)"


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    _kernel_or_skip(monkeypatch)
    monkeypatch.delenv("PO_CPU_ATTENTION", raising=False)


def _qkv(n: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype, seed: int) -> tuple:
    """q/k/v as the runner passes them: strided views into one packed [n, q+k+v] buffer. q is
    scaled up so that scores span about +-20, as in trained models (attention sinks)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g)
    qkv[:, : heads * d] *= 3
    qkv = qkv.to(dtype)
    q = qkv[:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
    return q, k, v


def _up(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _sdpa(q, k, v, scale, pk=None, pv=None) -> torch.Tensor:
    """SDPA's causal attention (after an optional prefix) in q's dtype: the reference path."""
    n, heads, d = q.shape
    out = torch.empty(n, heads * d, dtype=q.dtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PO_CPU_ATTENTION", "sdpa")
        attention.attend(q, k, v, out, scale, pk, pv)
    return out


def _assert_bf16_close(got: torch.Tensor, sdpa: torch.Tensor, ref: torch.Tensor) -> None:
    err = (got.float() - ref).abs().max().item()
    err_sdpa = (sdpa.float() - ref).abs().max().item()
    assert err <= 2 * err_sdpa + 1e-2, (err, err_sdpa)


SHAPES = [(9, 3, 64), (12, 2, 128), (4, 4, 64)]  # SmolLM2's GQA 3:1, a Qwen-like 6:1 at d 128, MHA


@pytest.mark.parametrize(("heads", "kv_heads", "d"), SHAPES)
@pytest.mark.parametrize("n", [1, 17, 1000])
@pytest.mark.parametrize("prefix", [0, 37])
def test_causal_matches_sdpa(kernel, heads: int, kv_heads: int, d: int, n: int, prefix: int) -> None:
    """attention.attend dispatches to the kernel (bf16, this CPU) and matches SDPA, with and
    without a prefix (the chunked baseline's context), on the runner's strided views."""
    q, k, v = _qkv(prefix + n, heads, kv_heads, d, torch.bfloat16, seed=n + prefix + d)
    pk, pv = (k[:prefix], v[:prefix]) if prefix else (None, None)
    q, k, v = q[prefix:], k[prefix:], v[prefix:]
    scale = 1 / math.sqrt(d)
    out = torch.full((n, heads * d), float("nan"), dtype=torch.bfloat16)
    attention.attend(q, k, v, out, scale, pk, pv)
    ref = torch.empty(n, heads * d)
    attention.attend(q.float(), k.float(), v.float(), ref, scale, _up(pk), _up(pv))
    _assert_bf16_close(out, _sdpa(q, k, v, scale, pk, pv), ref)


@pytest.mark.parametrize(("heads", "kv_heads", "d"), SHAPES[:2])
@pytest.mark.parametrize(
    ("causal", "n", "m"),  # a causal partial has as many keys as queries
    [(False, 1, 1), (False, 40, 300), (False, 300, 1), (True, 1, 1), (True, 17, 17), (True, 300, 300)],
)
def test_partial_with_lse(kernel, causal: bool, heads: int, kv_heads: int, d: int, n: int, m: int) -> None:
    """The kernel's partial attention with its log-sum-exp (the items path's contract) against
    torch's CPU flash kernel on the same inputs in fp32."""
    q, _, _ = _qkv(n, heads, kv_heads, d, torch.bfloat16, seed=1)
    _, k, v = _qkv(m, heads, kv_heads, d, torch.bfloat16, seed=2)
    scale = 1 / math.sqrt(d)
    out, lse = attention.cpu_lse(q, k, v, causal, scale)
    ref_out, ref_lse = attention.cpu_flash_lse(q.float(), k.float(), v.float(), causal, scale)
    sdpa_out, _ = attention.cpu_flash_lse(q, k, v, causal, scale)
    assert out.dtype == lse.dtype == torch.float32
    # fp32 products of bf16 inputs, fp32 sums: only the exp approximation (2.6e-6) differs.
    assert (lse - ref_lse).abs().max().item() <= 1e-3
    # The kernel's fp32 output is normalised P (bf16) @ V: within SDPA-bf16's own error.
    _assert_bf16_close(out, sdpa_out, ref_out)


def _items(heads: int, kv_heads: int, d: int, p: int, sizes: list[int], gap: int = 0):
    """q/k/v of items packed back to back (with `gap` unused rows before the last item), and a
    prefix."""
    n = sum(sizes) + gap
    q, k, v = _qkv(p + n, heads, kv_heads, d, torch.bfloat16, seed=p + n)
    pk, pv = k[:p], v[:p]
    bounds, a = [], 0
    for i, s in enumerate(sizes):
        a += gap if i == len(sizes) - 1 else 0
        bounds.append((a, a + s))
        a += s
    return q[p:], k[p:], v[p:], pk, pv, bounds


@pytest.mark.parametrize(("heads", "kv_heads", "d"), SHAPES[:2])
@pytest.mark.parametrize("p", [1, 130])
@pytest.mark.parametrize("gap", [0, 3])
def test_items_match_sdpa(kernel, heads: int, kv_heads: int, d: int, p: int, gap: int) -> None:
    """Items over a shared prefix in one kernel call: each item sees the prefix and itself only
    (the reference runs SDPA per item over prefix + item); rows outside every item untouched."""
    q, k, v, pk, pv, bounds = _items(heads, kv_heads, d, p, [1, 17, 5, 140], gap)
    n, scale = q.shape[0], 1 / math.sqrt(d)
    out = torch.full((n, heads * d), float("nan"), dtype=torch.bfloat16)
    attention.attend_items(q, k, v, out, scale, bounds, pk, pv)
    ref = torch.full((n, heads * d), float("nan"))
    sdpa = torch.full((n, heads * d), float("nan"), dtype=torch.bfloat16)
    for a, b in bounds:
        attention.attend(
            q[a:b].float(), k[a:b].float(), v[a:b].float(), ref[a:b], scale, pk.float(), pv.float()
        )
        sdpa[a:b] = _sdpa(q[a:b], k[a:b], v[a:b], scale, pk, pv)
    rows = torch.cat([torch.arange(a, b) for a, b in bounds])
    _assert_bf16_close(out[rows], sdpa[rows], ref[rows])
    assert out[bounds[-2][1] : bounds[-1][0]].isnan().all()  # the gap


def test_items_through_the_lse_merge(kernel) -> None:
    """The kernel's partials merged by log-sum-exp (attend_items' generic path) give the same
    result as its one-call path: checks the log-sum-exps end to end."""
    q, k, v, pk, pv, bounds = _items(9, 3, 64, 70, [3, 30, 9])
    n = q.shape[0]
    fused = torch.empty(n, 9 * 64, dtype=torch.bfloat16)
    merged = torch.empty(n, 9 * 64, dtype=torch.bfloat16)
    attention.attend_items(q, k, v, fused, 0.125, bounds, pk, pv)
    attention.attend_items(q, k, v, merged, 0.125, bounds, pk, pv, partial=attention_cpu.lse_partial)
    # Two roundings of P to bf16 in different places: a few bf16 ulps of |out| <= ~3.
    assert (fused.float() - merged.float()).abs().max().item() <= 0.03


def test_causal_blocks_above_the_diagonal_are_skipped(kernel) -> None:
    """Keys after a query's key block are never read: NaN K/V from token 256 on (a multiple of
    the kernel's key block) leave rows before 256 finite; later rows see the NaNs."""
    q, k, v = _qkv(300, 9, 3, 64, torch.bfloat16, seed=3)
    k, v = k.clone(), v.clone()
    k[256:], v[256:] = float("nan"), float("nan")
    out = torch.empty(300, 9 * 64, dtype=torch.bfloat16)
    attention.attend(q, k, v, out, 0.125)
    assert out[:256].isfinite().all()
    assert out[256:].isnan().all()


def test_kernel_rejects_bad_shapes(kernel) -> None:
    q, k, v = _qkv(8, 6, 4, 64, torch.bfloat16, seed=0)  # 6 query heads over 4 KV heads
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        attention_cpu.attend(q, k, v, torch.empty(8, 6 * 64, dtype=torch.bfloat16), 0.125)
    q, k, v = _qkv(8, 3, 1, 64, torch.bfloat16, seed=0)
    with pytest.raises(RuntimeError, match="as many as queries"):
        attention_cpu.attend(q, k[:5], v[:5], torch.empty(8, 3 * 64, dtype=torch.bfloat16), 0.125)


def test_choose() -> None:
    assert choose(torch.bfloat16, CPU, EPYC) == "kernel"
    assert choose(torch.bfloat16, CPU, XEON) == "sdpa"  # SDPA's own kernel uses AMX
    assert choose(torch.float32, CPU, EPYC) == "sdpa"  # the kernel is bf16 only
    assert choose(torch.bfloat16, CPU, frozenset({"avx2"})) == "sdpa"
    assert choose(torch.bfloat16, torch.device("meta"), EPYC) == "sdpa"


def test_choose_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PO_CPU_ATTENTION", "kernel")
    assert choose(torch.bfloat16, CPU, XEON) == "kernel"
    assert choose(torch.bfloat16, CPU, frozenset({"avx2"})) == "sdpa"  # no such instructions
    assert choose(torch.float32, CPU, EPYC) == "sdpa"
    monkeypatch.setenv("PO_CPU_ATTENTION", "sdpa")
    assert choose(torch.bfloat16, CPU, EPYC) == "sdpa"
    monkeypatch.setenv("PO_CPU_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PO_CPU_ATTENTION"):
        choose(torch.bfloat16, CPU, EPYC)


def test_unsupported_inputs_stay_on_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32, head dims the kernel does not take, and CPUs without avx512_bf16 never build or
    call the kernel."""
    calls: list[str] = []
    monkeypatch.setattr(attention_cpu, "load_kernel", lambda: calls.append("load") or True)
    assert not attention_cpu.supported(torch.empty(4, 2, 64))  # fp32
    assert not attention_cpu.supported(torch.empty(4, 2, 24, dtype=torch.bfloat16))
    monkeypatch.setattr(attention_cpu, "cpu_flags", lambda: frozenset({"avx2"}))
    assert not attention_cpu.supported(torch.empty(4, 2, 64, dtype=torch.bfloat16))
    assert calls == []


def test_build_failure_falls_back_to_sdpa(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """A failing build (simulated) logs one warning and attention runs on SDPA, same numbers."""
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("simulated compiler failure")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(attention_cpu, "_registered", lambda: False)  # as in a process that never loaded it
    monkeypatch.setattr(kernels, "compiler", lambda: "/usr/bin/c++")
    monkeypatch.setattr(attention_cpu, "cpu_flags", lambda: EPYC)
    monkeypatch.delenv("PO_CPU_ATTENTION", raising=False)
    attention_cpu.load_kernel.cache_clear()
    try:
        q, k, v = _qkv(50, 9, 3, 64, torch.bfloat16, seed=4)
        out = torch.empty(50, 9 * 64, dtype=torch.bfloat16)
        with caplog.at_level(logging.WARNING, logger="po_backend.engine.attention_cpu"):
            attention.attend(q, k, v, out, 0.125)
            attention.attend(q, k, v, out, 0.125)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "simulated compiler failure" in warnings[0]
        assert torch.equal(out, _sdpa(q, k, v, 0.125))
    finally:
        attention_cpu.load_kernel.cache_clear()  # the next test builds (or loads) for real


def _tiny_d64(tmp_path) -> tuple[str, torch.nn.Module]:
    """A tiny random Llama whose heads are 64 wide (the kernel's smallest), GQA 3:1."""
    cfg = transformers.LlamaConfig(
        vocab_size=300,
        hidden_size=96,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    randomize_(model, 0)
    model.save_pretrained(tmp_path / "llama64")
    return str(tmp_path / "llama64"), model.eval()


def test_engine_bf16_with_kernel_matches_transformers(kernel, tmp_path, monkeypatch) -> None:
    """The engine in bf16 on the kernel (causal prompts, then items over a cached prefix) against
    transformers fp32, no further off than the same engine on SDPA-bf16 (plus slack)."""
    from po_backend import Engine

    path, hf = _tiny_d64(tmp_path)
    prefix = [(5 * i + 1) % 300 for i in range(150)]
    prompts = [[(7 * i + 3) % 300 for i in range(n)] for n in (1, 33, 200)]
    items = [prefix + [(11 * i + j) % 300 for i in range(m)] for j, m in enumerate((1, 9, 40))]
    labels = [0, 5, 299]

    def worst(engine: Engine) -> float:
        w = 0.0
        for batch, kw in ((prompts, {}), (items, {"cache_prefix_len": len(prefix)})):
            for ids, res in zip(batch, engine.score(batch, labels, **kw), strict=True):
                ref = hf_next_logprobs(hf, ids)[labels].tolist()
                w = max(w, max(abs(a - b) for a, b in zip(res.logprobs, ref, strict=True)))
        return w

    engine = Engine.from_pretrained(path, dtype="bf16", max_input_len=256, max_batch_tokens=512)
    calls: list[str] = []
    for name in ("attend", "attend_items"):
        fn = getattr(attention_cpu, name)
        monkeypatch.setattr(attention_cpu, name, lambda *a, _f=fn, _n=name: calls.append(_n) or _f(*a))
    ours = worst(engine)
    assert set(calls) == {"attend", "attend_items"}, "the engine did not run the kernel on both paths"
    monkeypatch.setenv("PO_CPU_ATTENTION", "sdpa")  # read at every call: the same engine on SDPA
    calls.clear()
    sdpa = worst(engine)
    assert not calls
    assert ours <= 2 * sdpa + 0.05, (ours, sdpa)
    assert ours < 0.5  # today's bf16 bound (test_numerics)
