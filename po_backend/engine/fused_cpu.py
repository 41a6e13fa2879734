"""Fused fp32 CPU kernels for a decoder layer's memory-bound steps (`csrc/fused_fp32.cpp`): RMSNorm,
the residual add with the norm after it, the per-head q/k RMSNorm with RoPE, and SwiGLU's
silu(gate) * up, each one pass over its data and one parallel region instead of torch's five (a
norm), six (RoPE) or two (SwiGLU). The same library holds the fp32 attention kernel
(`csrc/attention_fp32.cpp`, dispatched by `po_backend.engine.attention`; `PO_CPU_ATTENTION=sdpa`
keeps torch's SDPA instead).

Only fp32 on a CPU takes them (what `--dtype auto` picks without native bf16): bf16 keeps torch's
ops, whose cast points are transformers' bf16 rules. RoPE gives transformers' fp32 bits; the norm
sums its squares in another (fixed) order than torch, so it may differ in the last bit, the same
for a row whatever its batch, chunk or thread (batch-invariant: a cache hit equals the cold run).
SwiGLU's exp is the kernel's own (a few ulps from torch's), elementwise: the same bits anywhere.

Built by `po_backend.engine.kernels` like the other CPU kernels: when a CPU fp32 runner starts, never in a
request, into the per-user cache under `ext/po_fused_fp32-<hash>/`; without a compiler, or if the
build fails, one warning and torch's ops run instead. `PO_CPU_FUSED=0` keeps torch's ops.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

from po_backend.core.cpu import cpu_flags
from po_backend.engine import kernels

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "fused_fp32.cpp"
_SOURCES = (_SOURCE, _SOURCE.with_name("attention_fp32.cpp"))
_NAME = "po_fused_fp32"
# No fused multiply-add: RoPE's products and sums round as transformers' separate ops do.
_CFLAGS = ("-O3", "-DNDEBUG", "-ffp-contract=off")
_ENV = "PO_CPU_FUSED"

# Whether the kernels are loaded in this process and wanted: the layers read it on every call.
enabled = False


def _cflags() -> tuple[str, ...]:
    """The build's flags: AVX2/FMA vectors where the CPU has them (part of the build key, so a
    library built for them is never loaded on a CPU without)."""
    f = cpu_flags()
    return (*_CFLAGS, "-mavx2", "-mfma") if {"avx2", "fma"} <= f else _CFLAGS


def build_key() -> str:
    return kernels.build_key(_SOURCES, _cflags(), ())


def _registered() -> bool:
    return hasattr(torch.ops.po_fused, "attention")


@functools.cache
def load() -> bool:
    """Build (first time) and load the kernels; False, with one warning, if that fails."""
    return kernels.load(
        _NAME,
        _SOURCES,
        _cflags(),
        (),
        kernels.build_dir(_NAME, build_key()),
        registered=_registered,
        what="the fused fp32 CPU kernels",
        fallback="fp32 CPU norms and RoPE stay on torch's ops (slower)",
        log=log,
    )


def enable(dtype: torch.dtype, device: torch.device) -> bool:
    """Load the kernels for an fp32 CPU runner (at its start: never in a request); whether they run."""
    global enabled
    if device.type == "cpu" and dtype == torch.float32 and os.environ.get(_ENV, "1") != "0" and load():
        enabled = True
    return enabled


def takes(*tensors: torch.Tensor) -> bool:
    """Whether the kernels run on these tensors: loaded, all fp32 on the CPU, last dims contiguous."""
    return enabled and all(
        t.dtype == torch.float32 and t.device.type == "cpu" and (t.dim() == 0 or t.stride(-1) == 1)
        for t in tensors
    )


def takes_attention(*tensors: torch.Tensor) -> bool:
    """Whether the fp32 attention kernel runs on these [tokens, heads, head dim] tensors: the
    kernels run on them, each token's heads are contiguous, torch's BLAS has the sgemm the kernel
    calls, and PO_CPU_ATTENTION (read at every call, for A/B runs) is not `sdpa`."""
    return (
        takes(*tensors)
        and all(t.dim() == 3 and t.stride(1) == t.shape[2] for t in tensors)
        and os.environ.get("PO_CPU_ATTENTION", "auto") != "sdpa"
        and _has_blas()
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    offset: int,
) -> None:
    """q/out [n, heads, d], k/v [m, kv_heads, d]: query i sees keys j <= i + offset (offset >= 0:
    causal after `offset` prefix keys) or every key (offset < 0); lse [n, heads] (ln of the
    softmax's denominator, as torch's flash kernel) or empty. Needs `takes_attention`."""
    torch.ops.po_fused.attention(q, k, v, out, lse, scale, offset)


@functools.cache
def _has_blas() -> bool:
    has = bool(torch.ops.po_fused.attention_has_blas())
    if not has:
        log.warning("torch's BLAS has no sgemm_: fp32 CPU attention stays on torch's SDPA")
    return has
