"""Int8 linear layers: W8A8 dynamic quantization (SGLang's `--quantization w8a8_int8`).

Weights are quantized once at load, symmetric int8 per output channel with fp32 scales; each
activation row (token) is quantized right before its matmul, symmetric int8 with its own fp32
scale; the product accumulates in int32 and is dequantized by row scale x channel scale into the
caller's buffer (the model dtype, then the fp32 residual stream). Norms, attention, embeddings and
the LM head never pass through here: they stay in the model dtype.

`gemm_backend` picks the GEMM from the CPU's flags: `torch._int_mm` (oneDNN: AVX512-VNNI,
AVX-VNNI, AMX tiles), fbgemm's dynamic linear on AVX2-only CPUs (8-bit activations per token,
weights within +-63), or the reference path (the same integer products summed exactly in fp64).
A recipe with `block` (the default: 32, llama.cpp's Q8_0) quantizes both operands in blocks along
the input instead, one scale per row and block, and runs `blocked_matmul` on every CPU class.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

import torch
from torch import nn

from po_backend.core.cpu import cpu_flags
from po_backend.engine.int8_kernel import (
    PackedWeights,
    blocked_matmul,
    pack_weights,
    quantize_blocks,
    reference_blocked_matmul,
    reference_quantize_blocks,
)

# The modes `--quantization` accepts (core.choices.QUANTIZATIONS holds the same names, torch-free).
W8A8_INT8 = "w8a8_int8"
# Int8 weights per output channel, each activation block as two int8 parts (`TWO_PASS_RECIPE`).
W8A8X2_INT8 = "w8a8x2_int8"
QMAX = 127.0
OUTLIER_BLOCK = 32  # int8 outlier weights: Q8_0 blocks along the output channels
# fbgemm's AVX2 kernel adds pairs of u8 x s8 products in int16 with saturation (`vpmaddubsw`):
# full 8-bit activations (up to 255) times weights within +-63 can never saturate (2*255*63 <
# 2^15), so on that backend the weights get one bit less rather than the activations (torch's
# `reduce_range` would halve the activations' steps, which carry the outliers).
FBGEMM_WMAX = 63.0

GemmBackend = Literal["int_mm", "fbgemm", "reference"]

# The decoder layers' projections that the int8 mode quantizes (their attribute names).
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class Int8Recipe:
    """How the int8 mode meets activations' outlier channels, per projection (in the order of
    `QUANTIZED_PROJECTIONS`), from per-input-channel activation maxima of a calibration forward.

    `alpha`: SmoothQuant's migration strength (None: not smoothed): input channel j is divided by
    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha) where the layer computes it for free (the RMSNorm
    weight before qkv and gate/up, the v rows before o_proj, the up rows before down_proj) and W's
    column j is multiplied by it, so the float model is unchanged and the int8 one sees flatter rows.
    `outliers`: that many input channels with the largest calibration maxima (after smoothing) are
    taken out of the int8 GEMM and multiplied in the model dtype (LLM.int8()'s decomposition)."""

    alpha: tuple[float | None, float | None, float | None, float | None] = (None, None, None, None)
    outliers: tuple[int, int, int, int] = (0, 0, 0, 0)
    # Scales per block of this many input channels, for weights (per output channel) and
    # activations (per token) alike, as llama.cpp's Q8_0 (32); None: one scale per output channel
    # and one per token.
    block: int | None = None
    # 2: each activation block is an int8 value plus the int8 value of what it missed (about 15
    # bits, two int8 GEMMs on the same weights); blocked recipes only.
    activation_passes: int = 1
    # Projections left in the model dtype (neither smoothed nor quantized): "down_proj" in every
    # layer, "down_proj@27" in layer 27 only (`parse_float_projections` reads "down_proj@27-29").
    float_projections: tuple[str, ...] = ()
    # Weight scales per this many input channels (a multiple of `block`; None: `block`): one fp16
    # scale spanning several activation blocks holds fewer bytes (64: 8.25 bits a weight).
    weight_block: int | None = None
    # The weights' scales: "fp16" (Q8_0's, 2 bytes a block), "e4m3" (1 byte: fp8 with one
    # power-of-two multiplier per projection, each block's d rounded up to it), or "channel": one
    # fp32 scale per output channel over its whole row (after smoothing, outlier columns
    # excluded), the activations still in blocks (no `weight_block` then).
    weight_scales: Literal["fp16", "e4m3", "channel"] = "fp16"
    # The outlier channels' weights: "float" (the model dtype) or "int8" (Q8_0 blocks of 32 along
    # the output, fp16 scales; their activations stay float either way).
    outlier_weights: Literal["float", "int8"] = "float"

    @property
    def calibrated(self) -> bool:
        """Whether this recipe needs the calibration forward's activation maxima."""
        return any(a is not None for a in self.alpha) or any(self.outliers)

    def of(self, name: str) -> tuple[float | None, int]:
        i = QUANTIZED_PROJECTIONS.index(name)
        return self.alpha[i], self.outliers[i]

    def keeps_float(self, layer: int, name: str) -> bool:
        return name in self.float_projections or f"{name}@{layer}" in self.float_projections

    def for_layer(self, layer: int) -> Int8Recipe:
        """This recipe with no smoothing of the projections it keeps in float in `layer`."""
        alpha = tuple(
            None if self.keeps_float(layer, n) else a
            for n, a in zip(QUANTIZED_PROJECTIONS, self.alpha, strict=True)
        )
        return replace(self, alpha=cast(Any, alpha))


def parse_float_projections(spec: str) -> tuple[str, ...]:
    """ "down_proj@27-29;o_proj" -> ("down_proj@27", "down_proj@28", "down_proj@29", "o_proj")."""
    out: list[str] = []
    for entry in filter(None, (e.strip() for e in spec.split(";"))):
        name, _, layers = entry.partition("@")
        if name not in QUANTIZED_PROJECTIONS:
            raise ValueError(f"unknown projection {name!r} (one of {', '.join(QUANTIZED_PROJECTIONS)})")
        if not layers:
            out.append(name)
            continue
        for part in layers.split(","):
            lo, _, hi = part.partition("-")
            out += [f"{name}@{i}" for i in range(int(lo), int(hi or lo) + 1)]
    return tuple(out)


PLAIN = Int8Recipe()
# Per output channel and token, smoothed, outlier channels in float: the fastest GEMMs (fbgemm,
# oneDNN), a lower fidelity than blocks.
PER_CHANNEL = Int8Recipe(alpha=(0.5, 0.5, 0.5, 0.5), outliers=(4, 4, 4, 64))
# What `--quantization w8a8_int8` runs (docs/quantization.md has the measurements behind it).
DEFAULT_RECIPE = Int8Recipe(alpha=(0.5, 0.5, 0.5, 0.5), outliers=(4, 4, 4, 64), block=32)
# The default's Q8_0 weights with activations in two int8 passes (the earlier `w8a8x2_int8`).
TWO_PASS_Q8_0 = Int8Recipe(alpha=(0.5, 0.5, 0.5, 0.5), outliers=(4, 4, 4, 64), block=32, activation_passes=2)
# What `--quantization w8a8x2_int8` runs: weights per output channel (one fp32 scale a row: 1.99x
# below bf16), activations in two int8 passes. Not smoothed: with ~15-bit activations smoothing
# only moves the activations' range into the weights, whose row-wide scale it then widens.
TWO_PASS_RECIPE = Int8Recipe(outliers=(4, 4, 4, 64), block=32, activation_passes=2, weight_scales="channel")


def recipe_for(quantization: str) -> Int8Recipe:
    """The recipe a `--quantization` mode runs (read at load, so tests can patch the recipes)."""
    return {W8A8_INT8: DEFAULT_RECIPE, W8A8X2_INT8: TWO_PASS_RECIPE}[quantization]


class ActivationMaxima:
    """Per-input-channel max |x| of every float projection `linear` runs while it is installed
    (`recording`): the calibration forward's statistics, keyed by the weight's id."""

    def __init__(self) -> None:
        self.absmax: dict[int, torch.Tensor] = {}

    def add(self, weight: torch.Tensor, x: torch.Tensor) -> None:
        m = x.detach().abs().amax(dim=0).float()
        seen = self.absmax.get(id(weight))
        self.absmax[id(weight)] = m if seen is None else torch.maximum(seen, m)


_recorder: ActivationMaxima | None = None


@contextmanager
def recording() -> Iterator[ActivationMaxima]:
    """Collect `ActivationMaxima` of the projections run inside (one calibration at a time)."""
    global _recorder
    assert _recorder is None, "one calibration at a time"
    _recorder = rec = ActivationMaxima()
    try:
        yield rec
    finally:
        _recorder = None


@dataclass(frozen=True)
class Int8Decision:
    """What runs the int8 GEMMs on this machine, and why (logged at load, tested per CPU class)."""

    backend: GemmBackend
    reason: str


def gemm_backend(flags: frozenset[str] | None = None, device: torch.device | None = None) -> Int8Decision:
    """oneDNN's int8 GEMM (through `torch._int_mm`) where x86 has int8 dot products (VNNI, AMX);
    fbgemm on AVX2 without them; elsewhere (flags unknown) the reference path."""
    if device is not None and device.type == "cuda":
        return Int8Decision("int_mm", "CUDA: cuBLASLt int8 GEMM")
    f = cpu_flags() if flags is None else flags
    if "amx_int8" in f:
        return Int8Decision("int_mm", "AMX int8 tiles (oneDNN)")
    if {"avx512_vnni", "avx_vnni"} & f:
        return Int8Decision("int_mm", "VNNI int8 dot products (oneDNN)")
    if "avx2" in f:
        # torch._int_mm without VNNI is a scalar loop (0.2 GOP/s); fbgemm's AVX2 kernels are fast
        # (activations per token through `_fbgemm_per_token`).
        return Int8Decision("fbgemm", "AVX2 8-bit multiply-adds (fbgemm dynamic linear)")
    return Int8Decision("reference", "no x86 int8 instructions known: fp32 reference GEMM")


def quantize_rows(w: torch.Tensor, qmax: float = QMAX) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, k] (any float dtype) -> (int8 [rows, k], fp32 scales [rows]): symmetric, one scale
    per row (per output channel for a weight, per token for an activation), |q| <= qmax."""
    wf = w.float()
    scale = wf.abs().amax(dim=-1).clamp_min(1e-12) / qmax
    q = torch.round(wf / scale[:, None]).clamp_(-qmax, qmax).to(torch.int8)
    return q, scale


def _quantize_blocks(
    x: torch.Tensor, block: int, skip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_blocks` (the C++ pass on a CPU, the torch reference on other devices), the `skip`
    columns read as zeros."""
    x = x.contiguous()
    return quantize_blocks(x, block, skip) if x.is_cpu else reference_quantize_blocks(x, block, skip)


