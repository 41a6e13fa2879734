"""Blocked int8 GEMM (Q8_0-style) on x86 CPUs: int8 activations and weights, each quantized in
blocks of `block` values along k (a multiple of 32) with one scale per block (fp32 for activations;
fp32 or fp16, Q8_0's 2 bytes, for weights: the kernel reads them widened, exactly), through a small
C++ kernel (`csrc/int8_blocked.cpp`).

Why our own kernel: the int8 mode ranks like fp32 only with activations quantized per block of
32 (docs/quantization.md); fbgemm and `torch._int_mm` take one scale per row.

Arithmetic (the kernel and `reference_blocked_matmul` agree bit for bit):

    out[m, n] = sum over blocks b, in increasing order, in fp32, of
                (xs[m, b] * ws[n, b]) * dot_b(m, n)

dot_b is the exact int32 dot product of the block's int8 values (exact in fp32 too: block <= 512).
No step depends on the other rows, so a row's output is the same in any batch (a prefix-cache hit
equals the cold run).

Instruction sets, chosen from `po_backend.core.cpu.cpu_flags()`: AVX2 (vpmaddubsw on |w| and x
carrying w's sign; where x holds -128, on |x| and w carrying x's sign, as llama.cpp), AVX-VNNI
(vpdpbusd on the same operands, 256 bits) and
AVX512-VNNI (vpdpbusd on x + 128 at 512 bits, each block's weight sum subtracted). The library is
built at first use (`load_kernel`; `po_backend.engine.kernels`: a per-user cache, once per machine);
without AVX2, without a compiler or if the build fails, one warning is logged and every call runs
`reference_blocked_matmul` (same results, far slower).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from po_backend.core.cpu import cpu_flags  # a module global: tests patch it here
from po_backend.engine import kernels

log = logging.getLogger(__name__)

Isa = Literal["avx2", "avx512_vnni", "avx_vnni"]
_ISA_CODE: dict[Isa, int] = {"avx2": 0, "avx512_vnni": 1, "avx_vnni": 2}
_SOURCE = Path(__file__).parent / "csrc" / "int8_blocked.cpp"
_TILES = (_SOURCE.with_name("int8_blocked_tile.h"), _SOURCE.with_name("int8_blocked_zmm.h"))
_NAME = "po_int8_blocked"
# No FMA contraction: the kernel's (scale * dot) then (+ out) must round twice, as torch does.
_CFLAGS = ("-O3", "-DNDEBUG", "-ffp-contract=off")
PANEL = 16  # output columns per packed weight panel
_NO_COMP = torch.empty(0, dtype=torch.int32)
_NO_SKIP = torch.empty(0, dtype=torch.int64)
MAX_BLOCK = 512  # a block's int dot product (<= 512 * 128 * 127) stays exact in fp32


def _check_block(k: int, block: int) -> None:
    if not isinstance(block, int) or block <= 0 or block % 32 or block > MAX_BLOCK:
        raise ValueError(f"block must be a positive multiple of 32 up to {MAX_BLOCK}, got {block!r}")
    if k % block:
        raise ValueError(f"k = {k} is not a multiple of the block size {block}")


def _check(t: Tensor, dtype: torch.dtype, dim: int, name: str, cpu: bool = True) -> None:
    """The kernel reads CPU tensors only; the references (`cpu=False`) run on any device."""
    if not isinstance(t, Tensor) or t.dtype != dtype or t.dim() != dim or (cpu and t.device.type != "cpu"):
        got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, Tensor) else type(t).__name__
        where = " CPU" if cpu else ""
        raise TypeError(f"{name} must be a {dim}-d {dtype}{where} tensor, got {got}")


def isa(flags: frozenset[str] | None = None) -> Isa | None:
    """The kernel variant this CPU runs, or None (no AVX2: the reference path)."""
    f = cpu_flags() if flags is None else flags
    if {"avx512f", "avx512_vnni"} <= f:
        return "avx512_vnni"
    if "avx_vnni" in f and "avx2" in f:
        return "avx_vnni"
    if {"avx2", "fma"} <= f:
        return "avx2"
    return None


def _flavour() -> tuple[str, tuple[str, ...]]:
    """The library's name and flags: the real kernel, or its build with a portable vpdpbusd."""
    if kernels.emulated():
        return f"{_NAME}_emulated", (*_CFLAGS, "-DPO_EMULATE_VNNI")
    return _NAME, _CFLAGS


