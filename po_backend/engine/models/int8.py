"""Int8 linear layers: W8A8 dynamic quantization (SGLang's `--quantization w8a8_int8`).

Weights are quantized once at load, symmetric int8 per output channel with fp32 scales; each
activation row (token) is quantized right before its matmul, symmetric int8 with its own fp32
scale; the product accumulates in int32 and is dequantized by row scale x channel scale into the
caller's buffer (the model dtype, then the fp32 residual stream). Norms, attention, embeddings and
the LM head never pass through here: they stay in the model dtype.

`gemm_backend` picks the GEMM from the CPU's flags: `torch._int_mm` (oneDNN: AVX512-VNNI,
AVX-VNNI, AMX tiles), fbgemm's dynamic linear on AVX2-only CPUs (8-bit activations per token,
weights within +-63), or the reference path (the same integer products summed exactly in fp64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from po_backend.core.cpu import cpu_flags

# The modes `--quantization` accepts (core.settings.QUANTIZATIONS holds the same names, torch-free).
W8A8_INT8 = "w8a8_int8"
QMAX = 127.0
# fbgemm's AVX2 kernel adds pairs of u8 x s8 products in int16 with saturation (`vpmaddubsw`):
# full 8-bit activations (up to 255) times weights within +-63 can never saturate (2*255*63 <
# 2^15), so on that backend the weights get one bit less rather than the activations (torch's
# `reduce_range` would halve the activations' steps, which carry the outliers).
FBGEMM_WMAX = 63.0

GemmBackend = Literal["int_mm", "fbgemm", "reference"]

# The decoder layers' projections that the int8 mode quantizes (their attribute names).
QUANTIZED_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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


def _quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, k] -> (int8 [m, k], fp32 [m, 1]); in fp32 whatever x's dtype, with one temporary."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12).div_(QMAX)
    q = xf.div(scale).round_().to(torch.int8)  # |x / scale| <= 127 by construction: no clamp
    return q, scale


class Int8Linear(nn.Module):
    """y = x W^T (+ b) with W in int8 per output channel and x quantized per token.

    `qweight` is [in, out] (the layout `torch._int_mm` reads without a transpose); `scale` [out]
    fp32; the bias stays the layer's own parameter, in the model dtype. On fbgemm only its packed
    copy is kept (`qweight` unpacks it when asked: the int8 cache, tests), so the weights' memory
    is one int8 copy on every backend."""

    # The checkpoint loader skips a projection that is already int8 (read from the int8 cache).
    weight_loader = None
    q: torch.Tensor | None
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, backend: GemmBackend = "int_mm") -> None:
        super().__init__()
        assert qweight.dtype == torch.int8 and qweight.dim() == 2, "qweight is int8 [in, out]"
        assert scale.shape == (qweight.shape[1],), "one scale per output channel"
        if backend == "fbgemm" and int(qweight.abs().max()) > FBGEMM_WMAX:
            # Weights from the cache of another backend or from a GGUF: one bit less, per channel.
            qt, scale = quantize_rows(qweight.t().float() * scale.float()[:, None], FBGEMM_WMAX)
            qweight = qt.t().contiguous()
        self.register_buffer("scale", scale.float())
        self.backend: GemmBackend = backend
        self.shape = (int(qweight.shape[0]), int(qweight.shape[1]))
        self.packed: torch.Tensor | None = None
        if backend == "fbgemm":  # fbgemm's own weight layout, packed once
            wq = torch._make_per_channel_quantized_tensor(
                qweight.t().contiguous(),
                self.scale.double(),
                torch.zeros_like(self.scale, dtype=torch.long),
                0,
            )
            self.packed = torch.ops.quantized.linear_prepack(wq, None)
            self.q = None
        else:
            self.register_buffer("q", qweight)

    @classmethod
    def from_float(cls, weight: torch.Tensor, backend: GemmBackend = "int_mm") -> Int8Linear:
        """From a float weight [out, in] (a checkpoint's layout)."""
        q, scale = quantize_rows(weight, FBGEMM_WMAX if backend == "fbgemm" else QMAX)
        return cls(q.t().contiguous(), scale, backend)

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 weight [in, out]."""
        if self.q is not None:
            return self.q
        assert self.packed is not None
        wq, _ = torch.ops.quantized.linear_unpack(self.packed)
        return wq.int_repr().t().contiguous()

    @property
    def in_features(self) -> int:
        return self.shape[0]

    @property
    def out_features(self) -> int:
        return self.shape[1]

    def dequantized(self) -> torch.Tensor:
        """The weight the int8 one stands for, [out, in] fp32 (tests and the reference path)."""
        return (self.qweight.float() * self.scale).t()

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        if out is None:
            out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        if self.packed is not None:
            out.copy_(_fbgemm_per_token(x, self.packed))
            return out
        assert self.q is not None
        q, sx = _quantize_tokens(x)
        acc = _gemm(q, self.q, self.backend)
        # (acc * s_x) * s_w in fp32, rounded once into a narrower `out`.
        if out.dtype == torch.float32:
            torch.mul(acc, sx, out=out)
            out.mul_(self.scale)
        else:
            out.copy_(acc.to(torch.float32).mul_(sx).mul_(self.scale))
        return out


def _gemm(q: torch.Tensor, w: torch.Tensor, backend: GemmBackend) -> torch.Tensor:
    """int8 [m, k] x int8 [k, n] -> int32 [m, n] (fbgemm layers never come here)."""
    # cuBLASLt wants m > 16 and k, n multiples of 8; the CPU path takes any shape.
    cuda_shape_ok = q.shape[0] > 16 and w.shape[0] % 8 == 0 and w.shape[1] % 8 == 0
    if backend == "int_mm" and (q.device.type == "cpu" or cuda_shape_ok):
        return torch._int_mm(q, w)
    # Reference: int8 products summed in fp64 are exact (|sum| < 2^53), so it equals int32 math.
    return torch.matmul(q.double(), w.double()).to(torch.int32)


def _fbgemm_per_token(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """fbgemm's dynamic linear quantizes its input per tensor, from the tensor's min and max, so a
    row's answer would depend on the rows beside it (a cache hit would differ from the cold run).
    Each row is scaled to max |x| = 1 and one row holding -1 and +1 is appended: the tensor's
    range is then [-1, 1] whatever the batch, every row is quantized with the same fixed step, and
    its output is scaled back by its own factor: per-token quantization through fbgemm's kernels,
    8-bit (no `reduce_range`: the weights' +-63 rule out int16 saturation)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min_(1e-12)
    xn = torch.empty(x.shape[0] + 1, x.shape[1], dtype=torch.float32, device=x.device)
    torch.div(xf, scale, out=xn[:-1])
    xn[-1].zero_()
    xn[-1, 0], xn[-1, -1] = -1.0, 1.0
    y = torch.ops.quantized.linear_dynamic(xn, packed, False)[:-1]
    return y.mul_(scale)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Int8Linear, out: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """out = x weight^T (+ bias): a float weight [out, in] through torch.matmul, an int8 one
    through its int8 GEMM. The decoder layers call this for every projection."""
    if isinstance(weight, Int8Linear):
        weight(x, out=out)
        if bias is not None:
            out.add_(bias)
    elif bias is not None:
        torch.addmm(bias, x, weight.t(), out=out)
    else:
        torch.matmul(x, weight.t(), out=out)


def quantize_model(layers: Sequence[nn.Module], backend: GemmBackend) -> None:
    """Replace each decoder layer's projections (`QUANTIZED_PROJECTIONS`) by their int8 form, one
    at a time, so the float copy of only one projection is alive beside the int8 weights."""
    for layer in layers:
        for name in QUANTIZED_PROJECTIONS:
            w = getattr(layer, name)
            if not isinstance(w, Int8Linear):
                q = Int8Linear.from_float(w.data, backend)
                delattr(layer, name)
                setattr(layer, name, q)


def int8_state(layers: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
    """The int8 weights and scales of quantized layers, by "layer.projection.tensor" (the cache)."""
    out = {}
    for i, layer in enumerate(layers):
        for name in QUANTIZED_PROJECTIONS:
            q = getattr(layer, name)
            assert isinstance(q, Int8Linear), f"layer {i}'s {name} is not quantized"
            out[f"{i}.{name}.qweight"], out[f"{i}.{name}.scale"] = q.qweight, q.scale
    return out


def load_int8_state(
    layers: Sequence[nn.Module], state: dict[str, torch.Tensor], backend: GemmBackend
) -> None:
    """Put `int8_state`'s tensors in place of the layers' float projections (before any float
    weight is read: those tensors are then skipped)."""
    for i, layer in enumerate(layers):
        for name in QUANTIZED_PROJECTIONS:
            w = getattr(layer, name)
            q = Int8Linear(state[f"{i}.{name}.qweight"], state[f"{i}.{name}.scale"], backend)
            assert (q.out_features, q.in_features) == tuple(w.shape), (
                f"cached {name} of layer {i}: wrong shape"
            )
            delattr(layer, name)
            setattr(layer, name, q)


def is_quantized(model: nn.Module) -> bool:
    """Whether any of the model's projections is int8."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer (the int8 weights and their scales included; fbgemm's
    packed int8 weights counted at one byte a value)."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    packed = sum(
        m.in_features * m.out_features for m in model.modules() if isinstance(m, Int8Linear) and m.q is None
    )
    return packed + sum(t.numel() * t.element_size() for t in tensors.values())
