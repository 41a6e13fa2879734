"""The model runners: one prefill-only forward over a packed batch of sequences.

`HybridRunner` is hybrid prefilling (ours): every token-wise op (embedding, norms, QKV/O
projections, MLP, residual adds) runs over the packed tokens in chunks, writing into buffers
allocated once per forward; attention runs per sequence over all of its tokens at once. A layer's
K/V live in one buffer that the next layer overwrites (last-layer-only KV); only tokens the caller
asks to cache are copied into the prefix pool. The LM head runs only on the rows whose next-token
distribution is wanted (the engine does that, on the hidden states returned here).

`ChunkedRunner` is the baseline the paper compares against (Sarathi-style chunked prefill, as in
vLLM): each sequence runs chunk by chunk through ALL layers, attention included, each chunk
attending to the K/V of every earlier chunk. Its activations per chunk are small, but the K/V of
every layer for the whole context must stay resident until the last chunk: that is the memory
hybrid prefilling avoids.

Both have the same `forward(seqs, pool)` and state their own activation bound; `make_runner`
picks one from `EngineConfig.prefill_mode`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from po_backend.engine import attention_cpu, fused_cpu
from po_backend.engine.activations import activation_bytes, chunked_activation_bytes
from po_backend.engine.attention import attend, attend_items
from po_backend.engine.cache.kv_pool import KVPool
from po_backend.engine.config import PREFILL_MODES, PrefillMode, ResidualDtype, resolve_residual
from po_backend.engine.models.int8 import is_quantized
from po_backend.engine.models.layers import Rotary
from po_backend.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SeqPlan:
    """One sequence of a packed forward."""

    token_ids: torch.Tensor  # [n] int64: the tokens to compute (the part not in the prefix cache)
    logit_offsets: torch.Tensor  # int64 offsets into token_ids whose next-token logits are wanted
    start_pos: int = 0  # position of token_ids[0] = number of cached prefix tokens before it
    prefix_slots: torch.Tensor | None = None  # pool slots holding the cached prefix (len start_pos)
    store_slots: torch.Tensor | None = None  # pool slots that receive K/V of token_ids[:len(slots)]
    # Sequences of one forward with the same group read the same cached prefix (same slots), so
    # the runner reads its K/V once for all of them; the caller places a group's members next to
    # each other. None: the prefix (if any) is this sequence's alone. HybridRunner only: the
    # prefix slots may be another sequence's store_slots in the SAME forward (every layer's
    # store_slots are written before that layer's attention), so a shared prefix and its items
    # can run as one forward; ChunkedRunner reads prefixes before computing anything.
    prefix_group: int | None = None
    # HybridRunner, a sequence without a cached prefix only: its first `own_prefix` tokens are a
    # prefix the rest reads as a later request reads them from the cache (`attend_items` over
    # them, not one causal call over all), so a cold run and a cache hit of a declared prefix
    # compute the same arithmetic: in bf16 even the last-bit differences of a different
    # attention split would grow through the layers into different scores.
    own_prefix: int = 0

    def __post_init__(self) -> None:
        assert self.token_ids.numel() > 0, "a sequence needs at least one token to compute"
        n_prefix = 0 if self.prefix_slots is None else self.prefix_slots.numel()
        assert n_prefix == self.start_pos, f"prefix slots ({n_prefix}) != start_pos ({self.start_pos})"
        assert self.prefix_group is None or self.start_pos > 0, "a prefix group needs a cached prefix"
        if self.store_slots is not None:
            assert self.store_slots.numel() <= self.token_ids.numel(), "more store slots than tokens"
        assert 0 <= self.own_prefix < self.token_ids.numel(), "own_prefix leaves no token after it"
        assert not (self.own_prefix and self.start_pos), (
            "own_prefix is for a sequence without a cached prefix"
        )


class Runner(ABC):
    """What the engine needs of a runner: a forward over packed sequences and the bound on what
    that forward allocates (it sizes the prefix pool from the rest of the memory budget)."""

    prefill_mode: ClassVar[PrefillMode]

    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        chunk_size: int,
        residual_dtype: ResidualDtype = "fp32",
    ) -> None:
        self.model = model
        self.cfg = model.cfg
        self.device = device
        self.dtype = model.embed_tokens.dtype
        self.resid_dtype = resolve_residual(self.dtype, residual_dtype)
        # Decided (and the bf16 CPU kernel built or loaded) here, at start-up, never in a request.
        self.attention = attention_cpu.decide(self.dtype, device, self.cfg.head_dim)
        self.attn_dtype = _attention_dtype(self.dtype, self.resid_dtype, device, self.attention)
        # The fused fp32 norm/RoPE kernels, built or loaded here too (fp32 CPU only).
        fused_cpu.enable(self.dtype, device)
        # Items over a shared prefix get the bits they would alone (`attend_items`' per_item)
        # where those bits matter: under bf16/fp16 weights or int8 projections on a CPU (a GPU is
        # launch-bound); int8's per-token rounding would turn last-bit differences into steps.
        self.items_alone = (self.dtype != torch.float32 or is_quantized(model)) and device.type == "cpu"
        log.info(
            "attention: %s in %s (%s); residual stream in %s",
            "the bf16 CPU kernel" if self.attention.attention == "kernel" else "torch SDPA",
            _name(self.attn_dtype),
            self.attention.reason,
            _name(self.resid_dtype),
        )
        self.chunk_size = chunk_size
        cfg = self.cfg
        # One Rotary per distinct RoPE (Gemma 3: the sliding layers' base differs), and each
        # layer's index into them; cos/sin are computed once per forward (or chunk) per RoPE.
        ropes = [cfg.layer_rope(li) for li in range(cfg.num_layers)]
        distinct = list(dict.fromkeys(ropes))
        self.rotaries = [Rotary(r.inv_freq(cfg.head_dim), device, r.attention_factor) for r in distinct]
        self.layer_rotary = [distinct.index(r) for r in ropes]
        self.scale = cfg.scale
        self.windows = [cfg.layer_window(li) for li in range(cfg.num_layers)]
        self.softcap = cfg.attn_softcap

    def describe(self) -> str:
        """What decides this runner's memory besides the model: mode, chunk, dtypes, attention."""
        return (
            f"{self.prefill_mode} chunk {self.chunk_size} attention {self.attention.attention} "
            f"in {_name(self.attn_dtype)}, residual {_name(self.resid_dtype)}"
        )

    def cos_sin(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [r.cos_sin(positions, self.dtype) for r in self.rotaries]

    @abstractmethod
    def forward(self, seqs: list[SeqPlan], pool: KVPool | None = None) -> torch.Tensor:
        """Final hidden states [m, hidden] at every seq's logit_offsets, concatenated in order."""

    @abstractmethod
    def activation_bound(self, n_tokens: int, prefix_tokens: int = 0) -> int:
        """Upper bound on what one forward over `n_tokens` packed tokens after up to
        `prefix_tokens` of cached prefix allocates beyond weights and the prefix pool."""


class HybridRunner(Runner):
    """Hybrid prefilling (see the module doc)."""

    prefill_mode: ClassVar[PrefillMode] = "hybrid"

    def activation_bound(self, n_tokens: int, prefix_tokens: int = 0) -> int:
        return activation_bytes(
            self.cfg,
            self.dtype,
            n_tokens,
            self.chunk_size,
            prefix_tokens,
            self.device,
            self.resid_dtype,
            self.attn_dtype,
        )

    @torch.inference_mode()
    def forward(self, seqs: list[SeqPlan], pool: KVPool | None = None) -> torch.Tensor:
        cfg, dev, dt = self.cfg, self.device, self.dtype
        ids, starts, positions = _pack(seqs, dev)
        total = ids.numel()
        # Slot ids live on the CPU (the pool's free list); moved to the device once per forward,
        # not once per layer, so a GPU forward issues no host-to-device copy inside the layers.
        groups = [(p if p is None else p.to(dev), m) for p, m in _prefix_groups(seqs, starts)]
        own_prefix = {a: s.own_prefix for s, a in zip(seqs, starts, strict=False) if s.own_prefix}
        stores = [
            (s.store_slots.to(dev), a)
            for s, a in zip(seqs, starts, strict=False)
            if pool is not None and s.store_slots is not None and s.store_slots.numel()
        ]
        # cos/sin are the same for every layer of one RoPE: compute them once per forward.
        rope = self.cos_sin(positions)
        chunk = min(self.chunk_size, total) if self.chunk_size > 0 else total
        bounds = [(a, min(a + chunk, total)) for a in range(0, total, chunk)]

        # The residual stream (h) may be wider than the weights (see `resolve_residual`): the
        # norms read it in fp32 and each sublayer's output is added to it without rounding h.
        h = torch.empty(total, cfg.hidden_size, dtype=self.resid_dtype, device=dev)
        for a, b in bounds:
            self.model.embed(ids[a:b], h[a:b])
        qkv = torch.empty(total, cfg.q_size + 2 * cfg.kv_size, dtype=dt, device=dev)
        attn = torch.empty(total, cfg.q_size, dtype=dt, device=dev)
        x = torch.empty(chunk, cfg.hidden_size, dtype=dt, device=dev)
        gate_up = torch.empty(chunk, 2 * cfg.intermediate_size, dtype=dt, device=dev)
        act = torch.empty(chunk, cfg.intermediate_size, dtype=dt, device=dev)

        k_all = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(total, cfg.num_kv_heads, cfg.head_dim)
        v_all = qkv[:, cfg.q_size + cfg.kv_size :].view(total, cfg.num_kv_heads, cfg.head_dim)
        # Attention reads and writes `qkv_a` / `attn_a`: the bf16 buffers themselves, or their
        # fp32 copies where attention runs in fp32 (`_attention_dtype`).
        wide = self.attn_dtype != dt
        qkv_a = torch.empty(qkv.shape, dtype=self.attn_dtype, device=dev) if wide else qkv
        attn_a = torch.empty(attn.shape, dtype=self.attn_dtype, device=dev) if wide else attn
        qa = qkv_a[:, : cfg.q_size].view(total, cfg.num_heads, cfg.head_dim)
        ka = qkv_a[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(total, cfg.num_kv_heads, cfg.head_dim)
        va = qkv_a[:, cfg.q_size + cfg.kv_size :].view(total, cfg.num_kv_heads, cfg.head_dim)

        for li, layer in enumerate(self.model.decoder_layers):
            cos, sin = rope[self.layer_rotary[li]]
            window, softcap = self.windows[li], self.softcap
            for a, b in bounds:
                layer.qkv_chunk(h[a:b], x[: b - a], qkv[a:b], cos[a:b], sin[a:b])
            for slots, a in stores:
                assert pool is not None, "store slots need the pool"
                m = slots.numel()
                pool.write(li, slots, k_all[a : a + m], v_all[a : a + m])
            if wide:
                qkv_a.copy_(qkv)
            for prefix, members in groups:
                # (prefix K, prefix V, item rows) that read them, through attend_items
                reads: list[tuple[torch.Tensor, torch.Tensor, list[tuple[int, int]]]] = []
                if prefix is None:  # one sequence: a group of its own
                    for a, b in members:
                        # rows [mid, b) read [a, mid) as a prefix (all of [a, b) is one causal call)
                        mid = a + own_prefix[a] if a in own_prefix else b
                        attend(
                            qa[a:mid],
                            ka[a:mid],
                            va[a:mid],
                            attn_a[a:mid],
                            self.scale,
                            window=window,
                            softcap=softcap,
                        )
                        if mid < b:  # contiguous, as the pool's K/V a cache hit reads
                            reads.append((ka[a:mid].contiguous(), va[a:mid].contiguous(), [(mid, b)]))
                else:
                    assert pool is not None, "a sequence with a cached prefix needs the pool"
                    pk, pv = pool.read(li, prefix)  # once per layer for all items sharing it
                    reads.append((pk.to(self.attn_dtype), pv.to(self.attn_dtype), members))
                for pk, pv, items in reads:
                    attend_items(
                        qa,
                        ka,
                        va,
                        attn_a,
                        self.scale,
                        items,
                        pk,
                        pv,
                        window=window,
                        softcap=softcap,
                        per_item=self.items_alone,
                    )
            if wide:
                attn.copy_(attn_a)
            for a, b in bounds:
                layer.out_mlp_chunk(h[a:b], attn[a:b], x[: b - a], gate_up[: b - a], act[: b - a])

        rows = torch.cat([s.logit_offsets.to(dev) + a for s, a in zip(seqs, starts, strict=False)])
        return h.index_select(0, rows)


class ChunkedRunner(Runner):
    """Sarathi-style chunked prefill (the baseline, see the module doc). Like vLLM, a chunk is a
    budget of `chunk_size` packed tokens that may span several sequences; every op of every
    layer, attention included, runs on one chunk before the next starts."""

    prefill_mode: ClassVar[PrefillMode] = "chunked"

    def activation_bound(self, n_tokens: int, prefix_tokens: int = 0) -> int:
        return chunked_activation_bytes(
            self.cfg, self.dtype, n_tokens, self.chunk_size, prefix_tokens, self.resid_dtype, self.attn_dtype
        )

    @torch.inference_mode()
    def forward(self, seqs: list[SeqPlan], pool: KVPool | None = None) -> torch.Tensor:
        cfg, dev, dt = self.cfg, self.device, self.dtype
        ids, starts, positions = _pack(seqs, dev)
        total = ids.numel()
        chunk = min(self.chunk_size, total) if self.chunk_size > 0 else total
        kv_shape = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
        # A later chunk attends to every earlier token of its sequence, so each sequence keeps the
        # K/V of EVERY layer until its last chunk. A cached prefix shared by several items (one
        # prefix group) is gathered from the pool once (vLLM's paged blocks are shared the same way).
        prefix_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        seq_prefix: list[int | None] = []  # each sequence's key into prefix_kv
        for i, s in enumerate(seqs):
            if not s.start_pos:
                seq_prefix.append(None)
                continue
            key = s.prefix_group if s.prefix_group is not None else -1 - i  # ungrouped: its own
            seq_prefix.append(key)
            if key not in prefix_kv:
                assert pool is not None and s.prefix_slots is not None, "a cached prefix needs the pool"
                k_p = torch.empty(kv_shape[0], s.start_pos, *kv_shape[1:], dtype=dt, device=dev)
                v_p = torch.empty_like(k_p)
                for li in range(cfg.num_layers):
                    k_p[li], v_p[li] = pool.read(li, s.prefix_slots)
                prefix_kv[key] = (k_p, v_p)
        own = [
            torch.empty(2, kv_shape[0], s.token_ids.numel(), *kv_shape[1:], dtype=dt, device=dev)
            for s in seqs
        ]
        h = torch.empty(chunk, cfg.hidden_size, dtype=self.resid_dtype, device=dev)
        qkv = torch.empty(chunk, cfg.q_size + 2 * cfg.kv_size, dtype=dt, device=dev)
        attn = torch.empty(chunk, cfg.q_size, dtype=dt, device=dev)
        x = torch.empty(chunk, cfg.hidden_size, dtype=dt, device=dev)
        gate_up = torch.empty(chunk, 2 * cfg.intermediate_size, dtype=dt, device=dev)
        act = torch.empty(chunk, cfg.intermediate_size, dtype=dt, device=dev)
        # Which output rows each chunk fills, found on the CPU: a boolean mask over device tensors
        # would read its count back from the device (a sync per chunk on a GPU).
        rows = torch.cat([s.logit_offsets + a for s, a in zip(seqs, starts, strict=False)])
        out = torch.empty(rows.numel(), cfg.hidden_size, dtype=self.resid_dtype, device=dev)

        for a in range(0, total, chunk):
            b = min(a + chunk, total)
            c = b - a
            # (sequence, its first and last+1 local offsets in this chunk, row of the first in the chunk)
            parts = [
                (i, max(a, s0) - s0, min(b, s1) - s0, max(a, s0) - a)
                for i, (s0, s1) in enumerate(zip(starts, starts[1:], strict=False))
                if s0 < b and s1 > a
            ]
            rope = self.cos_sin(positions[a:b])
            self.model.embed(ids[a:b], h[:c])
            q = qkv[:c, : cfg.q_size].view(c, cfg.num_heads, cfg.head_dim)
            k = qkv[:c, cfg.q_size : cfg.q_size + cfg.kv_size].view(c, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:c, cfg.q_size + cfg.kv_size :].view(c, cfg.num_kv_heads, cfg.head_dim)
            for li, layer in enumerate(self.model.decoder_layers):
                cos, sin = rope[self.layer_rotary[li]]
                layer.qkv_chunk(h[:c], x[:c], qkv[:c], cos, sin)
                for i, lo, hi, r in parts:
                    k_own, v_own = own[i][0, li], own[i][1, li]
                    m = hi - lo
                    k_own[lo:hi], v_own[lo:hi] = k[r : r + m], v[r : r + m]
                    ctx_k, ctx_v = k_own[:lo], v_own[:lo]  # this sequence's earlier chunks
                    pkey = seq_prefix[i]
                    if pkey is not None:
                        k_p, v_p = prefix_kv[pkey]
                        ctx_k, ctx_v = torch.cat([k_p[li], ctx_k]), torch.cat([v_p[li], ctx_v])
                    ad = self.attn_dtype  # fp32 attention (`_attention_dtype`): copies of this part
                    o = attn[r : r + m] if ad == dt else torch.empty(m, cfg.q_size, dtype=ad, device=dev)
                    attend(
                        q[r : r + m].to(ad),
                        k_own[lo:hi].to(ad),
                        v_own[lo:hi].to(ad),
                        o,
                        self.scale,
                        ctx_k.to(ad),
                        ctx_v.to(ad),
                        window=self.windows[li],
                        softcap=self.softcap,
                    )
                    if ad != dt:
                        attn[r : r + m] = o
                layer.out_mlp_chunk(h[:c], attn[:c], x[:c], gate_up[:c], act[:c])
            here = ((rows >= a) & (rows < b)).nonzero().squeeze(1)
            if here.numel():
                out.index_copy_(0, here.to(dev), h.index_select(0, (rows[here] - a).to(dev)))

        for s, kv in zip(seqs, own, strict=True):
            if pool is not None and s.store_slots is not None and s.store_slots.numel():
                m = s.store_slots.numel()
                for li in range(cfg.num_layers):
                    pool.write(li, s.store_slots, kv[0, li, :m], kv[1, li, :m])
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _attention_dtype(
    dtype: torch.dtype, resid_dtype: torch.dtype, device: torch.device, choice: attention_cpu.Choice
) -> torch.dtype:
    """Where the residual stream is fp32 under bf16/fp16 weights, attention's softmax and sums
    run in fp32 too on a CPU that runs them on SDPA: SDPA rounds its probabilities to bf16 in
    blocks that depend on how the keys are split, so a cached prefix (prefix and own keys
    merged) and a cold run (one causal call) would round differently and disagree by more than
    the residual saves. Not where the bf16 CPU kernel runs (its scores stay fp32; it is the fast
    path there) and not on CUDA (fused bf16 attention kernels)."""
    if resid_dtype == dtype or device.type != "cpu":
        return dtype
    return dtype if choice.attention == "kernel" else torch.float32


_RUNNERS: dict[str, type[Runner]] = {r.prefill_mode: r for r in (HybridRunner, ChunkedRunner)}


def make_runner(
    model: LlamaForCausalLM,
    device: torch.device,
    chunk_size: int,
    prefill_mode: PrefillMode = "hybrid",
    residual_dtype: ResidualDtype = "fp32",
) -> Runner:
    """The runner for `prefill_mode` ("hybrid": ours; "chunked": the Sarathi-style baseline)."""
    if prefill_mode not in _RUNNERS:
        raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {prefill_mode!r}")
    return _RUNNERS[prefill_mode](model, device, chunk_size, residual_dtype)


def _prefix_groups(
    seqs: list[SeqPlan], starts: list[int]
) -> list[tuple[torch.Tensor | None, list[tuple[int, int]]]]:
    """Runs of consecutive sequences in one prefix group (reading one cached prefix), each with
    its slots and its members' row ranges; a sequence without a group forms a group of its own."""
    groups: list[tuple[torch.Tensor | None, list[tuple[int, int]]]] = []
    last: int | None = None  # prefix group of the previous sequence
    for s, a, b in zip(seqs, starts, starts[1:], strict=False):
        prefix = s.prefix_slots if s.start_pos else None
        if s.prefix_group is not None and s.prefix_group == last:
            groups[-1][1].append((a, b))
        else:
            groups.append((prefix, [(a, b)]))
        last = s.prefix_group
    return groups


def _pack(seqs: list[SeqPlan], dev: torch.device) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """The sequences' tokens packed end to end: ids, each one's start row (plus the total at the
    end), and every token's absolute position (a cached prefix shifts where a sequence starts)."""
    ids = torch.cat([s.token_ids for s in seqs]).to(dev)
    starts = [0]
    for s in seqs:
        starts.append(starts[-1] + s.token_ids.numel())
    positions = torch.cat(
        [torch.arange(s.start_pos, s.start_pos + s.token_ids.numel(), device=dev) for s in seqs]
    )
    return ids, starts, positions
