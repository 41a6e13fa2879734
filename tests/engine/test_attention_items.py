"""Items over a shared cached prefix on every device's path: the partial attentions with their
log-sum-exps (CPU flash, CUDA memory-efficient, plain torch) merge to what SDPA gives over the
concatenated prefix and item, and none copies the prefix per item or builds a [n, p + n] mask.

The CUDA kernel cannot run here: its wrapper runs on CPU tensors over a stand-in with the kernel's
contract (output [B, H, M, D] in the input dtype, log-sum-exp [B, H, M rounded up to 32]), and
the real op's meta kernel checks that contract for this torch."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from po_backend.engine import attention
from po_backend.engine.attention import (
    attend,
    attend_items,
    cpu_flash_lse,
    cpu_lse,
    efficient_lse,
    fallback_scratch_bytes,
    lse_attention,
    torch_lse,
)

HEADS, KV_HEADS, D = 6, 2, 16
SCALE = 1.0 / math.sqrt(D)


def _qkv(n: int, heads: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, heads, D, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _items(dtype: torch.dtype, p: int = 37, sizes: tuple[int, ...] = (5, 1, 12, 8)):
    n = sum(sizes)
    q, k, v = _qkv(n, HEADS, dtype, 0), _qkv(n, KV_HEADS, dtype, 1), _qkv(n, KV_HEADS, dtype, 2)
    pk, pv = _qkv(p, KV_HEADS, dtype, 3), _qkv(p, KV_HEADS, dtype, 4)
    bounds, a = [], 0
    for s in sizes:
        bounds.append((a, a + s))
        a += s
    return q, k, v, pk, pv, bounds


def _reference(q, k, v, pk, pv, bounds) -> torch.Tensor:
    """SDPA per item over the prefix and the item concatenated, with the explicit mask."""
    out = torch.empty(q.shape[0], HEADS * D, dtype=q.dtype)
    for a, b in bounds:
        attend(q[a:b], k[a:b], v[a:b], out[a:b], SCALE, pk, pv)
    return out


def _fake_efficient(q, k, v, bias, compute_lse, dropout, causal, *, scale):
    """The CUDA memory-efficient kernel's contract, computed in plain torch on CPU: the
    log-sum-exp's query axis padded to a multiple of 32 (with garbage the wrapper must drop)."""
    assert bias is None and compute_lse and dropout == 0.0
    g, m = q.shape[1], q.shape[2]
    out, lse = torch_lse(
        q[0].transpose(0, 1), k[0, :1].transpose(0, 1), v[0, :1].transpose(0, 1), causal, scale
    )
    padded = torch.full((1, g, math.ceil(m / 32) * 32), 1e4)
    padded[0, :, :m] = lse.transpose(0, 1)
    return out.to(q.dtype).transpose(0, 1).unsqueeze(0), padded, torch.empty(()), torch.empty(())


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("rows", [1 << 22, 40])  # one block, and blocks of a few rows
def test_torch_lse_matches_cpu_flash(causal: bool, rows: int, monkeypatch) -> None:
    monkeypatch.setattr(attention, "FALLBACK_BLOCK_ELEMS", rows)
    q, k, v = (
        _qkv(29, HEADS, torch.float32, 0),
        _qkv(29, KV_HEADS, torch.float32, 1),
        _qkv(29, KV_HEADS, torch.float32, 2),
    )
    got, want = torch_lse(q, k, v, causal, SCALE), cpu_flash_lse(q, k, v, causal, SCALE)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["cpu_flash", "torch", "torch_blocks", "efficient"])
