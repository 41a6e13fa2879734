"""What one forward allocates beyond the weights and the prefix pool: the analytic bounds the
runners state (`Runner.activation_bound`), mirroring their buffers. The engine sizes the prefix
pool from the rest of the memory budget, and its profile run checks the bound by measurement."""

from __future__ import annotations

import torch

from po_backend.engine.attention import fallback_scratch_bytes, masked_scratch_bytes
from po_backend.engine.config import ModelConfig
from po_backend.engine.models.llama import HEAD_CHUNK_ELEMS


def activation_bytes(
    cfg: ModelConfig,
    dtype: torch.dtype,
    n_tokens: int,
    chunk_size: int,
    prefix_tokens: int = 0,
    device: torch.device | None = None,
    resid_dtype: torch.dtype | None = None,
    attn_dtype: torch.dtype | None = None,
) -> int:
    """Upper bound on what one hybrid forward over `n_tokens` packed tokens allocates beyond weights
    and the prefix pool. Mirrors `HybridRunner.forward`'s buffers; the profile run checks it by measurement.
    `device` (default CPU) decides whether items over a prefix may use attention's plain-torch
    fallback, whose score blocks are a constant. `resid_dtype`, `attn_dtype`: the residual
    stream's and attention's (default `dtype`; a wider attention dtype adds copies of q/k/v and
    the attention output, and of the prefix K/V)."""
    it = torch.empty((), dtype=dtype).element_size()
    rit = torch.empty((), dtype=resid_dtype or dtype).element_size()
    chunk = min(chunk_size, n_tokens) if chunk_size > 0 else n_tokens
    q, kv = cfg.q_size, cfg.kv_size
    per_token = rit * cfg.hidden_size + it * (
        q + 2 * kv + q + _ropes(cfg) * cfg.head_dim
    )  # h, qkv, attn, cos/sin
    per_token += it * 2 * q  # SDPA output of one KV-head group and its transpose copy (bound)
    per_token += 4 * 2 * q if prefix_tokens else 0  # fp32 partial outputs merged after a prefix
    # Contiguous copies of K/V stored into the pool, ids/positions/rotary angles, allocator slack:
    # measured 0.5-1 KB/token above the buffers on a 256-wide model; bound it generously.
    per_token += it * (cfg.hidden_size + 2 * kv) + 64
    wide = attn_dtype is not None and attn_dtype != dtype
    ait = torch.empty((), dtype=attn_dtype).element_size() if wide else 0
    per_token += ait * (2 * q + 2 * kv)
    scratch = it * chunk * (cfg.hidden_size + 3 * cfg.intermediate_size)
    head = _head_bytes(cfg, it)
    # One layer's prefix K/V gathered from the pool, and the bf16 CPU kernel's packed copy of it
    # (its packed copy of the items' own K/V is within the per-token copies above).
    prefix = (it * 4 + ait * 2) * prefix_tokens * kv
    if prefix_tokens:
        group = cfg.num_heads // cfg.num_kv_heads
        dev = device or torch.device("cpu")
        prefix += fallback_scratch_bytes(dev, dtype, group, prefix_tokens + n_tokens)
    return (
        per_token * n_tokens + scratch + head + prefix + _masked_bytes(cfg, dtype, prefix_tokens + n_tokens)
    )


def _ropes(cfg: ModelConfig) -> int:
    """How many cos/sin tables a forward holds (one per distinct RoPE)."""
    return len({cfg.layer_rope(li) for li in range(cfg.num_layers)})


def _masked_bytes(cfg: ModelConfig, dtype: torch.dtype, keys: int) -> int:
    """`windowed_attend`'s block scratch for layers with soft-capping or a window, over up to
    `keys` keys (a sliding layer's blocks read at most twice its window)."""
    spans = [
        keys if cfg.attn_softcap is not None else 0,
        *(min(keys, 2 * w) for w in {cfg.layer_window(li) for li in range(cfg.num_layers)} if w),
    ]
    return masked_scratch_bytes(cfg.num_heads, max(spans), dtype) if max(spans) else 0


def chunked_activation_bytes(
    cfg: ModelConfig,
    dtype: torch.dtype,
    n_tokens: int,
    chunk_size: int,
    prefix_tokens: int = 0,
    resid_dtype: torch.dtype | None = None,
    attn_dtype: torch.dtype | None = None,
) -> int:
    """Upper bound on one chunked-prefill forward (prefill_mode="chunked") over `n_tokens` packed
    tokens after up to `prefix_tokens` of cached prefix. Mirrors `ChunkedRunner.forward`: the term
    that grows with the context is the K/V of every layer."""
    it = torch.empty((), dtype=dtype).element_size()
    rit = torch.empty((), dtype=resid_dtype or dtype).element_size()
    n = n_tokens + prefix_tokens
    chunk = min(chunk_size, n_tokens) if chunk_size > 0 else n_tokens
    q, kv = cfg.q_size, cfg.kv_size
    resident_kv = it * 2 * cfg.num_layers * n * kv
    # attend(): one layer's context K/V concatenated (a copy, twice after a prefix), a
    # [chunk, context] bool mask and the additive float mask SDPA may build from it.
    attention = it * 4 * n * kv + chunk * n * (1 + 4)
    if attn_dtype is not None and attn_dtype != dtype:  # fp32 copies of the context and the chunk
        ait = torch.empty((), dtype=attn_dtype).element_size()
        attention += ait * (2 * n * kv + chunk * (2 * q + 2 * kv))
    scratch = it * chunk * (2 * cfg.hidden_size + 3 * q + 2 * kv + cfg.head_dim + 3 * cfg.intermediate_size)
    scratch += (rit - it) * chunk * cfg.hidden_size  # h in the residual dtype
    per_token = rit * cfg.hidden_size + it * cfg.head_dim + 64  # output rows, ids, positions, cos/sin
    head = _head_bytes(cfg, it)
    masked = _masked_bytes(cfg, dtype, n)
    return resident_kv + attention + scratch + per_token * n_tokens + head + masked


# Rows of the LM head computed at once: bounds the [rows, vocab] logits of long logprob spans.
LOGIT_ROWS = 64


def _head_bytes(cfg: ModelConfig, it: int) -> int:
    """One block of fp32 logits and their log-softmax, the block's hidden rows, and the fp32 head
    weights `final_logits` upcasts at a time plus one chunk's output."""
    logits = LOGIT_ROWS * cfg.vocab_size * (2 * 4 + it)
    upcast = 4 * HEAD_CHUNK_ELEMS + 4 * LOGIT_ROWS * (cfg.hidden_size + HEAD_CHUNK_ELEMS // cfg.hidden_size)
    return logits + upcast
