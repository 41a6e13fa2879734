"""Token-wise layers against transformers' own functions, bit for bit where the dtype rounds."""

from __future__ import annotations

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