def test_attend_items_matches_sdpa_fp32(impl: str, monkeypatch) -> None:
    partial = {
        "cpu_flash": cpu_flash_lse,
        "torch": torch_lse,
        "torch_blocks": torch_lse,
        "efficient": efficient_lse,
    }[impl]
    if impl == "torch_blocks":
        monkeypatch.setattr(attention, "FALLBACK_BLOCK_ELEMS", 100)  # a few rows per block
    if impl == "efficient":
        monkeypatch.setattr(attention, "_EFFICIENT", _fake_efficient)
    q, k, v, pk, pv, bounds = _items(torch.float32)
    out = torch.full((q.shape[0], HEADS * D), float("nan"))
    attend_items(q, k, v, out, SCALE, bounds, pk, pv, partial=partial)
    assert (out - _reference(q, k, v, pk, pv, bounds)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fallback_low_precision_close_to_fp32(dtype: torch.dtype) -> None:
    """fp16 on CPU dispatches to the plain torch path; bf16 through it stays as close to fp32 as
    SDPA in that dtype does."""
    q, k, v, pk, pv, bounds = _items(dtype)
    ref = _reference(*(t.float() for t in (q, k, v, pk, pv)), bounds)
    out = torch.empty(q.shape[0], HEADS * D, dtype=dtype)
    attend_items(q, k, v, out, SCALE, bounds, pk, pv, partial=torch_lse)
    sdpa = _reference(q, k, v, pk, pv, bounds)
    tol = 2 * (sdpa.float() - ref).abs().max().item() + 1e-2
    assert (out.float() - ref).abs().max().item() <= tol


def test_dispatch_by_device_and_dtype(monkeypatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # CPU: torch's flash kernel, or the bf16 kernel where it runs (tests/engine/test_attention_cpu.py)
    assert lse_attention(cpu, torch.float32) is cpu_lse
    assert lse_attention(cpu, torch.bfloat16) is cpu_lse
    assert lse_attention(cpu, torch.float16) is torch_lse
    assert lse_attention(torch.device("mps"), torch.float16) is torch_lse
    assert lse_attention(cuda, torch.bfloat16) not in (cpu_lse, cpu_flash_lse, torch_lse)
    assert fallback_scratch_bytes(cpu, torch.float32, 3, 100) == 0  # CPU kernels: no score blocks
    assert fallback_scratch_bytes(cpu, torch.float16, 3, 100) > 0
    assert fallback_scratch_bytes(cuda, torch.float16, 3, 100) > 0  # if the kernel rejects a shape
    monkeypatch.setattr(attention, "_CPU_FLASH", None)  # a torch without the CPU flash op
    assert lse_attention(cpu, torch.float32) is torch_lse


def test_cuda_kernel_contract_on_meta() -> None:
    """The real op's meta kernel: output [B, H, M, D], log-sum-exp padded to 32 query rows."""
    q = torch.empty(1, 3, 45, D, device="meta")
    k = torch.empty(1, 3, 70, D, device="meta")
    o, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, k, None, True, 0.0, False, scale=0.1
    )
    assert tuple(o.shape) == (1, 3, 45, D)
    assert lse.shape[:2] == (1, 3) and lse.shape[2] >= 45


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op allocates (views of its inputs excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


def test_fallback_memory_is_independent_of_the_prefix(monkeypatch) -> None:
    """The plain-torch path never copies the prefix per item nor builds a [n, p + n] mask: the
    largest tensor it makes is the items' fp32 partial output or one block of scores."""
    block = 4096
    monkeypatch.setattr(attention, "FALLBACK_BLOCK_ELEMS", block)
    q, k, v, pk, pv, bounds = _items(torch.float32, p=3000, sizes=(40, 30))
    n = q.shape[0]
    out = torch.empty(n, HEADS * D)
    with _Largest() as rec:
        attend_items(q, k, v, out, SCALE, bounds, pk, pv, partial=torch_lse)
    # At least one query row of scores per block: a KV head's query heads x every key.
    assert rec.largest <= max(n * HEADS * D, block, HEADS // KV_HEADS * 3000)
    assert rec.largest < n * 3000  # today's fallback built a [n, p + n] mask per item
    assert (out - _reference(q, k, v, pk, pv, bounds)).abs().max().item() <= 1e-4


def test_an_item_gets_the_same_bits_alone_and_in_a_batch() -> None:
    """per_item: each item of a multi-item call is computed as if it ran alone, to the last bit
    (under bf16 weights those bits would grow through the layers into scores that depend on the
    batch)."""
    torch.manual_seed(0)
    lens = [32, 37, 33, 35, 36, 34, 33, 38, 31, 35, 36, 37, 32, 33, 34, 35]  # 560 queries
    n, (heads, kv, d) = sum(lens), (9, 3, 64)
    q, k, v = torch.randn(n, heads, d), torch.randn(n, kv, d), torch.randn(n, kv, d)
    pk, pv = torch.randn(35, kv, d), torch.randn(35, kv, d)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    bounds = [(a, a + m) for a, m in zip(starts, lens, strict=True)]
    out = torch.empty(n, heads * d)
    attend_items(q, k, v, out, 0.125, bounds, pk, pv, per_item=True)
    for a, b in bounds:
        alone = torch.empty(b - a, heads * d)
        attend_items(q[a:b], k[a:b], v[a:b], alone, 0.125, [(0, b - a)], pk, pv, per_item=True)
        assert torch.equal(alone, out[a:b])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (16, 8), (4, 4)])
@pytest.mark.parametrize(("causal", "n", "m"), [(True, 37, 37), (False, 37, 300), (False, 5, 1)])
def test_cpu_flash_lse_one_grouped_call_is_the_per_kv_head_bits(
    dtype: torch.dtype, heads: int, kv_heads: int, causal: bool, n: int, m: int
) -> None:
    """`cpu_flash_lse` makes one grouped-query kernel call for all heads: the same bits, output
    and log-sum-exp, as the call per KV head it replaced (kept here as the reference)."""
    assert attention._CPU_FLASH is not None
    g = torch.Generator().manual_seed(heads + m)
    q = torch.randn(n, heads, D, generator=g).to(dtype)
    k, v = (torch.randn(m, kv_heads, D, generator=g).to(dtype) for _ in range(2))
    out, lse = cpu_flash_lse(q, k, v, causal, SCALE)
    ref_out = torch.empty(n, heads, D)
    ref_lse = torch.empty(n, heads)
    for hs, qj, kj, vj in attention._per_kv_head(q, k, v):
        o, s = attention._CPU_FLASH(qj, kj, vj, 0.0, causal, scale=SCALE)
        ref_out[:, hs] = o.squeeze(0).transpose(0, 1)
        ref_lse[:, hs] = s.squeeze(0).transpose(0, 1)
    assert out.dtype == lse.dtype == torch.float32
    assert torch.equal(out, ref_out)
    assert torch.equal(lse, ref_lse)


def test_cpu_flash_lse_without_keys_is_an_empty_partial() -> None:
    """No keys (an empty prefix): zero output and a log-sum-exp of -inf, which the merge weighs
    to nothing, not the kernel's division by zero."""
    q = _qkv(5, HEADS, torch.float32, 0)
    out, lse = cpu_flash_lse(q, q.new_empty(0, KV_HEADS, D), q.new_empty(0, KV_HEADS, D), False, SCALE)
    assert torch.equal(out, torch.zeros(5, HEADS, D))
    assert bool((lse == -torch.inf).all())
