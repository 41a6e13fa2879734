"""Attention over whole sequences (never chunked: the fused SDPA kernel stays fast and its
memory is O(n)), optionally after a cached prefix whose K/V come from the prefix cache.

Grouped-query attention runs one SDPA call per KV head with that head broadcast (`expand`, no
copy) over its query heads: materialising repeated K/V cost 2x the attention output in memory,
and SDPA's `enable_gqa` measured 20% slower on CPU.

A cached prefix shared by several items (multi-item scoring) is attended ONCE for all the items'
queries together, and each item attends causally to itself; the two partial results are merged
with their log-sum-exps (the split-KV trick of flash-decoding). On CPU (fp32/bf16) the prefix K/V
are not copied per item and no [queries, keys] mask is built. Elsewhere (CUDA, fp16, or a torch
without the CPU flash op) `attend_items` falls back to `attend` per item, which concatenates the
prefix K/V with the item's own (a copy of the prefix per item) and builds a [n, prefix + n] mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The CPU flash kernel returns the log-sum-exp needed to merge partial attentions.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _causal_after_prefix(n_q: int, n_prefix: int, device: torch.device) -> torch.Tensor:
    """Boolean mask [n_q, n_prefix + n_q]: query i sees every prefix key and own keys <= i.

    SDPA's `is_causal=True` aligns the triangle top-left when there are fewer queries than keys,
    which is wrong for a cached prefix, so the lower-right alignment is spelled out here.
    """
    return torch.ones(n_q, n_prefix + n_q, dtype=torch.bool, device=device).tril(diagonal=n_prefix)


def _per_kv_head(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> list[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Split into (query-head slice, q [1,g,n,d], k [1,g,m,d], v) per KV head, K/V broadcast."""
    heads, kv_heads = q.shape[1], k.shape[1]
    g = heads // kv_heads
    parts = []
    for j in range(kv_heads):
        hs = slice(j * g, (j + 1) * g)
        kj = k[:, j : j + 1].transpose(0, 1).unsqueeze(0).expand(1, g, -1, -1)
        vj = v[:, j : j + 1].transpose(0, 1).unsqueeze(0).expand(1, g, -1, -1)
        parts.append((hs, q[:, hs].transpose(0, 1).unsqueeze(0), kj, vj))
    return parts


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
) -> None:
    """Causal attention of one sequence after an optional prefix, written into `out`.

    q: [n, heads, d]; k, v: [n, kv_heads, d] (the sequence's own tokens); prefix_k/v:
    [p, kv_heads, d]; out: [n, heads * d]. Works on any device.
    """
    n, heads, d = q.shape
    mask = None
    if prefix_k is not None and prefix_k.shape[0] > 0:
        assert prefix_v is not None, "prefix_k given without prefix_v"
        mask = _causal_after_prefix(n, prefix_k.shape[0], q.device)
        k = torch.cat([prefix_k, k], dim=0)
        v = torch.cat([prefix_v, v], dim=0)
    o3 = out.view(n, heads, d)
    for hs, qj, kj, vj in _per_kv_head(q, k, v):
        o = F.scaled_dot_product_attention(qj, kj, vj, attn_mask=mask, is_causal=mask is None, scale=scale)
        o3[:, hs].copy_(o.squeeze(0).transpose(0, 1))


def _flash_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per KV head: (out [n, heads, d] fp32, lse [n, heads] fp32)."""
    n, heads, d = q.shape
    out = torch.empty(n, heads, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(n, heads, dtype=torch.float32, device=q.device)
    for hs, qj, kj, vj in _per_kv_head(q, k, v):
        o, s = _CPU_FLASH(qj, kj, vj, 0.0, causal, scale=scale)
        out[:, hs] = o.squeeze(0).transpose(0, 1)
        lse[:, hs] = s.squeeze(0).transpose(0, 1)
    return out, lse


def attend_items(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    bounds: list[tuple[int, int]],
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
) -> None:
    """Items that share one cached prefix: item i (rows bounds[i] of q/k/v/out) attends to the
    whole prefix and causally to its own tokens only, never to another item."""
    if _CPU_FLASH is None or q.device.type != "cpu" or q.dtype == torch.float16:
        for a, b in bounds:
            attend(q[a:b], k[a:b], v[a:b], out[a:b], scale, prefix_k, prefix_v)
        return
    lo, hi = bounds[0][0], bounds[-1][1]
    o_pre, lse_pre = _flash_lse(q[lo:hi], prefix_k, prefix_v, False, scale)
    heads = q.shape[1]
    for a, b in bounds:
        o_own, lse_own = _flash_lse(q[a:b], k[a:b], v[a:b], True, scale)
        lp = lse_pre[a - lo : b - lo]
        m = torch.maximum(lp, lse_own)
        w_pre, w_own = torch.exp(lp - m), torch.exp(lse_own - m)
        # In place: a long item must not allocate several [n, heads, d] fp32 temporaries.
        merged = o_pre[a - lo : b - lo].mul_(w_pre[..., None])
        merged.add_(o_own.mul_(w_own[..., None])).div_((w_pre + w_own)[..., None])
        out[a:b].view(b - a, heads, -1).copy_(merged)