def build_key() -> str:
    return kernels.build_key((_SOURCE, *_TILES), _flavour()[1], ())


def _build_dir() -> Path:
    return kernels.build_dir(_flavour()[0], build_key())


def _registered() -> bool:
    return hasattr(torch.ops.po_int8, "matmul")


@functools.cache
def load_kernel() -> bool:
    """Build (first time) and load the kernel; False, with one warning, if that fails or the CPU
    has no AVX2. A process loads it at most once (a second copy would abort the interpreter)."""
    if isa() is None:
        log.warning("the CPU has no AVX2/FMA: blocked int8 GEMMs run torch's reference (slow)")
        return False
    name, cflags = _flavour()
    return kernels.load(
        name,
        (_SOURCE,),
        cflags,
        (),
        _build_dir(),
        registered=_registered,
        what="the blocked int8 GEMM kernel",
        fallback="blocked int8 GEMMs run torch's reference (slow)",
        log=log,
    )


def kernel_available() -> bool:
    """Whether `blocked_matmul` and `quantize_blocks` run the C++ kernel (building it if needed)."""
    return load_kernel()


def _check_skip(skip: Tensor | None, k: int) -> Tensor | None:
    if skip is None or skip.numel() == 0:
        return None
    if skip.dtype != torch.int64 or skip.dim() != 1:
        raise TypeError(
            f"skip must be a 1-d int64 tensor of column indices, got {skip.dtype} {tuple(skip.shape)}"
        )
    if int(skip.min()) < 0 or int(skip.max()) >= k:
        raise ValueError(f"skip holds a column outside [0, {k})")
    return skip


