"""CPU attention as tiles of GEMMs in the model dtype with an online softmax (flash-attention-2
style, written in torch ops), plus the decision of when to use it instead of SDPA.

Why: torch's CPU `scaled_dot_product_attention` only spends its FLOPs in bf16 matrix units where
oneDNN's brgemm has AMX; on AVX512-bf16 CPUs without AMX (AMD EPYC) its bf16 runs at fp32 speed
(issue 17). Here every score and every output row is one `torch.bmm` on bf16 tensors, which
oneDNN runs on whatever bf16 units the CPU has (AMX, AVX512-bf16); only the softmax is
elementwise. On an AMX Xeon SDPA's own kernel uses AMX and measured ~2.2x faster than these
tiles (1 core, 2k-4k tokens), so `choose` picks the tiles only for bf16 on CPUs with
AVX512-bf16 and no AMX; `PO_CPU_ATTENTION=tiles|sdpa` overrides the choice.

Layout, the same contract as `po_backend.attention.attend`/`attend_items`: q [n, heads, d];
k, v [n, kv_heads, d]; a cached prefix prefix_k/v [p, kv_heads, d] that every query sees;
out [n, heads * d]. Grouped-query attention stacks a KV head's g query heads as rows of ONE GEMM
(rows ordered token-major, head-minor) instead of repeating K/V.

Tiles: a block of `q_block` query tokens (g * q_block GEMM rows) against at most `kv_block`
keys at a time; the key block holding the diagonal goes first, so every row has a finite
maximum from the first block on (no NaN for fully masked rows), and blocks strictly above the
diagonal are never computed. The softmax denominator comes out of the P @ V GEMM itself, from a
column of ones appended to V: one elementwise pass fewer, and it sums exactly the rounded
probabilities the numerator used. Scores are rounded to bf16 by the GEMM (torch's CPU matmul has
no fp32 output for bf16 inputs); they are shifted by their row max before `exp`, so the error
that matters is relative to the distance from the max (see the test's tolerance).
Extra memory per call: heads-first copies of K and V (+ the ones column) and one
[kv_heads, g * q_block, kv_block] score tile, independent of the sequence length squared.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Literal

import torch

CpuAttention = Literal["tiles", "sdpa"]
_ENV = "PO_CPU_ATTENTION"
# Padding of V's last dim after the ones column: GEMM N dims that are multiples of 16 keep
# oneDNN's bf16 kernels on their full-width path (AMX tiles and AVX-512 registers are 16 wide).
_V_PAD = 16


@dataclass(frozen=True)
class TileSizes:
    """Query tokens and keys per tile. 128 x 2048 gives GEMMs large enough that Python's per-op
    cost stays small while a bf16 score tile (3 x 384 x 2048, 4.5 MiB) stays near the caches;
    on a Xeon it was as fast as any of 64-256 x 1k-4k within the (large) noise of a shared CPU."""

    q_block: int = 128
    kv_block: int = 2048

    def __post_init__(self) -> None:
        if self.q_block < 1 or self.kv_block < self.q_block:
            raise ValueError(f"need 1 <= q_block <= kv_block, got {self}")


DEFAULT_TILES = TileSizes()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. macOS)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def choose(dtype: torch.dtype, device: torch.device, flags: frozenset[str] | None = None) -> CpuAttention:
    """Which CPU attention to run: "tiles" (this module) or "sdpa" (po_backend.attention).

    Tiles only pay where bf16 GEMMs have units that SDPA leaves unused: bf16 on a CPU with
    AVX512-bf16 but no AMX (with AMX, SDPA's own kernel uses AMX and measured faster; without
    AVX512-bf16, bf16 GEMMs are emulated and the engine runs fp32 anyway). Not a CPU: SDPA.
    The environment variable PO_CPU_ATTENTION=tiles|sdpa overrides the choice (CPU only).
    """
    if device.type != "cpu":
        return "sdpa"
    forced = os.environ.get(_ENV, "auto")
    if forced in ("tiles", "sdpa"):
        return forced  # type: ignore[return-value]
    if forced != "auto":
        raise ValueError(f"{_ENV} must be auto, tiles or sdpa, got {forced!r}")
    f = cpu_flags() if flags is None else flags
    if dtype == torch.bfloat16 and "avx512_bf16" in f and "amx_bf16" not in f:
        return "tiles"
    return "sdpa"


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, kv_heads, d] -> contiguous [kv_heads, L, d]."""
    return x.permute(1, 0, 2).contiguous()


def _values_with_ones(v: torch.Tensor) -> torch.Tensor:
    """[L, kv_heads, d] -> [kv_heads, L, d + _V_PAD]: V, then a column of ones, then zeros."""
    L, kv_heads, d = v.shape
    va = torch.zeros(kv_heads, L, d + _V_PAD, dtype=v.dtype, device=v.device)
    va[..., :d].copy_(v.permute(1, 0, 2))
    va[..., d] = 1
    return va


