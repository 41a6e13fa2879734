"""Token-wise layers against transformers' own functions, bit for bit where the dtype rounds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from po_backend.engine.models.layers import Rotary


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_fused_qkv_matches_transformers(dtype: torch.dtype) -> None:
    """`qkv_chunk` rotates q and k as ONE strided view of the fused [c, q|k|v] buffer, in place
    with shared temporaries; every product and sum must round exactly as transformers' does (so
    bf16 stays bit-identical), and v, which shares the rows, must stay untouched."""
    c, heads, kv_heads, d = 37, 6, 2, 16
    g = torch.Generator().manual_seed(0)
    qkv = (4 * torch.randn(c, (heads + 2 * kv_heads) * d, generator=g)).to(dtype)
    before = qkv.clone()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = Rotary(inv_freq, torch.device("cpu")).cos_sin(torch.arange(100, 100 + c), dtype)

    qk = qkv[:, : (heads + kv_heads) * d].view(c, heads + kv_heads, d)
    Rotary.apply_(qk, cos, sin)

    q = before[:, : heads * d].view(1, c, heads, d).transpose(1, 2)
    k = before[:, heads * d : (heads + kv_heads) * d].view(1, c, kv_heads, d).transpose(1, 2)
    full_cos = torch.cat([cos, cos], -1).view(1, c, d)  # transformers' [batch, seq, head_dim]
    full_sin = torch.cat([sin, sin], -1).view(1, c, d)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, full_cos, full_sin)
    assert torch.equal(qkv[:, : heads * d], q_ref.transpose(1, 2).reshape(c, heads * d))
    assert torch.equal(qkv[:, heads * d : (heads + kv_heads) * d], k_ref.transpose(1, 2).reshape(c, -1))
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], before[:, (heads + kv_heads) * d :])


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused fp32 kernels loaded (a compiler is part of the dev setup: a failed build fails)."""
    from po_backend.engine import fused_cpu

    assert fused_cpu.load(), "the fused fp32 kernels failed to build (see the logged warning)"
    monkeypatch.setattr(fused_cpu, "enabled", True)


def _torch_path(fn: object, *args: object, **kw: object) -> None:
    from po_backend.engine import fused_cpu

    was, fused_cpu.enabled = fused_cpu.enabled, False
    try:
        fn(*args, **kw)  # type: ignore[operator]
    finally:
        fused_cpu.enabled = was


