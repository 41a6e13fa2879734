"""Attention over whole sequences (never chunked: the fused kernels stay fast and their memory is
O(n)), optionally after a cached prefix shared by several items, which is attended once for all
of them and merged with each item's own part by log-sum-exp (never copied per item, no
[queries, keys] mask). The kernels per device, GQA, sliding windows and soft-capping: the
"Attention" section of docs/how-it-works.md; the dispatch rules are `lse_attention` and
`needs_masking`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from po_backend.engine import attention_cpu, fused_cpu

log = logging.getLogger(__name__)

# The CPU flash kernel returns the log-sum-exp needed to merge partial attentions.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# CUDA's memory-efficient kernel does too (compute_log_sumexp=True), in fp32, fp16 and bf16.
_EFFICIENT = getattr(torch.ops.aten, "_scaled_dot_product_efficient_attention", None)

# The fp32 kernel's log-sum-exp output, when none is wanted.
_NO_LSE = torch.empty(0, 0)

# Scores the plain-torch fallback holds per block ([query heads of one KV head, rows, keys]):
# 16 MiB in fp32, whatever the prefix length.
FALLBACK_BLOCK_ELEMS = 1 << 22

# (q [n, heads, d], k/v [m, kv_heads, d], causal, scale) -> (out [n, heads, d] fp32, lse [n, heads] fp32)
LseAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]
]


@functools.cache
def _log_once(message: str) -> None:
    log.info(message)


def needs_masking(span: int, window: int | None, softcap: float | None) -> bool:
    """Whether attention over `span` keys (a cached prefix + the longest own sequence) needs
    `windowed_attend`: soft-capped scores, or a window some query's keys reach beyond."""
    return softcap is not None or (window is not None and span > window)


def _masked_rows(heads: int, n: int, span: int, window: int | None) -> int:
    """Query rows per block of `windowed_attend`: a block's scores stay within
    FALLBACK_BLOCK_ELEMS (at least one row). With a window, a block of r rows reads at most
    r + window - 1 keys, so r <= window keeps it under 2 * window."""
    keys = span if window is None else min(span, 2 * window)
    rows = max(1, FALLBACK_BLOCK_ELEMS // (heads * max(keys, 1)))
    return min(rows, n, window) if window is not None else min(rows, n)


def masked_scratch_bytes(heads: int, keys: int, dtype: torch.dtype) -> int:
    """What `windowed_attend` allocates at once for up to `keys` keys: a block's fp32 score parts,
    their concatenation and softmax, its copy in `dtype`, the mask (at least one query row)."""
    it = torch.empty((), dtype=dtype).element_size()
    return max(FALLBACK_BLOCK_ELEMS, heads * keys) * (3 * 4 + it + 1)


def windowed_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of one sequence after an optional prefix, with a sliding window (query at
    position i sees keys j with i - window < j <= i, as transformers' mask) and/or soft-capped
    scores, written into out [n, heads * d]. Positions: the prefix holds 0..p-1, q/k/v p..p+n-1.

    A window alone runs SDPA per block with the block's mask; soft-capping runs all query heads
    in one batched product per block, the softmax in fp32 after `scale` and the cap, in
    transformers' eager order."""
    n, heads, d = q.shape
    kv_heads = k.shape[1]
    g = heads // kv_heads
    p = 0 if prefix_k is None else prefix_k.shape[0]
    o3 = out.view(n, heads, d)
    rows = _masked_rows(heads, n, p + n, window)
    last: tuple[tuple[int, int, int], torch.Tensor] | None = None  # the previous block's mask
    for a in range(0, n, rows):
        b = min(a + rows, n)
        r = b - a
        lo = 0 if window is None else max(0, p + a - window + 1)  # first key position any row sees
        kparts, vparts = [], []
        if lo < p:
            assert prefix_k is not None and prefix_v is not None, "prefix_k given without prefix_v"
            kparts.append(prefix_k[lo:])
            vparts.append(prefix_v[lo:])
        kparts.append(k[max(lo - p, 0) : b])
        vparts.append(v[max(lo - p, 0) : b])
        # The block's keys and values (at most rows + window - 1; one copy where a window
        # crosses from the prefix into the item).
        kb, vb = (kparts[0], vparts[0]) if len(kparts) == 1 else (torch.cat(kparts), torch.cat(vparts))
        keys = kb.shape[0]
        # Which keys each row sees depends only on the block's shape and where its first row
        # sits among the keys: the same for every full block of a long sequence. SDPA takes the
        # keys seen, masked_fill the keys hidden.
        shape = (r, keys, p + a - lo)
        if last is not None and last[0] == shape:
            mask = last[1]
        else:
            diff = torch.arange(p + a, p + b, device=q.device)[:, None] - torch.arange(
                lo, lo + keys, device=q.device
            )
            hidden = (diff < 0) | (diff >= window) if window is not None else diff < 0
            mask = ~hidden if softcap is None else hidden
            last = (shape, mask)
        if softcap is None:
            # A window alone is a mask SDPA's fused kernels take: one call for all heads per
            # block (grouped-query in the call) measured faster than the plain ops and per-KV-head calls.
            o = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1).unsqueeze(0),
                kb.transpose(0, 1).unsqueeze(0),
                vb.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                scale=scale,
                enable_gqa=True,
            )
            o3[a:b].copy_(o[0].transpose(0, 1))
            continue
        # Head-major copies: batched GEMMs on strided views measured several times slower.
        kh, vh = kb.transpose(0, 1).contiguous(), vb.transpose(0, 1).contiguous()
        # [kv_heads, r * g, d]: a KV head's query heads are rows of one product.
        qb = q[a:b].view(r, kv_heads, g, d).permute(1, 0, 2, 3).reshape(kv_heads, r * g, d)
        s = torch.matmul(qb, kh.transpose(1, 2)).float().mul_(scale)
        s.div_(softcap).tanh_().mul_(softcap)
        s = s.view(kv_heads, r, g, keys).masked_fill_(mask[None, :, None, :], -torch.inf)
        prob = torch.softmax(s, dim=-1).to(v.dtype).view(kv_heads, r * g, keys)
        o = torch.matmul(prob, vh)
        o3[a:b].copy_(o.view(kv_heads, r, g, d).permute(1, 0, 2, 3).reshape(r, heads, d))