def reference_quantize_blocks(x: Tensor, block: int, skip: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`quantize_blocks` in plain torch, on any device."""
    _check(x, torch.float32, 2, "x", cpu=False)
    m, k = x.shape
    _check_block(k, block)
    if (skip := _check_skip(skip, k)) is not None:
        x = x.index_fill(1, skip.to(x.device), 0)
    xb = x.reshape(m, k // block, block)
    d = xb.abs().amax(-1) / 127
    q = torch.where(d[..., None] > 0, torch.round(xb / d[..., None]), 0.0).clamp(-127, 127)
    return q.to(torch.int8).reshape(m, k), d


def quantize_blocks(x: Tensor, block: int, skip: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """x [m, k] fp32 -> (q int8 [m, k], scales fp32 [m, k // block]): per block of `block` values
    along k, symmetric: d = max |x| / 127, q = round(x / d) half to even (torch.round), d == 0
    gives q = 0. The `skip` columns (int64 indices) are read as zeros, without a copy of x.
    Non-finite x gives unspecified q."""
    _check(x, torch.float32, 2, "x")
    m, k = x.shape
    _check_block(k, block)
    skip = _check_skip(skip, k)
    if not load_kernel():
        return reference_quantize_blocks(x, block, skip)
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // block, dtype=torch.float32)
    torch.ops.po_int8.quantize(x.contiguous(), block, _NO_SKIP if skip is None else skip.contiguous(), q, d)
    return q, d


@dataclass(frozen=True)
class PackedWeights:
    """Int8 weights [n, k] and their block scales [n, k // block] in the kernel's layout: panels of
    16 output columns (the last padded with zeros), inside a panel 4 k values per column at a
    time. `unpack` gives the [n, k] / [n, k // block] tensors back (for a cache). A weight scale
    may span several activation blocks (scales [n, k // (block * span)]; span k // block: one
    scale per output channel): the kernel reads each one for its `span` blocks in place."""

    data: Tensor  # int8 [panels, k // 4, 16, 4]
    # [panels, k // block, 16], fp32 or fp16 as given to `pack_weights` (fp16: Q8_0's 2 bytes per
    # block; widened to fp32, exactly, for each call).
    scales: Tensor
    n: int
    k: int
    block: int
    # -128 x each block's weight sum, int32 [panels, k // block, 16]: the AVX512-VNNI tile's
    # correction for its x + 128 operand (packed only where that tile runs).
    comp: Tensor | None = None
    # A power of two every scale is multiplied by (fp8 scales' range; exact).
    scale_mul: float = 1.0

    def unpack(self) -> tuple[Tensor, Tensor]:
        panels = self.data.shape[0]
        wq = self.data.permute(0, 2, 1, 3).reshape(panels * PANEL, self.k)[: self.n]
        ws = self.scales.permute(0, 2, 1).reshape(panels * PANEL, self.scales.shape[1])[: self.n]
        return wq.contiguous(), ws.contiguous()

    def kernel_scales(self) -> Tensor:
        """The scales as the kernel reads them: fp32 (fp32 scales with no multiplier: this very
        tensor, no per-call copy), as many per column as packed."""
        return _per_block(self.scales, 1, 1, self.scale_mul)


SCALE_DTYPES = (torch.float32, torch.float16, torch.float8_e4m3fn)


def _check_scales(ws: Tensor, cpu: bool = True) -> None:
    """Weight scales are fp32, fp16 or fp8 (e4m3, with a power-of-two multiplier): the kernel
    reads them widened to fp32, exactly."""
    given = ws.dtype if isinstance(ws, Tensor) and ws.dtype in SCALE_DTYPES else torch.float32
    _check(ws, given, 2, "ws", cpu)


def _per_block(ws: Tensor, span: int, dim: int = -1, mul: float = 1.0) -> Tensor:
    """Weight scales (`SCALE_DTYPES`) with blocks / span entries along `dim` -> fp32 with one per
    block, times `mul` (a power of two): each repeated `span` times (a scale of `span` activation
    blocks). Exact."""
    w = ws.float() if mul == 1.0 else ws.float() * mul
    return w if span == 1 else w.repeat_interleave(span, dim=dim)


def _check_scale_shape(ws: Tensor, n: int, k: int, block: int) -> int:
    """ws must be [n, k // (block * span)] for a whole span >= 1; returns the span."""
    nb = k // block
    if ws.shape[0] != n or not 0 < ws.shape[1] <= nb or nb % ws.shape[1]:
        raise ValueError(
            f"ws must be [{n}, {nb}] (or a divisor of {nb} columns: one scale per several blocks) "
            f"for k = {k} and block {block}, got {tuple(ws.shape)}"
        )
    return nb // ws.shape[1]


def pack_weights(wq: Tensor, ws: Tensor, block: int, scale_mul: float = 1.0) -> PackedWeights:
    """Lay out int8 weights wq [n, k] (values in [-127, 127]) and scales ws [n, k // block] (fp32,
    or fp16 to hold 2 bytes per block; or [n, k // (block * span)], each scale spanning `span`
    activation blocks; fp8 e4m3 with `scale_mul`, a power of two, multiplying them all) for the
    kernel; done once at load."""
    _check(wq, torch.int8, 2, "wq")
    _check_scales(ws)
    n, k = wq.shape
    _check_block(k, block)
    _check_scale_shape(ws, n, k, block)
    if n and k and int(wq.min()) == -128:
        # x's sign is put on w by negation, and -(-128) does not exist in int8.
        raise ValueError("int8 weights must lie in [-127, 127] (symmetric quantization); got -128")
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    w = torch.nn.functional.pad(wq, (0, 0, 0, pad)) if pad else wq
    s = ws
    if pad:  # (fp8 pads through its bytes: zeros either way)
        s = ws.view(torch.uint8) if ws.dtype == torch.float8_e4m3fn else ws
        s = torch.nn.functional.pad(s, (0, 0, 0, pad)).view(ws.dtype)
    data = w.reshape(panels, PANEL, k // 4, 4).permute(0, 2, 1, 3).contiguous()
    scales = s.reshape(panels, PANEL, ws.shape[1]).permute(0, 2, 1).contiguous()
    comp = _compensation(data, block) if isa() == "avx512_vnni" else None
    return PackedWeights(data, scales, n, k, block, comp, float(scale_mul))


def _compensation(data: Tensor, block: int) -> Tensor:
    """-128 x the weights' sum per panel, block and column, from the packed layout."""
    panels, k4 = data.shape[:2]
    sums = data.view(panels, k4 * 4 // block, block // 4, PANEL, 4).sum((2, 4), dtype=torch.int32)
    return (sums * -128).contiguous()


def _weights(wq: Tensor | PackedWeights, ws: Tensor | None, block: int | None) -> PackedWeights:
    if isinstance(wq, PackedWeights):
        if block is not None and block != wq.block:
            raise ValueError(f"block {block} differs from the packed weights' block {wq.block}")
        return wq
    if ws is None or block is None:
        raise TypeError("unpacked weights need their scales ws and the block size")
    return pack_weights(wq, ws, block)


def _check_activations(xq: Tensor, xs: Tensor, w: PackedWeights) -> None:
    _check(xq, torch.int8, 2, "xq")
    _check(xs, torch.float32, 2, "xs")
    if xq.shape[1] != w.k:
        raise ValueError(f"xq has k = {xq.shape[1]}, the weights k = {w.k}")
    if xs.shape != (xq.shape[0], w.k // w.block):
        raise ValueError(f"xs must be [{xq.shape[0]}, {w.k // w.block}], got {tuple(xs.shape)}")


def _out(out: Tensor | None, m: int, n: int, device: torch.device | None = None) -> Tensor:
    if out is None:
        return torch.empty(m, n, dtype=torch.float32, device=device)
    _check(out, torch.float32, 2, "out", cpu=device is None)
    if out.shape != (m, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{m}, {n}] fp32 tensor, got {tuple(out.shape)}")
    return out


def reference_blocked_matmul(
    xq: Tensor,
    xs: Tensor,
    wq: Tensor | PackedWeights,
    ws: Tensor | None = None,
    block: int | None = None,
    *,
    out: Tensor | None = None,
    scale_mul: float = 1.0,
) -> Tensor:
    """`blocked_matmul` in plain torch (the same arithmetic: bit-equal), on any device class."""
    if isinstance(wq, PackedWeights):
        w = _weights(wq, ws, block)
        wq, ws = w.unpack()
        block, scale_mul = w.block, w.scale_mul
    _check(wq, torch.int8, 2, "wq", cpu=False)
    if ws is None or block is None:
        raise TypeError("unpacked weights need their scales ws and the block size")
    _check_scales(ws, cpu=False)
    _check(xq, torch.int8, 2, "xq", cpu=False)
    _check(xs, torch.float32, 2, "xs", cpu=False)
    m, k = xq.shape
    n = wq.shape[0]
    _check_block(k, block)
    if wq.shape[1] != k or xs.shape != (m, k // block):
        raise ValueError(
            f"shapes do not match: xq {tuple(xq.shape)}, xs {tuple(xs.shape)}, wq {tuple(wq.shape)}, "
            f"ws {tuple(ws.shape)}, block {block}"
        )
    ws = _per_block(ws, _check_scale_shape(ws, n, k, block), mul=scale_mul)
    # One block at a time (memory: one [m, n] product): a block's dot product is an fp32 matmul
    # of small integers whose partial sums stay below 2^24, so it is exact whatever the blocking.
    xf, wf = xq.float(), wq.float()
    acc = _out(out, m, n, xq.device)
    acc.zero_()
    for b in range(k // block):
        cols = slice(b * block, (b + 1) * block)
        acc.add_((xs[:, b, None] * ws[None, :, b]) * torch.matmul(xf[:, cols], wf[:, cols].t()))
    return acc


def blocked_matmul(
    xq: Tensor,
    xs: Tensor,
    wq: Tensor | PackedWeights,
    ws: Tensor | None = None,
    block: int | None = None,
    *,
    out: Tensor | None = None,
) -> Tensor:
    """xq [m, k] int8 with block scales xs [m, k // block] times weights wq [n, k] int8 with
    ws [n, k // block] (or `pack_weights`' result, packed once at load) -> fp32 [m, n], written
    into `out` if given. Bit-equal to `reference_blocked_matmul`; a row's output does not depend
    on the other rows."""
    w = _weights(wq, ws, block)
    _check_activations(xq, xs, w)
    m = xq.shape[0]
    result = _out(out, m, w.n)
    variant = isa()
    if variant is None or not load_kernel():
        return reference_blocked_matmul(xq, xs, w, out=result)
    comp = _NO_COMP
    if variant == "avx512_vnni":
        comp = w.comp if w.comp is not None else _compensation(w.data, w.block)
    torch.ops.po_int8.matmul(
        xq.contiguous(),
        xs.contiguous(),
        w.data,
        w.kernel_scales(),
        comp,
        w.n,
        w.block,
        _ISA_CODE[variant],
        result,
    )
    return result
