"""CPU attention in bf16 on the AVX512-BF16 dot-product units, through a small C++ kernel
(`csrc/attention_bf16.cpp`) built when an engine that uses it starts, and the decision of when to
use it.

Why: torch's CPU `scaled_dot_product_attention` spends its bf16 FLOPs in matrix units only where
oneDNN has AMX; on AVX512-BF16 CPUs without AMX (AMD EPYC) its bf16 runs at fp32 speed, and
attention is most of a long prefill. An earlier version of this module ran tiles of torch bf16
GEMMs with an fp32 online softmax: faster than SDPA there, but still far from the GEMM peak (Python per-op
cost, scores rounded to bf16 by the GEMM, elementwise passes over the score tiles). The kernel
keeps the scores in fp32 registers between the two dot-product passes.

Build: `torch.utils.cpp_extension.load` compiles the kernel into a per-user cache
(`$PREFILLONLY_CACHE` or `~/.cache/prefillonly`, under `ext/po_attention_bf16-<hash>/`, the hash
of the source, the compiler and its flags and torch's version) when an engine that will use it
starts (`decide`), never inside a request; later processes load the cached library. Builds of
one folder take turns under an OS file lock (`fcntl.flock`, released when its holder dies; the
wait is bounded by $PO_KERNEL_LOCK_TIMEOUT seconds). A cache folder owned by another user or
writable by others is refused: the library loaded from it could be theirs. No install step
compiles anything: without a compiler, or if the build fails, one warning is logged and
attention stays on SDPA (`po_backend.engine.attention`).

Used for: bf16 on a CPU with avx512_bf16 and no AMX (with AMX, SDPA's own kernel uses AMX), head
dims that are multiples of 64. Everything else (fp32, AVX2-only CPUs, fp16, other devices)
keeps SDPA. `PO_CPU_ATTENTION=kernel|sdpa` overrides the choice (`kernel` still needs the CPU
and the build).

Contract (as `po_backend.engine.attention`): q [n, heads, d]; k, v [n, kv_heads, d] (the sequence's own
tokens, causal); a prefix prefix_k/v [p, kv_heads, d] that every query sees; strided views are
read in place (the runner's q/k/v are views of one packed buffer).
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from po_backend.core.cpu import cpu_flags  # a module global: tests patch it here
from po_backend.engine import kernels

log = logging.getLogger(__name__)

CpuAttention = Literal["kernel", "sdpa"]
_ENV = "PO_CPU_ATTENTION"
_SOURCE = Path(__file__).parent / "csrc" / "attention_bf16.cpp"
_EMULATION = _SOURCE.with_name("avx512_emulation.h")
_NAME = "po_attention_bf16"
_CFLAGS = ("-O3", "-DNDEBUG")
HEAD_DIM_MULTIPLE = 64  # the kernel's P@V step writes 64 output dims per pass
_EMPTY_I32 = torch.empty(0, dtype=torch.int32)  # no item starts: plain causal
_NO_LSE = torch.empty(0, 0)  # the kernel's log-sum-exp output, when none is wanted


def choose(dtype: torch.dtype, device: torch.device, flags: frozenset[str] | None = None) -> CpuAttention:
    """Which attention the CPU runs for `dtype`: "kernel" (this module, if it builds) or "sdpa".

    The kernel only pays where bf16 dot-product units exist that SDPA leaves unused: bf16 on a CPU
    with AVX512-BF16 and no AMX. PO_CPU_ATTENTION=kernel|sdpa overrides (CPU, bf16 only: the
    kernel has no other dtype; `sdpa` also keeps fp32 off `fused_cpu`'s attention kernel)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "sdpa"
    forced = os.environ.get(_ENV, "auto")
    if forced not in ("auto", "kernel", "sdpa"):
        raise ValueError(f"{_ENV} must be auto, kernel or sdpa, got {forced!r}")
    f = cpu_flags() if flags is None else flags
    if "avx512_bf16" not in f:
        return "sdpa"  # the kernel's instructions do not exist here, whatever the override says
    if forced != "auto":
        return forced  # type: ignore[return-value]
    return "sdpa" if "amx_bf16" in f else "kernel"


@dataclass(frozen=True)
class Choice:
    """Which attention a CPU engine runs for its dtype and head dim, and why (the start-up log)."""

    attention: CpuAttention
    reason: str


def decide(
    dtype: torch.dtype, device: torch.device, head_dim: int, flags: frozenset[str] | None = None
) -> Choice:
    """`choose`, for a model's head dim, with the kernel built (or loaded) if it is chosen: the
    engine calls this once at start-up, so no request ever waits for a build."""
    f = cpu_flags() if flags is None else flags
    if device.type != "cpu":
        return Choice("sdpa", f"{device.type}: torch's fused attention")
    if dtype != torch.bfloat16:
        return Choice("sdpa", f"{str(dtype).removeprefix('torch.')}: the kernel is bf16-only")
    if choose(dtype, device, f) == "sdpa":
        if "avx512_bf16" not in f:
            return Choice("sdpa", "the CPU has no avx512_bf16 (bf16 is emulated: prefer fp32 here)")
        if os.environ.get(_ENV, "auto") == "sdpa":
            return Choice("sdpa", f"{_ENV}=sdpa")
        return Choice("sdpa", "AMX: SDPA's own bf16 kernel runs on the AMX tiles")
    if head_dim % HEAD_DIM_MULTIPLE:
        log.warning(
            "head dim %d is not a multiple of %d (the kernel's tile width): bf16 attention falls back to SDPA",
            head_dim,
            HEAD_DIM_MULTIPLE,
        )
        return Choice("sdpa", f"head dim {head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}")
    if not load_kernel():
        return Choice("sdpa", "the kernel could not be built or loaded (see the warning above)")
    why = f"{_ENV}=kernel" if os.environ.get(_ENV, "auto") == "kernel" else "AVX512-BF16 without AMX"
    return Choice("kernel", why)


def _flavour() -> tuple[str, tuple[str, ...]]:
    """The library's name and compiler flags: the real kernel, or its emulated build."""
    if kernels.emulated():
        return f"{_NAME}_emulated", (*_CFLAGS, "-DPO_EMULATE_AVX512")
    return _NAME, _CFLAGS


def build_key() -> str:
    """What the library depends on (`kernels.build_key`): this kernel's sources and flags."""
    return kernels.build_key((_SOURCE, _EMULATION), _flavour()[1], ())


def _build_dir() -> Path:
    return kernels.build_dir(_flavour()[0], build_key())


def _registered() -> bool:
    """Whether this process already has the kernel's operators."""
    return hasattr(torch.ops.po_attn, "fwd")


@functools.cache
def load_kernel() -> bool:
    """Build (first time) and load the kernel; False, with one warning, if that fails. A process
    loads it at most once: a second copy (another build folder) registering the same operators
    aborts the interpreter."""
    name, cflags = _flavour()
    return kernels.load(
        name,
        (_SOURCE,),
        cflags,
        (),
        _build_dir(),
        registered=_registered,
        what="the bf16 CPU attention kernel",
        fallback="attention stays on torch SDPA (slower)",
        log=log,
    )


@functools.cache
def _note_head_dim(d: int) -> None:
    log.info("bf16 CPU attention kernel: head dim %d is not a multiple of 64; attention runs on SDPA", d)


def supported(q: Tensor, *kv: Tensor | None) -> bool:
    """Whether the kernel can take these queries and keys/values (device, dtype, head dim) and is
    built; where it would run but for the head dim, the reason is logged once. K/V in another
    dtype than q (the kernel reads bf16 only) fall back."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or choose(q.dtype, q.device) != "kernel":
        return False
    if any(t is not None and t.dtype != torch.bfloat16 for t in kv):
        return False
    if q.shape[-1] % HEAD_DIM_MULTIPLE:
        _note_head_dim(q.shape[-1])
        return False
    return load_kernel()


def _empty_kv(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, like.shape[1], like.shape[2])


def attend(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float, prefix: tuple[Tensor, Tensor] | None = None
) -> None:
    """Causal attention of one sequence after an optional prefix (its K, V), into out [n, heads * d]."""
    n, heads, d = q.shape
    if n == 0:
        return
    pk, pv = prefix if prefix is not None and prefix[0].shape[0] else (_empty_kv(k), _empty_kv(k))
    torch.ops.po_attn.fwd(q, pk, pv, k, v, _EMPTY_I32, out.view(n, heads, d), _NO_LSE, scale, False)


def attend_items(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    scale: float,
    bounds: list[tuple[int, int]],
    prefix: tuple[Tensor, Tensor],
) -> None:
    """Items sharing one cached prefix: item i (rows bounds[i]) attends to the whole prefix and
    causally to its own rows only. One kernel call per run of adjacent items (the runner's items
    are one run): each query's online softmax runs on from the prefix into its own item's keys,
    so there are no partial outputs to merge, and the prefix is packed once per call."""
    n, heads, d = q.shape
    prefix_k, prefix_v = prefix if prefix[0].shape[0] else (_empty_kv(k), _empty_kv(k))
    o3 = out.view(n, heads, d)
    run: list[tuple[int, int]] = []
    for a, b in [*bounds, (-1, -1)]:
        if run and a != run[-1][1]:  # flush a run of adjacent items
            lo, hi = run[0][0], run[-1][1]
            starts = torch.repeat_interleave(
                torch.tensor([x - lo for x, _ in run], dtype=torch.int32),
                torch.tensor([y - x for x, y in run]),
            )
            torch.ops.po_attn.fwd(
                q[lo:hi], prefix_k, prefix_v, k[lo:hi], v[lo:hi], starts, o3[lo:hi], _NO_LSE, scale, False
            )
            run = []
        if a < 0:
            break
        if not 0 <= a < b <= n:
            raise ValueError(f"item bounds must be non-empty ranges of the {n} rows, got {(a, b)}")
        run.append((a, b))


def lse_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A partial attention with its log-sum-exp (`po_backend.engine.attention.LseAttention`): out
    [n, heads, d] fp32 and lse [n, heads] fp32. Causal: k/v are the queries' own tokens."""
    n, heads, d = q.shape
    out = torch.empty(n, heads, d, dtype=torch.float32)
    lse = torch.empty(n, heads, dtype=torch.float32)
    if n == 0:
        return out, lse
    empty = _empty_kv(k)
    if causal:
        torch.ops.po_attn.fwd(q, empty, empty, k, v, _EMPTY_I32, out, lse, scale, True)
    elif k.shape[0] == 0:
        out.zero_()
        lse.fill_(-torch.inf)
    else:
        torch.ops.po_attn.fwd(q, k, v, empty, empty, _EMPTY_I32, out, lse, scale, True)
    return out, lse