@pytest.mark.usefixtures("fused")
def test_fused_rotary_is_transformers_bits_and_norms_within_an_ulp() -> None:
    """The fused fp32 kernels on strided views of the fused qkv buffer: RoPE bit for bit as torch's
    (= transformers') ops, the per-head q/k norm + RoPE and the residual add + norm within a few
    ulps (only the sum of squares runs in another order), v untouched; partial rotary too."""
    from po_backend.engine.models import layers

    c, heads, kv_heads, d = 37, 6, 2, 16
    g = torch.Generator().manual_seed(1)
    qkv = 4 * torch.randn(c, (heads + 2 * kv_heads) * d, generator=g)
    wq, wk = torch.randn(d, generator=g), torch.randn(d, generator=g)
    for rot in (d, d // 2):  # full and partial rotary
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
        cos, sin = Rotary(inv_freq, torch.device("cpu")).cos_sin(torch.arange(100, 100 + c), torch.float32)
        for norms in (None, (wq, wk)):
            ref, got = qkv.clone(), qkv.clone()
            views = [t[:, : (heads + kv_heads) * d].view(c, heads + kv_heads, d) for t in (ref, got)]
            _torch_path(layers.qk_norm_rope_, views[0], cos, sin, heads, 1e-6, norms)
            layers.qk_norm_rope_(views[1], cos, sin, heads, 1e-6, norms)
            if norms is None:
                assert torch.equal(got, ref)
            else:
                torch.testing.assert_close(got, ref, rtol=4e-7, atol=1e-6)
            assert torch.equal(got[:, (heads + kv_heads) * d :], qkv[:, (heads + kv_heads) * d :])
    h, delta, w = (
        torch.randn(c, 48, generator=g),
        torch.randn(c, 48, generator=g),
        torch.randn(48, generator=g),
    )
    h_ref, out_ref = h.clone(), torch.empty(c, 48)
    _torch_path(layers.add_rms_norm, h_ref, delta, w, 1e-6, out=out_ref)
    out = delta.clone()
    layers.add_rms_norm(h, out, w, 1e-6, out=out)  # out aliases delta, as out_mlp_chunk calls it
    assert torch.equal(h, h_ref)
    torch.testing.assert_close(out, out_ref, rtol=4e-7, atol=1e-6)


@pytest.mark.usefixtures("fused")
def test_fused_norm_is_row_wise_whatever_the_batch_or_address() -> None:
    """A row's fused norm is the same bits in any batch, at any offset (alignment) and any thread
    count: what batch invariance and a cache hit equal to the cold run rest on."""
    from po_backend.engine.models.layers import rms_norm

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(301, 1027, generator=g), torch.randn(1027, generator=g)
    full = rms_norm(x, w, 1e-6, out=torch.empty_like(x))
    buf = torch.empty(300 * 1027 + 3)
    for lo, hi in ((0, 1), (5, 6), (7, 300), (150, 301)):
        shifted = buf[3 : 3 + (hi - lo) * 1027].view(hi - lo, 1027)  # another alignment
        rms_norm(x[lo:hi], w, 1e-6, out=shifted)
        assert torch.equal(shifted, full[lo:hi])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(rms_norm(x, w, 1e-6, out=torch.empty_like(x)), full)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.usefixtures("fused")
def test_fused_silu_mul_matches_torchs_ops_and_is_elementwise() -> None:
    """SwiGLU's fused silu(gate) * up against torch's two ops (the path with the kernels off) on
    strided views of the chunk buffers, fp32 tight; the exp's tails and saturation included; and an
    element's bits the same at any position (the vector body and the scalar tail agree), in any
    batch or thread count."""
    from po_backend.engine.models.layers import silu_mul

    g = torch.Generator().manual_seed(3)
    inter = 77  # 9 vectors of 8 and a tail of 5
    big = 6 * torch.randn(40, 2 * inter, generator=g)
    big[0, :inter] = torch.tensor(
        [0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 89.0, -89.0, 100.0, -100.0, 3e38, -3e38] * 6 + [20.0] * 5
    )
    gate_up = big[:37]  # a view of a larger buffer, as the runner's [: b - a] chunk
    ref, out = torch.empty(37, inter), torch.empty(40, inter)[:37]
    src = gate_up.clone()
    _torch_path(silu_mul, src.clone(), out=ref)
    silu_mul(gate_up, out=out)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(gate_up, src)  # the fused pass leaves its input as it was
    # Position: each element moved to every offset within a vector gives the same bits.
    row = gate_up[1:2]
    for shift in range(1, 9):
        moved = torch.cat([torch.zeros(1, shift), row[:, :inter], torch.zeros(1, shift), row[:, inter:]], 1)
        got = silu_mul(moved, out=torch.empty(1, inter + shift))
        assert torch.equal(got[:, shift:], out[1:2]), shift
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(silu_mul(gate_up[5:9], out=torch.empty(4, inter)), out[5:9])
    finally:
        torch.set_num_threads(threads)


_NO_COMPILER = """
import logging, sys
import torch
logging.basicConfig(level=logging.WARNING)
from po_backend.engine import fused_cpu
from po_backend.engine.models.layers import rms_norm
assert not fused_cpu.enable(torch.float32, torch.device("cpu"))
assert not hasattr(torch.ops.po_fused, "rms_norm")
x, w = torch.randn(4, 8), torch.randn(8)
ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
assert torch.equal(rms_norm(x, w, 1e-6, out=torch.empty(4, 8)), ref)  # torch's ops ran
print("torch ops")
"""


def test_without_a_compiler_the_layers_run_torch_ops(tmp_path: Path) -> None:
    """No compiler (or a failed build): one warning, nothing loaded, torch's ops give the norm; in a
    child process, so this process's loaded kernels do not answer for it."""
    env = {**os.environ, "PREFILLONLY_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no-such-c++")}
    done = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "torch ops" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "no C++ compiler" in done.stderr