def _grouped_queries(q: torch.Tensor, kv_heads: int, scale: float) -> torch.Tensor:
    """[n, heads, d] -> [kv_heads, n * g, d] scaled: row t * g + h is token t, query head h of
    the group. The scale is folded in here (exact for d = 64: a power of two)."""
    n, heads, d = q.shape
    g = heads // kv_heads
    qg = torch.empty(kv_heads, n, g, d, dtype=q.dtype, device=q.device)
    torch.mul(q.view(n, kv_heads, g, d).permute(1, 0, 2, 3), scale, out=qg)
    return qg.view(kv_heads, n * g, d)


@functools.cache
def _diagonal_mask(bq: int, g: int, device: torch.device) -> torch.Tensor:
    """[bq * g, bq] True where the key is after the query token (masked)."""
    return torch.ones(bq, bq, dtype=torch.bool, device=device).triu(1).repeat_interleave(g, 0)


def _attend_grouped(
    qg: torch.Tensor,
    kh: torch.Tensor,
    va: torch.Tensor,
    out: torch.Tensor,
    g: int,
    pk: torch.Tensor | None,
    pva: torch.Tensor | None,
    tiles: TileSizes,
) -> None:
    """The tile loop on heads-first inputs: qg [kvh, n*g, d], kh [kvh, n, d], va [kvh, n, d+pad],
    pk/pva the same for the prefix; writes out [n, heads * d]."""
    kvh, rows, d = qg.shape
    n = rows // g
    o4 = out.view(n, kvh, g, d)
    for i0 in range(0, n, tiles.q_block):
        i1 = min(i0 + tiles.q_block, n)
        bq = i1 - i0
        qb = qg[:, i0 * g : i1 * g]
        # (keys, values, mask) in processing order: the block ending at the diagonal first.
        blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        for hi in range(i1, 0, -tiles.kv_block):
            lo = max(0, hi - tiles.kv_block)
            blocks.append(
                (kh[:, lo:hi], va[:, lo:hi], _diagonal_mask(bq, g, qg.device) if hi == i1 else None)
            )
        if pk is not None and pva is not None:
            for lo in range(0, pk.shape[1], tiles.kv_block):
                hi = min(lo + tiles.kv_block, pk.shape[1])
                blocks.append((pk[:, lo:hi], pva[:, lo:hi], None))
        acc: torch.Tensor | None = None  # [kvh, bq*g, d+pad] fp32: sum of p*v | sum of p | 0
        m: torch.Tensor | None = None  # [kvh, bq*g, 1] fp32 running row max
        for kb, vb, mask in blocks:
            s = torch.bmm(qb, kb.transpose(1, 2))
            if mask is not None:
                s[..., s.shape[-1] - bq :].masked_fill_(mask, -math.inf)
            mb = s.amax(-1, keepdim=True)
            if m is None:
                s.sub_(mb).exp_()
                acc, m = torch.bmm(s, vb).float(), mb.float()
                continue
            assert acc is not None
            m_new = torch.maximum(m, mb.float())
            # Maxima of rounded scores are exact in the score dtype: no extra rounding here.
            s.sub_(m_new.to(s.dtype)).exp_()
            acc.mul_(torch.exp(m - m_new)).add_(torch.bmm(s, vb))
            m = m_new
        assert acc is not None
        res = acc[..., :d].div_(acc[..., d : d + 1])
        o4[i0:i1].copy_(res.view(kvh, bq, g, d).permute(1, 0, 2, 3))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    prefix_k: torch.Tensor | None = None,
    prefix_v: torch.Tensor | None = None,
    tiles: TileSizes = DEFAULT_TILES,
) -> None:
    """Causal attention of one sequence after an optional prefix, written into `out` (same
    contract as po_backend.attention.attend)."""
    n, heads, d = q.shape
    kvh = k.shape[1]
    if heads % kvh:
        raise ValueError(f"{heads} query heads are not a multiple of {kvh} KV heads")
    pk = pva = None
    if prefix_k is not None and prefix_k.shape[0] > 0:
        if prefix_v is None:
            raise ValueError("prefix_k given without prefix_v")
        pk, pva = _heads_first(prefix_k), _values_with_ones(prefix_v)
    qg = _grouped_queries(q, kvh, scale)
    _attend_grouped(qg, _heads_first(k), _values_with_ones(v), out, heads // kvh, pk, pva, tiles)


def attend_items(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    bounds: list[tuple[int, int]],
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    tiles: TileSizes = DEFAULT_TILES,
) -> None:
    """Items sharing one cached prefix (same contract as po_backend.attention.attend_items):
    item i (rows bounds[i]) attends to the whole prefix and causally to its own rows only. The
    prefix is laid out heads-first once for all items, never copied per item; each item's
    queries continue one online softmax from its own keys into the prefix's."""
    heads, kvh = q.shape[1], k.shape[1]
    if heads % kvh:
        raise ValueError(f"{heads} query heads are not a multiple of {kvh} KV heads")
    pk = pva = None
    if prefix_k.shape[0] > 0:
        pk, pva = _heads_first(prefix_k), _values_with_ones(prefix_v)
    for a, b in bounds:
        qg = _grouped_queries(q[a:b], kvh, scale)
        _attend_grouped(
            qg, _heads_first(k[a:b]), _values_with_ones(v[a:b]), out[a:b], heads // kvh, pk, pva, tiles
        )
