"""The fp32 CPU attention kernel (`csrc/attention_fp32.cpp`, through `attention.attend` and
`attention.cpu_lse`): against SDPA in float64 at lengths around its block sizes (256 query rows
of a KV head's group, 512 keys), after a prefix, grouped-query and not, with its log-sum-exp
against torch's flash kernel; the same bits on any thread count; `PO_CPU_ATTENTION=sdpa` keeps
SDPA; the engine against transformers, a cache hit against the cold run."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from po_backend.engine import fused_cpu
from po_backend.engine.attention import attend, attend_items, cpu_flash_lse, cpu_lse

TOL = 2e-5  # fp32 against a float64 reference (torch's flash kernel is as far)


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 kernels loaded (a compiler is part of the dev setup: a failed build fails)."""
    assert fused_cpu.load(), "the fused fp32 kernels failed to build (see the logged warning)"
    monkeypatch.setattr(fused_cpu, "enabled", True)
    monkeypatch.delenv("PO_CPU_ATTENTION", raising=False)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True
) -> torch.Tensor:
    """SDPA in float64, query i seeing keys j <= i + (m - n) (lower-right causal) or all keys."""
    n, m = q.shape[0], k.shape[0]
    mask = torch.ones(n, m, dtype=torch.bool).tril(diagonal=m - n) if causal else None
    o = F.scaled_dot_product_attention(
        *(t.double().transpose(0, 1).unsqueeze(0) for t in (q, k, v)),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1).float()


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records each call of the kernel (its offset)."""
    calls: list[int] = []
    run = fused_cpu.attention

    def spy(*args: Any) -> None:
        calls.append(args[-1])
        run(*args)

    monkeypatch.setattr(fused_cpu, "attention", spy)
    return calls


LAYOUTS = [(16, 8, 128), (6, 2, 64), (4, 4, 72), (9, 3, 20)]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize(("heads", "kv_heads", "d"), LAYOUTS)
@pytest.mark.parametrize(
    ("n", "prefix"), [(1, 0), (37, 0), (129, 0), (700, 0), (1100, 0), (300, 5), (129, 513)]
)
def test_causal_matches_sdpa(monkeypatch, heads: int, kv_heads: int, d: int, n: int, prefix: int) -> None:
    """Lengths below, at and across the query and key blocks, with and without a prefix."""
    calls = _calls(monkeypatch)
    q, k, v = _rand(n, heads, d, seed=0), _rand(n, kv_heads, d, seed=1), _rand(n, kv_heads, d, seed=2)
    pk, pv = _rand(prefix, kv_heads, d, seed=3), _rand(prefix, kv_heads, d, seed=4)
    out = torch.full((n, heads * d), torch.nan)
    scale = d**-0.5
    attend(q, k, v, out, scale, pk if prefix else None, pv if prefix else None)
    assert calls == [prefix]
    ref = _reference(q, torch.cat([pk, k]), torch.cat([pv, v]), scale)
    torch.testing.assert_close(out.view(n, heads, d), ref, atol=TOL, rtol=TOL)


@pytest.mark.usefixtures("kernel")
def test_strided_views_of_one_packed_buffer(monkeypatch) -> None:
    """The runner's q/k/v are column slices of one [tokens, q + 2 kv] buffer and the output a row
    slice: read and written in place."""
    calls = _calls(monkeypatch)
    heads, kv_heads, d, n = 16, 8, 128, 300
    qkv = _rand(n, (heads + 2 * kv_heads) * d, seed=5)
    q = qkv[:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
    out = torch.zeros(n + 10, heads * d)
    attend(q, k, v, out[5 : n + 5], 0.1)
    assert calls == [0]
    torch.testing.assert_close(out[5 : n + 5].view(n, heads, d), _reference(q, k, v, 0.1), atol=TOL, rtol=TOL)
    assert not out[:5].any() and not out[n + 5 :].any()


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize(("heads", "kv_heads", "d"), LAYOUTS)
@pytest.mark.parametrize(
    ("causal", "n", "m"), [(True, 37, 37), (True, 700, 700), (False, 37, 1100), (False, 5, 1)]
)
def test_partial_with_lse_matches_flash(
    monkeypatch, heads: int, kv_heads: int, d: int, causal: bool, n: int, m: int
) -> None:
    """`cpu_lse` (the items path's partials) runs the kernel: output and log-sum-exp as torch's
    flash kernel's, within fp32 rounding."""
    calls = _calls(monkeypatch)
    q, k, v = _rand(n, heads, d, seed=6), _rand(m, kv_heads, d, seed=7), _rand(m, kv_heads, d, seed=8)
    out, lse = cpu_lse(q, k, v, causal, 0.1)
    assert calls == [0 if causal else -1]
    ref_out, ref_lse = cpu_flash_lse(q, k, v, causal, 0.1)
    assert out.dtype == lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=TOL, rtol=TOL)
    torch.testing.assert_close(lse, ref_lse, atol=TOL, rtol=TOL)


