"""The model runner: one prefill-only forward over a packed batch of sequences.

Hybrid prefilling: every token-wise op (embedding, norms, QKV/O projections, MLP, residual adds)
runs over the packed tokens in chunks, writing into buffers allocated once per forward; attention
runs per sequence over all of its tokens at once. A layer's K/V live in one buffer that the next
layer overwrites (last-layer-only KV); only tokens the caller asks to cache are copied into the
prefix pool. The LM head runs only on the rows whose next-token distribution is wanted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from po_backend.attention import attend, attend_items
from po_backend.cache.kv_pool import KVPool
from po_backend.config import ModelConfig
from po_backend.models.layers import Rotary
from po_backend.models.llama import LlamaForCausalLM


@dataclass(frozen=True)
class SeqPlan:
    """One sequence of a packed forward."""

    token_ids: torch.Tensor  # [n] int64: the tokens to compute (the part not in the prefix cache)
    logit_offsets: torch.Tensor  # int64 offsets into token_ids whose next-token logits are wanted
    start_pos: int = 0  # position of token_ids[0] = number of cached prefix tokens before it
    prefix_slots: torch.Tensor | None = None  # pool slots holding the cached prefix (len start_pos)
    store_slots: torch.Tensor | None = None  # pool slots that receive K/V of token_ids[:len(slots)]

    def __post_init__(self) -> None:
        assert self.token_ids.numel() > 0, "a sequence needs at least one token to compute"
        n_prefix = 0 if self.prefix_slots is None else self.prefix_slots.numel()
        assert n_prefix == self.start_pos, f"prefix slots ({n_prefix}) != start_pos ({self.start_pos})"
        if self.store_slots is not None:
            assert self.store_slots.numel() <= self.token_ids.numel(), "more store slots than tokens"


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, device: torch.device, chunk_size: int) -> None:
        self.model = model
        self.cfg = model.cfg
        self.device = device
        self.dtype = model.embed_tokens.dtype
        self.chunk_size = chunk_size
        self.rotary = Rotary(self.cfg.rope.inv_freq(self.cfg.head_dim), device)
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)

    @torch.inference_mode()
    def forward(self, seqs: list[SeqPlan], pool: KVPool | None = None) -> torch.Tensor:
        """Final hidden states [m, hidden] at every seq's logit_offsets, concatenated in order."""
        cfg, dev, dt = self.cfg, self.device, self.dtype
        ids = torch.cat([s.token_ids for s in seqs]).to(dev)
        total = ids.numel()
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + s.token_ids.numel())
        positions = torch.cat(
            [torch.arange(s.start_pos, s.start_pos + s.token_ids.numel(), device=dev) for s in seqs]
        )
        groups = _prefix_groups(seqs, starts)
        # cos/sin are the same for every layer: compute them once per forward.
        cos, sin = self.rotary.cos_sin(positions, dt)
        chunk = min(self.chunk_size, total) if self.chunk_size > 0 else total
        bounds = [(a, min(a + chunk, total)) for a in range(0, total, chunk)]

        h = torch.empty(total, cfg.hidden_size, dtype=dt, device=dev)
        for a, b in bounds:
            torch.index_select(self.model.embed_tokens, 0, ids[a:b], out=h[a:b])
        qkv = torch.empty(total, cfg.q_size + 2 * cfg.kv_size, dtype=dt, device=dev)
        attn = torch.empty(total, cfg.q_size, dtype=dt, device=dev)
        x = torch.empty(chunk, cfg.hidden_size, dtype=dt, device=dev)
        gate_up = torch.empty(chunk, 2 * cfg.intermediate_size, dtype=dt, device=dev)
        act = torch.empty(chunk, cfg.intermediate_size, dtype=dt, device=dev)

        q_all = qkv[:, : cfg.q_size].view(total, cfg.num_heads, cfg.head_dim)
        k_all = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(total, cfg.num_kv_heads, cfg.head_dim)
        v_all = qkv[:, cfg.q_size + cfg.kv_size :].view(total, cfg.num_kv_heads, cfg.head_dim)

        for li, layer in enumerate(self.model.layers):
            for a, b in bounds:
                layer.qkv_chunk(h[a:b], x[: b - a], qkv[a:b], cos[a:b], sin[a:b])
            for s, a in zip(seqs, starts, strict=False):
                if pool is not None and s.store_slots is not None and s.store_slots.numel():
                    m = s.store_slots.numel()
                    pool.write(li, s.store_slots, k_all[a : a + m], v_all[a : a + m])
            for prefix, members in groups:
                if prefix is None:
                    for a, b in members:
                        attend(q_all[a:b], k_all[a:b], v_all[a:b], attn[a:b], self.scale)
                else:
                    assert pool is not None, "a sequence with a cached prefix needs the pool"
                    pk, pv = pool.read(li, prefix)  # once per layer for all items sharing it
                    attend_items(q_all, k_all, v_all, attn, self.scale, members, pk, pv)
            for a, b in bounds:
                layer.out_mlp_chunk(h[a:b], attn[a:b], x[: b - a], gate_up[: b - a], act[: b - a])

        rows = torch.cat([s.logit_offsets.to(dev) + a for s, a in zip(seqs, starts, strict=False)])
        return h.index_select(0, rows)


def _prefix_groups(
    seqs: list[SeqPlan], starts: list[int]
) -> list[tuple[torch.Tensor | None, list[tuple[int, int]]]]:
    """Runs of consecutive sequences that share one cached prefix (the same slots tensor), each
    with its members' row ranges; sequences without a prefix form groups of their own."""
    groups: list[tuple[torch.Tensor | None, list[tuple[int, int]]]] = []
    for s, a, b in zip(seqs, starts, starts[1:], strict=False):
        prefix = s.prefix_slots if s.start_pos else None
        if prefix is not None and groups and groups[-1][0] is prefix:
            groups[-1][1].append((a, b))
        else:
            groups.append((prefix, [(a, b)]))
    return groups


def activation_bytes(
    cfg: ModelConfig, dtype: torch.dtype, n_tokens: int, chunk_size: int, prefix_tokens: int = 0
) -> int:
    """Upper bound on what one forward over `n_tokens` packed tokens allocates beyond weights
    and the prefix pool. Mirrors the buffers above; the profile run checks it by measurement."""
    it = torch.empty((), dtype=dtype).element_size()
    chunk = min(chunk_size, n_tokens) if chunk_size > 0 else n_tokens
    q, kv = cfg.q_size, cfg.kv_size
    per_token = it * (cfg.hidden_size + q + 2 * kv + q + cfg.head_dim)  # h, qkv, attn, cos/sin
    per_token += it * 2 * q  # SDPA output of one KV-head group and its transpose copy (bound)
    per_token += 4 * 2 * q if prefix_tokens else 0  # fp32 partial outputs merged after a prefix
    # Contiguous copies of K/V stored into the pool, ids/positions/rotary angles, allocator slack:
    # measured 0.5-1 KB/token above the buffers on a 256-wide model; bound it generously.
    per_token += it * (cfg.hidden_size + 2 * kv) + 64
    scratch = it * chunk * (cfg.hidden_size + 3 * cfg.intermediate_size)
    head = LOGIT_ROWS * cfg.vocab_size * (2 * 4 + it)  # one block of logits + log-softmax
    prefix = it * 2 * prefix_tokens * kv  # one layer's prefix K/V gathered from the pool
    return per_token * n_tokens + scratch + head + prefix


# Rows of the LM head computed at once: bounds the [rows, vocab] logits of long logprob spans.
LOGIT_ROWS = 64