def _masked_fallback_note(q: torch.Tensor) -> None:
    if attention_cpu.choose(q.dtype, q.device) == "kernel":
        _log_once(
            "the bf16 CPU attention kernel takes neither sliding windows nor soft-capping: "
            "layers that need them run plain torch attention"
        )


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
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Causal attention of one sequence after an optional prefix, written into `out`.

    q: [n, heads, d]; k, v: [n, kv_heads, d] (the sequence's own tokens); prefix_k/v:
    [p, kv_heads, d]; out: [n, heads * d]. Works on any device. With a prefix it concatenates the
    K/V and builds a [n, p + n] mask: the chunked baseline's way (its bound counts both); items
    over a shared prefix use `attend_items`. window/softcap: see `windowed_attend`.
    """
    if prefix_k is not None and prefix_v is None:
        raise ValueError("prefix_k given without prefix_v")
    k, v, prefix_k, prefix_v = _like_q(q, k, v, prefix_k, prefix_v)
    p = 0 if prefix_k is None else prefix_k.shape[0]
    if needs_masking(p + q.shape[0], window, softcap):
        _masked_fallback_note(q)
        windowed_attend(q, k, v, out, scale, prefix_k, prefix_v, window, softcap)
        return
    prefix = None if prefix_k is None or prefix_v is None else (prefix_k, prefix_v)
    if attention_cpu.supported(q, k, v, prefix_k, prefix_v):
        attention_cpu.attend(q, k, v, out, scale, prefix)
        return
    n, heads, d = q.shape
    o3 = out.view(n, heads, d)
    p = 0 if prefix is None else prefix[0].shape[0]
    if fused_cpu.takes_attention(q, k, v, o3, *(prefix or ())):
        if n:
            if p:
                k, v = torch.cat([prefix[0], k]), torch.cat([prefix[1], v])  # type: ignore[index]
            fused_cpu.attention(q, k, v, o3, _NO_LSE, scale, p)
        return
    mask = None
    if prefix is not None and p > 0:
        mask = _causal_after_prefix(n, p, q.device)
        k = torch.cat([prefix[0], k], dim=0)
        v = torch.cat([prefix[1], v], dim=0)
    if q.device.type == "cpu":
        # One call for every head, grouped-query in the kernel: the CPU flash kernel parallelises
        # over all heads at once and its output is already token-major (one plain copy), where a
        # call per KV head measured slower at 16 heads of 128 (same bits).
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        o3.copy_(o[0].transpose(0, 1))
        return
    for hs, qj, kj, vj in _per_kv_head(q, k, v):
        o = F.scaled_dot_product_attention(qj, kj, vj, attn_mask=mask, is_causal=mask is None, scale=scale)
        o3[:, hs].copy_(o.squeeze(0).transpose(0, 1))


@functools.cache
def _warn_cast(q: torch.dtype, kv: torch.dtype) -> None:
    log.warning("attention: K/V in %s, queries in %s: K/V are cast to the queries' dtype", kv, q)


def _cast(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    if t.dtype == q.dtype:
        return t
    _warn_cast(q.dtype, t.dtype)
    return t.to(q.dtype)


def _like_q(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor | None, pv: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """K/V in the queries' dtype (a cast copy where they differ, e.g. a pool in another dtype):
    every attention path below takes one dtype."""
    return (
        _cast(q, k),
        _cast(q, v),
        None if pk is None else _cast(q, pk),
        None if pv is None else _cast(q, pv),
    )


def _empty_partial(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, heads, d = q.shape
    out = torch.empty(n, heads, d, dtype=torch.float32, device=q.device)
    return out, torch.empty(n, heads, dtype=torch.float32, device=q.device)


def cpu_flash_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention with its log-sum-exp from torch's CPU flash kernel (CPU, fp32/bf16): one
    call for every head, grouped-query in the kernel (the same bits as a call per KV head, in one
    parallel region). The results are [n, heads, ...] views of the kernel's head-major outputs."""
    assert _CPU_FLASH is not None, "this torch has no CPU flash attention kernel"
    if k.shape[0] == 0:  # no keys: nothing to attend (the kernel divides by the key count)
        out, lse = _empty_partial(q)
        return out.zero_(), lse.fill_(-torch.inf)
    o, s = _CPU_FLASH(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        0.0,
        causal,
        scale=scale,
    )
    return o[0].transpose(0, 1).float(), s[0].transpose(0, 1).float()


def cpu_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU partial attention with its log-sum-exp: the bf16 kernel or the fp32 one where they run,
    else torch's CPU flash kernel. A causal call has as many queries as keys."""
    if attention_cpu.supported(q):
        return attention_cpu.lse_partial(q, k, v, causal, scale)
    if fused_cpu.takes_attention(q, k, v):
        out, lse = _empty_partial(q)
        if k.shape[0] == 0:  # no keys: nothing to attend, weighed to nothing by the merge
            return out.zero_(), lse.fill_(-torch.inf)
        if q.shape[0]:
            fused_cpu.attention(q, k, v, out, lse, scale, 0 if causal else -1)
        return out, lse
    return cpu_flash_lse(q, k, v, causal, scale)


def efficient_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention with its log-sum-exp from CUDA's memory-efficient SDPA kernel, the one
    `F.scaled_dot_product_attention` dispatches to for these (expanded K/V) inputs. A causal call
    has as many queries as keys, where the kernel's top-left triangle is the right one."""
    assert _EFFICIENT is not None, "this torch has no memory-efficient attention kernel"
    n = q.shape[0]
    out, lse = _empty_partial(q)
    for hs, qj, kj, vj in _per_kv_head(q, k, v):
        o, s, _, _ = _EFFICIENT(qj, kj, vj, None, True, 0.0, causal, scale=scale)
        out[:, hs] = o.squeeze(0).transpose(0, 1)
        # The kernel pads the log-sum-exp's query axis to a multiple of 32 (not on ROCm).
        lse[:, hs] = s[0, :, :n].transpose(0, 1)
    return out, lse


def torch_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial attention with its log-sum-exp in plain torch ops, for any device and dtype.

    Blocks of query rows keep the scores of one KV head's query heads within
    `FALLBACK_BLOCK_ELEMS` (fp32 softmax); K/V are read in place, never copied. A causal call
    (as many queries as keys) reads only the keys up to each block's last row."""
    n, heads, d = q.shape
    m, kv_heads = k.shape[0], k.shape[1]
    g = heads // kv_heads
    out, lse = _empty_partial(q)
    rows = max(1, FALLBACK_BLOCK_ELEMS // (g * max(m, 1)))
    for j in range(kv_heads):
        hs = slice(j * g, (j + 1) * g)
        kj, vj = k[:, j], v[:, j]  # [m, d] views
        for a in range(0, n, rows):
            b = min(a + rows, n)
            keys = b if causal else m
            # A KV head's g query heads are rows of one matrix product: a batched product would
            # broadcast (copy) the K/V to every query head.
            qb = q[a:b, hs].reshape((b - a) * g, d)
            s = torch.matmul(qb, kj[:keys].t()).float().mul_(scale).view(b - a, g, keys)
            if causal:
                later = torch.ones(b - a, keys, dtype=torch.bool, device=q.device).triu_(a + 1)
                s.masked_fill_(later[:, None, :], -torch.inf)
            block_lse = torch.logsumexp(s, dim=-1)  # [r, g]
            p = s.sub_(block_lse[..., None]).exp_().view((b - a) * g, keys)
            out[a:b, hs] = torch.matmul(p.to(vj.dtype), vj[:keys]).view(b - a, g, d)
            lse[a:b, hs] = block_lse
    return out, lse


def _efficient_or_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        return efficient_lse(q, k, v, causal, scale)
    except (RuntimeError, NotImplementedError) as e:  # a head size or GPU the kernel does not take
        log.warning("memory-efficient attention unavailable (%s); using the plain torch fallback", e)
        return torch_lse(q, k, v, causal, scale)


def lse_attention(device: torch.device, dtype: torch.dtype) -> LseAttention:
    """The partial-attention-with-log-sum-exp implementation for tensors on `device` of `dtype`."""
    if device.type == "cpu" and _CPU_FLASH is not None and dtype in (torch.float32, torch.bfloat16):
        return cpu_lse
    if device.type == "cuda" and _EFFICIENT is not None:
        return _efficient_or_torch
    return torch_lse


def fallback_scratch_bytes(device: torch.device, dtype: torch.dtype, group: int, keys: int) -> int:
    """What `torch_lse` allocates beyond the partial outputs when `device`/`dtype` may use it, for
    `group` query heads per KV head and up to `keys` keys: one block of fp32 scores (at least one
    query row; exponentiated in place), its copy in `dtype`, and a causal mask block."""
    if lse_attention(device, dtype) is cpu_lse:
        return 0
    it = torch.empty((), dtype=dtype).element_size()
    return max(FALLBACK_BLOCK_ELEMS, group * keys) * (4 + it + 1)


def attend_items(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    bounds: list[tuple[int, int]],
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    partial: LseAttention | None = None,
    window: int | None = None,
    softcap: float | None = None,
    per_item: bool = False,
) -> None:
    """Items that share one cached prefix: item i (rows bounds[i] of q/k/v/out) attends to the
    whole prefix and causally to its own tokens only, never to another item.

    partial: the partial-attention implementation; None picks the device's: the bf16 CPU kernel
    in one call (each query's online softmax runs on from the prefix into its own item, nothing
    to merge), else `lse_attention`. window/softcap: items whose keys need them run
    `windowed_attend` one by one, each reading only the part of the prefix its window reaches.
    per_item: each item's prefix part in a call of its own (see below)."""
    k, v = _cast(q, k), _cast(q, v)
    prefix_k, prefix_v = _cast(q, prefix_k), _cast(q, prefix_v)
    longest = max(b - a for a, b in bounds)
    if needs_masking(prefix_k.shape[0] + longest, window, softcap):
        _masked_fallback_note(q)
        for a, b in bounds:
            windowed_attend(q[a:b], k[a:b], v[a:b], out[a:b], scale, prefix_k, prefix_v, window, softcap)
        return
    if partial is None and attention_cpu.supported(q, k, v, prefix_k, prefix_v):
        attention_cpu.attend_items(q, k, v, out, scale, bounds, (prefix_k, prefix_v))
        return
    if partial is None:
        partial = lse_attention(q.device, q.dtype)
    lo, hi = bounds[0][0], bounds[-1][1]
    # `per_item`: each item's prefix part is its own call, shaped as when the item runs alone:
    # the flash kernel's query blocking (and so a row's last bits) depends on how many queries a
    # call has, and under bf16 weights those bits grow through the layers into scores that would
    # depend on the batch. Otherwise all items' queries go in one call (fewer, larger calls).
    batched = not per_item
    if batched:
        o_all, lse_all = partial(q[lo:hi], prefix_k, prefix_v, False, scale)
    heads = q.shape[1]
    for a, b in bounds:
        if batched:
            o_pre, lp = o_all[a - lo : b - lo], lse_all[a - lo : b - lo]
        else:
            o_pre, lp = partial(q[a:b], prefix_k, prefix_v, False, scale)
        o_own, lse_own = partial(q[a:b], k[a:b], v[a:b], True, scale)
        m = torch.maximum(lp, lse_own)
        w_pre, w_own = torch.exp(lp - m), torch.exp(lse_own - m)
        # In place: a long item must not allocate several [n, heads, d] fp32 temporaries.
        merged = o_pre.mul_(w_pre[..., None])
        merged.add_(o_own.mul_(w_own[..., None])).div_((w_pre + w_own)[..., None])
        out[a:b].view(b - a, heads, -1).copy_(merged)