@pytest.mark.usefixtures("kernel")
def test_partial_without_keys_is_empty() -> None:
    q = _rand(5, 6, 16, seed=9)
    out, lse = cpu_lse(q, q.new_empty(0, 2, 16), q.new_empty(0, 2, 16), False, 0.25)
    assert torch.equal(out, torch.zeros(5, 6, 16))
    assert bool((lse == -torch.inf).all())


@pytest.mark.usefixtures("kernel")
def test_items_over_a_prefix_match_sdpa(monkeypatch) -> None:
    """Items sharing a prefix through the log-sum-exp merge, one call for all items' prefix part
    and one per item, against SDPA over each item's prefix and own keys."""
    calls = _calls(monkeypatch)
    heads, kv_heads, d, p = 16, 8, 128, 600
    sizes = [5, 1, 300, 40]
    n = sum(sizes)
    q, k, v = _rand(n, heads, d, seed=10), _rand(n, kv_heads, d, seed=11), _rand(n, kv_heads, d, seed=12)
    pk, pv = _rand(p, kv_heads, d, seed=13), _rand(p, kv_heads, d, seed=14)
    bounds = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
    out = torch.empty(n, heads * d)
    attend_items(q, k, v, out, 0.1, bounds, pk, pv)
    assert calls == [-1] + [0] * len(sizes)
    for a, b in bounds:
        ref = _reference(q[a:b], torch.cat([pk, k[a:b]]), torch.cat([pv, v[a:b]]), 0.1)
        torch.testing.assert_close(out[a:b].view(b - a, heads, d), ref, atol=TOL, rtol=TOL)


@pytest.mark.usefixtures("kernel")
def test_same_bits_on_any_thread_count() -> None:
    """Work items go to whichever thread is free; each is computed by one thread alone, so a row's
    bits do not depend on the thread count or the schedule."""
    heads, kv_heads, d, n = 16, 8, 128, 1100
    q, k, v = _rand(n, heads, d, seed=15), _rand(n, kv_heads, d, seed=16), _rand(n, kv_heads, d, seed=17)
    threads = torch.get_num_threads()
    outs = []
    try:
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            out = torch.empty(n, heads * d)
            attend(q, k, v, out, 0.1)
            outs.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.usefixtures("kernel")
def test_sdpa_override_and_other_inputs_keep_sdpa(monkeypatch) -> None:
    """PO_CPU_ATTENTION=sdpa (read at every call), bf16, or heads that are not contiguous per token
    run torch's SDPA: the same bits as the plain call."""
    calls = _calls(monkeypatch)
    n, heads, kv_heads, d = 50, 6, 2, 16
    q, k, v = _rand(n, heads, d, seed=18), _rand(n, kv_heads, d, seed=19), _rand(n, kv_heads, d, seed=20)

    def sdpa(q, k, v):
        o = F.scaled_dot_product_attention(
            *(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=True, scale=0.1, enable_gqa=True
        )
        return o[0].transpose(0, 1).reshape(n, -1)

    monkeypatch.setenv("PO_CPU_ATTENTION", "sdpa")
    out = torch.empty(n, heads * d)
    attend(q, k, v, out, 0.1)
    assert torch.equal(out, sdpa(q, k, v))
    monkeypatch.delenv("PO_CPU_ATTENTION")
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    out_b = torch.empty(n, heads * d, dtype=torch.bfloat16)
    attend(qb, kb, vb, out_b, 0.1)
    assert torch.equal(out_b, sdpa(qb, kb, vb))
    wide = torch.zeros(n, heads, 2 * d)
    wide[..., :d] = q
    qs = wide[..., :d]  # each token's heads not contiguous: stride(1) != d
    attend(qs, k, v, out, 0.1)
    assert torch.equal(out, sdpa(q, k, v))
    assert calls == []
