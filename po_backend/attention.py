"""Attention over a whole sequence at once (never chunked: the fused SDPA kernel stays fast and
its memory is O(n)), optionally after a cached prefix whose K/V come from the prefix cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _causal_after_prefix(n_q: int, n_prefix: int, device: torch.device) -> torch.Tensor:
    """Boolean mask [n_q, n_prefix + n_q]: query i sees every prefix key and own keys <= i.

    SDPA's `is_causal=True` aligns the triangle top-left when there are fewer queries than keys,
    which is wrong for a cached prefix, so the lower-right alignment is spelled out here.
    """
    return torch.ones(n_q, n_prefix + n_q, dtype=torch.bool, device=device).tril(diagonal=n_prefix)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
) -> None:
    """Causal attention of one sequence, written into `out`.

    q: [n, heads, d]; k, v: [n, kv_heads, d] (the sequence's own, uncached tokens);
    prefix_k/v: [p, kv_heads, d] cached K/V that every query may see; out: [n, heads * d].
    """
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    if prefix_k is not None and prefix_k.shape[0] > 0:
        assert prefix_v is not None, "prefix_k given without prefix_v"
        k = torch.cat([prefix_k, k], dim=0)
        v = torch.cat([prefix_v, v], dim=0)
        mask = _causal_after_prefix(n, prefix_k.shape[0], q.device)
    else:
        mask = None
    if kv_heads != heads:
        # Materialising the shared heads measured faster than SDPA's enable_gqa on CPU.
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    out.view(n, heads, d).copy_(o.squeeze(0).transpose(0, 1))