def quantize_weight_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [n, k] (k a multiple of `block`) -> (int8 [n, k], fp16 scales [n, k // block]): Q8_0's
    weight format, 2 bytes per block. d = max |w| / 127 is rounded up to an fp16 value and the
    block is quantized with that d, so |q| <= 127 and the stored pair is exact; the rounding adds at
    most 2^-11 of d to a weight's error, or 2^-25 where d is below fp16's normal range."""
    n, k = w.shape
    assert k % block == 0, "whole blocks"
    wb = w.float().reshape(n, k // block, block)
    d = wb.abs().amax(-1) / QMAX
    if bool((d > torch.finfo(torch.float16).max).any()):
        raise ValueError("a weight block's scale exceeds fp16's range (|w| > 8.3e6)")
    d16 = d.half()
    low = d16.float() < d
    d16 = torch.where(low, torch.nextafter(d16, torch.full_like(d16, torch.inf)), d16)
    d32 = d16.float()[..., None]
    q = torch.where(d32 > 0, torch.round(wb / d32), 0.0).clamp_(-QMAX, QMAX)
    return q.to(torch.int8).reshape(n, k), d16


def quantize_weight_blocks_e4m3(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """w [n, k] -> (int8 [n, k], fp8 e4m3 codes [n, k // block], mul): 1 byte per block's scale,
    d = code * mul with mul a power of two putting the largest d at most at e4m3's 448; each d is
    the smallest such value >= max |w| / 127 and the block is quantized with it (|q| <= 127).
    e4m3 has 3 mantissa bits: d is at most 1/8 above the fp32 one (on average about 1/20)."""
    n, k = w.shape
    assert k % block == 0, "whole blocks"
    wb = w.float().reshape(n, k // block, block)
    d = wb.abs().amax(-1) / QMAX
    top = float(d.max()) if d.numel() else 0.0
    mul = 2.0 ** math.ceil(math.log2(top / 448.0)) if top > 0 else 1.0
    code = (d / mul).to(torch.float8_e4m3fn)
    low = code.float() * mul < d  # rounded down: the next code up (its byte + 1; never past 448)
    code = torch.where(low, (code.view(torch.uint8) + 1).view(torch.float8_e4m3fn), code)
    d32 = (code.float() * mul)[..., None]
    q = torch.where(d32 > 0, torch.round(wb / d32), 0.0).clamp_(-QMAX, QMAX)
    return q.to(torch.int8).reshape(n, k), code, mul


def _padded(x: torch.Tensor, cols: int) -> torch.Tensor:
    """x [m, k] with zero columns appended up to `cols` (a whole number of blocks)."""
    return x if x.shape[1] == cols else torch.nn.functional.pad(x, (0, cols - x.shape[1]))


def _row_absmax(x: torch.Tensor, skip: torch.Tensor | None) -> torch.Tensor:
    """max |x| per row [m, 1] in fp32, over the columns not in `skip` (the outlier channels)."""
    a = x.abs()
    if skip is not None:
        a.index_fill_(1, skip, 0)
    return a.amax(dim=-1, keepdim=True).float().clamp_min_(1e-12)


def _quantize_tokens(x: torch.Tensor, skip: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (int8 [m, k], fp32 [m, 1]), the `skip` columns zero; in fp32 whatever x's dtype."""
    scale = _row_absmax(x, skip).div_(QMAX)
    q = x.float().div(scale).round_()  # |x / scale| <= 127 outside `skip` by construction
    if skip is not None:
        q.index_fill_(1, skip, 0)
    return q.to(torch.int8), scale


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W in int8 per output channel and x quantized per token, or, with
    `block`, both in blocks of `block` input channels (one scale per row and block: Q8_0's format).

    Per channel: `qweight` is [in, out] (the layout `torch._int_mm` reads without a transpose),
    `scale` [out] fp32. Blocked: `qweight` is [out, in'] and `scale` [out, in' / weight_block]
    (`weight_block`: `block` or a multiple of it; a [out, 1] scale with no `weight_block`: one fp32
    scale per output channel), in' the input size rounded up to whole weight blocks (zero
    columns), run through `blocked_matmul` whatever the
    backend (which then only keys the int8 cache). The bias stays the layer's own parameter, in
    the model dtype. Blocked scales are kept in the dtype given (the int8 mode's weights: fp16).
    On fbgemm and the blocked kernel only the packed copy is kept (`qweight` and `scale` unpack it
    when asked: the int8 cache, tests), so the weights' memory is one copy on every backend."""

    # The checkpoint loader skips a projection that is already int8 (read from the int8 cache).
    weight_loader = None
    q: torch.Tensor | None
    # The scales, unless the blocked kernel's packed copy holds them (`scale` reads either).
    s: torch.Tensor | None
    # Input channels kept out of the int8 GEMM ([k_out] int64; their int8 columns are zero) and
    # their float weight [k_out, out] in the model dtype: LLM.int8()'s outlier decomposition.
    outlier_idx: torch.Tensor | None
    outlier_w: torch.Tensor | None
    # With int8 outlier weights, their fp16 block scales [k_out, out rounded up / 32].
    outlier_s: torch.Tensor | None

    def __init__(
        self,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        backend: GemmBackend = "int_mm",
        outlier_idx: torch.Tensor | None = None,
        outlier_w: torch.Tensor | None = None,
        block: int | None = None,
        in_features: int | None = None,
        activation_passes: int = 1,
        weight_block: int | None = None,
        scale_mul: float = 1.0,
        outlier_s: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        assert qweight.dtype == torch.int8 and qweight.dim() == 2, "qweight is int8"
        assert activation_passes == 1 or (block is not None and activation_passes == 2), (
            "two activation passes run on blocked weights"
        )
        self.block = block
        self.activation_passes = activation_passes
        self.weight_block = wb = weight_block or block
        if block is not None:
            n, kp = qweight.shape
            if weight_block is None and scale.dim() == 2 and scale.shape[1] == 1:
                self.weight_block = wb = kp  # one scale per output channel: its whole (padded) row
            assert wb is not None and wb % block == 0, "a weight block is whole activation blocks"
            k = kp if in_features is None else in_features
            assert kp % wb == 0 and kp - wb < k <= kp, "blocked qweight is [out, in rounded up]"
            assert scale.shape == (n, kp // wb), "one scale per output channel and weight block"
            qweight, shape = qweight.contiguous(), (k, n)
            if scale.dtype not in (torch.float16, torch.float8_e4m3fn):
                scale = scale.float()
        else:
            assert scale.shape == (qweight.shape[1],), "one scale per output channel"
            shape = (int(qweight.shape[0]), int(qweight.shape[1]))
            scale = scale.float()
        assert (outlier_idx is None) == (outlier_w is None), "outlier channels come with their weights"
        if outlier_idx is not None and outlier_idx.numel() == 0:
            outlier_idx = outlier_w = None
        if outlier_idx is not None:
            assert outlier_w is not None
            cols = -(-shape[1] // OUTLIER_BLOCK) * OUTLIER_BLOCK if outlier_s is not None else shape[1]
            assert outlier_w.shape == (outlier_idx.numel(), cols), "outlier weights are [k_out, out]"
            assert (outlier_s is not None) == (outlier_w.dtype == torch.int8), "int8 outliers have scales"
        else:
            outlier_s = None
        self.register_buffer("outlier_idx", None if outlier_idx is None else outlier_idx.long())
        self.register_buffer("outlier_w", outlier_w)
        self.register_buffer("outlier_s", outlier_s)
        if block is None and backend == "fbgemm" and int(qweight.abs().max()) > FBGEMM_WMAX:
            # Weights from the cache of another backend or from a GGUF: one bit less, per channel.
            qt, scale = quantize_rows(qweight.t().float() * scale.float()[:, None], FBGEMM_WMAX)
            qweight = qt.t().contiguous()
        self.backend: GemmBackend = backend
        self.shape = shape
        self.scale_mul = float(scale_mul)  # what every blocked scale is multiplied by (fp8: a power of 2)
        self.packed: torch.Tensor | None = None
        # Blocked weights on a CPU live only in the blocked kernel's layout, packed once here.
        self.blocks: PackedWeights | None = None
        self.register_buffer("s", scale)
        if block is None and backend == "fbgemm":  # fbgemm's own weight layout, packed once
            wq = torch._make_per_channel_quantized_tensor(
                qweight.t().contiguous(),
                scale.double(),
                torch.zeros_like(scale, dtype=torch.long),
                0,
            )
            self.packed = torch.ops.quantized.linear_prepack(wq, None)
            self.q = None
        elif block is not None and qweight.device.type == "cpu" and backend != "reference":
            self.blocks = pack_weights(qweight, scale, block, self.scale_mul)
            self.q = self.s = None
        else:
            self.register_buffer("q", qweight)

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        backend: GemmBackend = "int_mm",
        outlier_idx: torch.Tensor | None = None,
        block: int | None = None,
        activation_passes: int = 1,
        weight_block: int | None = None,
        weight_scales: str = "fp16",
        outlier_weights: str = "float",
    ) -> Int8Linear:
        """From a float weight [out, in] (a checkpoint's layout), per output channel or in blocks
        of `block` input channels; the `outlier_idx` input channels stay in the weight's dtype,
        outside the int8 GEMM (and outside its scales)."""
        outlier_w = outlier_s = None
        if outlier_idx is not None and outlier_idx.numel():
            outlier_w = weight[:, outlier_idx].t().contiguous()
            weight = weight.index_fill(1, outlier_idx, 0)
            if outlier_weights == "int8":
                n = outlier_w.shape[1]
                cols = -(-n // OUTLIER_BLOCK) * OUTLIER_BLOCK
                outlier_w, outlier_s = quantize_weight_blocks(_padded(outlier_w.float(), cols), OUTLIER_BLOCK)
        if block is not None:
            channel = weight_scales == "channel"
            assert not channel or weight_block is None, "one scale per output channel spans no weight blocks"
            k, wb = weight.shape[1], weight_block or block
            padded, mul = _padded(weight.float(), -(-k // wb) * wb), 1.0
            if channel:  # one [out, 1] scale over the whole padded row (`__init__`: no weight block)
                q, scale = quantize_rows(padded)
                scale = scale[:, None]
            elif weight_scales == "e4m3":
                q, scale, mul = quantize_weight_blocks_e4m3(padded, wb)
            else:
                q, scale = quantize_weight_blocks(padded, wb)
            return cls(
                q,
                scale,
                backend,
                outlier_idx,
                outlier_w,
                block,
                k,
                activation_passes,
                None if channel else wb,
                mul,
                outlier_s,
            )
        q, scale = quantize_rows(weight, FBGEMM_WMAX if backend == "fbgemm" else QMAX)
        return cls(
            q.t().contiguous(),
            scale,
            backend,
            outlier_idx,
            outlier_w,
            None,
            None,
            activation_passes,
            None,
            1.0,
            outlier_s,
        )

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weight: [in, out] per channel, [out, in rounded up to blocks] blocked."""
        if self.q is not None:
            return self.q
        if self.blocks is not None:
            return self.blocks.unpack()[0]
        assert self.packed is not None
        wq, _ = torch.ops.quantized.linear_unpack(self.packed)
        return wq.int_repr().t().contiguous()

    @property
    def scale(self) -> torch.Tensor:
        """The weight scales: fp32 [out] per channel; [out, in rounded up / block] blocked (fp16
        for the int8 mode's weights)."""
        if self.s is not None:
            return self.s
        assert self.blocks is not None
        return self.blocks.unpack()[1]

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def out_features(self) -> int:
        return self.shape[1]

    def dequantized(self) -> torch.Tensor:
        """The weight the int8 one stands for, [out, in] fp32 (tests and the reference path),
        outlier channels included."""
        if self.block is not None:
            n, kp = self.qweight.shape
            wb = self.weight_block
            assert wb is not None
            w = self.qweight.float().view(n, -1, wb) * (self.scale.float() * self.scale_mul)[..., None]
            w = w.view(n, kp)[:, : self.in_features].contiguous()
        else:
            w = (self.qweight.float() * self.scale).t().contiguous()
        if self.outlier_idx is not None:
            w[:, self.outlier_idx] = self._outlier_weight().float().t()
        return w

    def _outlier_weight(self) -> torch.Tensor:
        """The outlier channels' weights [k_out, out] (int8 ones dequantized, exactly, in fp32)."""
        w = self.outlier_w
        assert w is not None
        if self.outlier_s is None:
            return w
        k_out, cols = w.shape
        deq = w.float().view(k_out, -1, OUTLIER_BLOCK) * self.outlier_s.float()[..., None]
        return deq.view(k_out, cols)[:, : self.out_features]

    def _blocked(self, xq: torch.Tensor, xs: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Quantized activations through the blocked int8 GEMM: the C++ kernel on the packed
        weights, the torch reference elsewhere (other devices, the reference backend)."""
        if self.blocks is not None:
            return blocked_matmul(xq, xs, self.blocks, out=out)
        assert self.q is not None and self.block is not None
        return reference_blocked_matmul(
            xq, xs, self.q, self.scale, self.block, out=out, scale_mul=self.scale_mul
        )

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        skip = self.outlier_idx
        if self.block is not None:
            # The outlier columns (zero in the int8 weights) are masked by the quantizer itself:
            # they set no block scale, and x needs no zeroed copy.
            wb = self.weight_block
            assert wb is not None
            xp = _padded(x.float(), -(-self.in_features // wb) * wb)
            xq, xs = _quantize_blocks(xp, self.block, skip)
            if out.dtype == torch.float32 and out.is_contiguous():
                acc = self._blocked(xq, xs, out=out)  # straight into `out`: no [m, n] temporary
            else:
                acc = self._blocked(xq, xs)
            if self.activation_passes == 2:  # what the int8 activations missed, in int8 again
                m, kp = xp.shape
                missed = xp - (xq.float().view(m, -1, self.block) * xs[..., None]).view(m, kp)
                acc.add_(self._blocked(*_quantize_blocks(missed, self.block, skip)))
            if acc is not out:
                out.copy_(acc)
        elif self.packed is not None:
            y, sx = _fbgemm_per_token(x, self.packed, skip)
            torch.mul(y, sx, out=out)  # one pass: scaled back and rounded into `out`
        else:
            assert self.q is not None
            q, sx = _quantize_tokens(x, skip)
            acc = _gemm(q, self.q, self.backend)
            # (acc * s_x) * s_w in fp32, rounded once into a narrower `out`.
            if out.dtype == torch.float32:
                torch.mul(acc, sx, out=out)
                out.mul_(self.scale)
            else:
                out.copy_(acc.to(torch.float32).mul_(sx).mul_(self.scale))
        if skip is not None:
            # Summed in fp64 (k_out terms: cheap), so a token's bits do not depend on how many rows
            # the GEMM had (a float GEMM's blocking does): a cache hit keeps the cold run's answer.
            # Some rows at a time: not a fresh [m, n] fp64 tensor (twice the output's size).
            xo, wo = x.index_select(1, skip).double(), self._outlier_weight().double()
            step = max(1, _OUTLIER_PART_BYTES // (8 * out.shape[1]))
            for r in range(0, x.shape[0], step):
                part = torch.matmul(xo[r : r + step], wo)
                out[r : r + step].add_(part.to(out.dtype))  # cast first: a mixed-dtype add_ is a slow path
        return out


# The outlier channels' fp64 product is made this many bytes at a time: below glibc's largest
# mmap threshold (reused, not page-faulted afresh), and few enough pieces that each one's
# threaded calls stay cheap beside the GEMM.
_OUTLIER_PART_BYTES = 1 << 24


def _gemm(q: torch.Tensor, w: torch.Tensor, backend: GemmBackend) -> torch.Tensor:
    """int8 [m, k] x int8 [k, n] -> int32 [m, n] (fbgemm layers never come here)."""
    # cuBLASLt wants m > 16 and k, n multiples of 8; the CPU path takes any shape.
    cuda_shape_ok = q.shape[0] > 16 and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0
    if backend == "int_mm" and (q.device.type == "cpu" or cuda_shape_ok):
        return torch._int_mm(q, w)
    # Reference: int8 products summed in fp64 are exact (|sum| < 2^53), so it equals int32 math.
    return torch.matmul(q.double(), w.double()).to(torch.int32)


def _fbgemm_per_token(
    x: torch.Tensor, packed: torch.Tensor, skip: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fbgemm's dynamic linear quantizes its input per tensor, from the tensor's min and max, so a
    row's answer would depend on the rows beside it (a cache hit would differ from the cold run).
    Each row is scaled to max |x| = 1 and one row holding -1 and +1 is appended: the tensor's
    range is then [-1, 1] whatever the batch, every row is quantized with the same fixed step, and
    its output (returned with the factors [m, 1], unscaled) is scaled back by its own factor:
    per-token quantization through fbgemm's kernels,
    8-bit (no `reduce_range`: the weights' +-63 rule out int16 saturation). The `skip` columns
    (outlier channels, whose int8 weights are zero) are zeroed so they cannot widen the range."""
    scale = _row_absmax(x, skip)
    xn = torch.empty(x.shape[0] + 1, x.shape[1], dtype=torch.float32, device=x.device)
    torch.div(x, scale, out=xn[:-1])
    if skip is not None:
        xn[:-1].index_fill_(1, skip, 0)
    xn[-1].zero_()
    xn[-1, 0], xn[-1, -1] = -1.0, 1.0
    return torch.ops.quantized.linear_dynamic(xn, packed, False)[:-1], scale


def linear(
    x: torch.Tensor, weight: torch.Tensor | Int8Linear, out: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """out = x weight^T (+ bias): a float weight [out, in] through torch.matmul, an int8 one
    through its int8 GEMM. The decoder layers call this for every projection."""
    if _recorder is not None and not isinstance(weight, Int8Linear):
        _recorder.add(weight, x)
    if isinstance(weight, Int8Linear):
        weight(x, out=out)
        if bias is not None:
            out.add_(bias)
    elif bias is not None:
        torch.addmm(bias, x, weight.t(), out=out)
    else:
        torch.matmul(x, weight.t(), out=out)


# The float tensors smoothing rescales besides the projections (kept in the int8 cache with them).
SMOOTHED_FLOATS = ("input_layernorm", "post_attention_layernorm", "qkv_bias")


def _smoothing_factors(a: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    """SmoothQuant's s_j = max|X_j|^alpha / max|W_j|^(1-alpha) for activation maxima a [k] and the
    weight columns' maxima w [k] (clamped: a channel silent in calibration must not explode)."""
    s = a.float().clamp_min(1e-5).pow(alpha) / w.float().clamp_min(1e-5).pow(1 - alpha)
    return s.clamp_(1e-3, 1e3)


def smooth_layer(
    layer: nn.Module, maxima: dict[str, torch.Tensor], recipe: Int8Recipe
) -> dict[str, torch.Tensor]:
    """Fold the recipe's smoothing into one decoder layer's float weights, in place (the layer
    computes the same function up to rounding); returns the activation maxima it leaves per
    projection. qkv and gate/up: the RMSNorm weight before them is divided by s (only where the
    layer says which plain RMSNorm that is: `smooth_norms`). o_proj: v's rows (and bias), with one s
    per kv channel shared by the query heads that read it. down_proj: the up rows (act = f(gate)
    * up)."""
    cfg: Any = layer.cfg  # a ModelConfig (int8 sits below the model classes that import it)
    norms: dict[str, str] = getattr(layer, "smooth_norms", {})
    qkv, gate_up = cast(torch.Tensor, layer.qkv_proj).data, cast(torch.Tensor, layer.gate_up_proj).data
    after = dict(maxima)
    for name in QUANTIZED_PROJECTIONS:
        alpha, _ = recipe.of(name)
        if alpha is None:
            continue
        w = getattr(layer, name).data
        if name == "o_proj":
            kv, g, hd = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
            a_kv = maxima[name].view(kv, g, hd).amax(1).flatten()
            w_kv = w.abs().amax(0).view(kv, g, hd).amax(1).flatten()
            s_kv = _smoothing_factors(a_kv, w_kv, alpha)
            s = s_kv.view(kv, 1, hd).expand(kv, g, hd).flatten()
            v = slice(cfg.q_size + cfg.kv_size, None)
            qkv[v].copy_(qkv[v].float() / s_kv[:, None])
            if isinstance(bias := getattr(layer, "qkv_bias", None), torch.Tensor):
                bias.data[v].copy_(bias.data[v].float() / s_kv)
        else:
            if name in ("qkv_proj", "gate_up_proj") and name not in norms:
                continue
            s = _smoothing_factors(maxima[name], w.abs().amax(0), alpha)
            if name == "down_proj":
                up = slice(cfg.intermediate_size, None)
                gate_up[up].copy_(gate_up[up].float() / s[:, None])
            else:
                norm = getattr(layer, norms[name]).data
                norm.copy_(norm.float() / s)
        w.copy_(w.float() * s)
        after[name] = maxima[name] / s
    return after


def outlier_channels(maxima: torch.Tensor, k: int) -> torch.Tensor | None:
    """The k input channels with the largest activation maxima, ascending (None for k = 0)."""
    if k <= 0:
        return None
    return torch.topk(maxima.float(), min(k, maxima.numel())).indices.sort().values


def quantize_model(
    layers: Sequence[nn.Module],
    backend: GemmBackend,
    recipe: Int8Recipe = PLAIN,
    maxima: Sequence[dict[str, torch.Tensor]] | None = None,
) -> None:
    """Replace each decoder layer's projections (`QUANTIZED_PROJECTIONS`) by their int8 form, one
    at a time, so the float copy of only one projection is alive beside the int8 weights. A
    calibrated recipe needs `maxima` (per layer, per projection: `calibration.activation_maxima`):
    each layer is smoothed first, and its outlier channels stay in the model dtype."""
    assert not recipe.calibrated or maxima is not None, "this recipe needs calibration maxima"
    for i, layer in enumerate(layers):
        if any(isinstance(getattr(layer, n), Int8Linear) for n in QUANTIZED_PROJECTIONS):
            assert not recipe.calibrated, "a calibrated recipe quantizes from float weights"
        own = recipe.for_layer(i)
        after = smooth_layer(layer, maxima[i], own) if maxima is not None and recipe.calibrated else {}
        for name in QUANTIZED_PROJECTIONS:
            w = getattr(layer, name)
            if not isinstance(w, Int8Linear) and not recipe.keeps_float(i, name):
                idx = outlier_channels(after[name], recipe.of(name)[1]) if name in after else None
                q = Int8Linear.from_float(
                    w.data,
                    backend,
                    idx,
                    recipe.block,
                    recipe.activation_passes,
                    recipe.weight_block,
                    recipe.weight_scales,
                    recipe.outlier_weights,
                )
                delattr(layer, name)
                setattr(layer, name, q)


def int8_state(layers: Sequence[nn.Module], recipe: Int8Recipe = PLAIN) -> dict[str, torch.Tensor]:
    """The int8 weights and scales of quantized layers, by "layer.projection.tensor", their outlier
    channels, and the float tensors smoothing may have rescaled (`SMOOTHED_FLOATS`): the cache.
    The projections `recipe` keeps in float are the checkpoint's own: not stored."""
    out = {}
    for i, layer in enumerate(layers):
        for name in QUANTIZED_PROJECTIONS:
            q = getattr(layer, name)
            if recipe.keeps_float(i, name):
                continue
            assert isinstance(q, Int8Linear), f"layer {i}'s {name} is not quantized"
            out[f"{i}.{name}.qweight"], out[f"{i}.{name}.scale"] = q.qweight, q.scale
            if q.scale_mul != 1.0:
                out[f"{i}.{name}.scale_mul"] = torch.tensor(q.scale_mul)
            if q.outlier_idx is not None:
                assert q.outlier_w is not None
                out[f"{i}.{name}.outlier_idx"], out[f"{i}.{name}.outlier_w"] = q.outlier_idx, q.outlier_w
                if q.outlier_s is not None:
                    out[f"{i}.{name}.outlier_s"] = q.outlier_s
        for attr in SMOOTHED_FLOATS:
            t = getattr(layer, attr, None)
            if t is not None:
                out[f"{i}.{attr}"] = t.data.clone()
    return out


def load_int8_state(
    layers: Sequence[nn.Module],
    state: dict[str, torch.Tensor],
    backend: GemmBackend,
    recipe: Int8Recipe = PLAIN,
) -> None:
    """Put `int8_state`'s tensors in place of the layers' float projections (before any float
    weight is read: those tensors are then skipped; `load_smoothed_floats` follows the read);
    `recipe`: the one the state was quantized with."""
    for i, layer in enumerate(layers):
        for name in QUANTIZED_PROJECTIONS:
            if recipe.keeps_float(i, name):
                continue
            w = getattr(layer, name)
            q = Int8Linear(
                state[f"{i}.{name}.qweight"],
                state[f"{i}.{name}.scale"],
                backend,
                state.get(f"{i}.{name}.outlier_idx"),
                state.get(f"{i}.{name}.outlier_w"),
                recipe.block,
                int(w.shape[1]),
                recipe.activation_passes,
                recipe.weight_block,
                float(state.get(f"{i}.{name}.scale_mul", torch.tensor(1.0))),
                state.get(f"{i}.{name}.outlier_s"),
            )
            assert (q.out_features, q.in_features) == tuple(w.shape), (
                f"cached {name} of layer {i}: wrong shape"
            )
            delattr(layer, name)
            setattr(layer, name, q)


def load_smoothed_floats(layers: Sequence[nn.Module], state: dict[str, torch.Tensor]) -> None:
    """The cached (smoothed) norms and biases over the checkpoint's, once the checkpoint is read."""
    for i, layer in enumerate(layers):
        for attr in SMOOTHED_FLOATS:
            if f"{i}.{attr}" in state:
                getattr(layer, attr).data.copy_(state[f"{i}.{attr}"])


def is_quantized(model: nn.Module) -> bool:
    """Whether any of the model's projections is int8."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (the int8 weights and their scales included; fbgemm's
    packed int8 weights counted at one byte a value, the blocked kernel's packed weights, scales
    and weight sums at their size)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    packed = sum(
        m.in_features * m.out_features
        for m in model.modules()
        if isinstance(m, Int8Linear) and m.packed is not None
    ) + sum(
        sum(
            t.numel() * t.element_size()
            for t in (m.blocks.data, m.blocks.scales, m.blocks.comp)
            if t is not None
        )
        for m in model.modules()
        if isinstance(m, Int8Linear) and m.blocks is not None
    )
    return packed + sum(t.numel() * t.element_size() for t in tensors.values())
