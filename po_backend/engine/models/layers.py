"""Token-wise building blocks. Each writes into a caller-provided buffer so chunks reuse memory."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from po_backend.engine import fused_cpu


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """RMSNorm computed in fp32 and cast back, as transformers does, so bf16 results match it.
    fp32 on a CPU: one fused pass (`fused_cpu`)."""
    if fused_cpu.takes(x, weight, out) and x.dim() in (2, 3) and weight.is_contiguous():
        torch.ops.po_fused.rms_norm(x, weight, eps, out)
        return out
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    torch.mul(xf.to(x.dtype), weight, out=out)
    return out


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> torch.Tensor:
    """h += delta, then out = rms_norm(h) (out may be delta): one pass over h where fused."""
    if fused_cpu.takes(h, delta, weight, out) and h.dim() == 2 and weight.is_contiguous():
        torch.ops.po_fused.add_rms_norm(h, delta, weight, eps, out)
        return out
    h.add_(delta)
    return rms_norm(h, weight, eps, out=out)


def qk_norm_rope_(
    qk: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    eps: float,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """qk [c, q_heads + kv_heads, d] in place: the per-head RMSNorm of q and k (`norms`: q's and
    k's weights; None: none, as Llama), then RoPE; one pass where fused."""
    whole = [cos, sin, *(norms or ())]
    if fused_cpu.takes(qk, *whole) and qk.dim() == 3 and all(t.is_contiguous() for t in whole):
        wq, wk = norms if norms is not None else (_EMPTY, _EMPTY)
        torch.ops.po_fused.norm_rope(qk, cos, sin, wq, wk, q_heads, eps)
        return
    if norms is not None:
        q, k = qk.split((q_heads, qk.shape[1] - q_heads), dim=1)
        rms_norm(q, norms[0], eps, out=q)
        rms_norm(k, norms[1], eps, out=k)
    Rotary.apply_(qk, cos, sin)


_EMPTY = torch.empty(0)


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm: scales by (1 + w), and multiplies before casting back (transformers'
    Gemma rule; Llama's casts first). A (1 + w) stored in bf16 would lose w's low bits, so the
    offset is added in fp32 at each call (a [hidden] op)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out.copy_(xf * (1.0 + weight.float()))
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [gate | up] buffer: silu in place on the gate half, then one multiply;
    fp32 on a CPU: one fused pass that leaves gate_up as it was (`fused_cpu`)."""
    if fused_cpu.takes(gate_up, out) and gate_up.dim() == 2 and out.dim() == 2:
        torch.ops.po_fused.silu_mul(gate_up, out)
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    F.silu(gate, inplace=True)
    torch.mul(gate, up, out=out)
    return out


def gelu_tanh_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma's gelu_pytorch_tanh) on a fused [gate | up] buffer, like `silu_mul`."""
    gate, up = gate_up.chunk(2, dim=-1)
    torch.mul(F.gelu(gate, approximate="tanh"), up, out=out)
    return out


class Rotary:
    """Rotary position embedding (rotate-half layout, as transformers' Llama/Qwen), over the first
    2 * len(inv_freq) dims of each head (partial rotary: the rest pass through unchanged)."""

    def __init__(self, inv_freq: torch.Tensor, device: torch.device, scaling: float = 1.0) -> None:
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.scaling = scaling  # longrope multiplies cos and sin by its attention factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [n, 1, rotary_dim/2]; computed once per chunk and shared by all layers."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.scaling != 1.0:
            cos, sin = cos * self.scaling, sin * self.scaling
        return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]

    @staticmethod
    def apply_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [n, heads, head_dim] in place: x1' = x1 c - x2 s, x2' = x2 c + x1 s."""
        if fused_cpu.takes(x, cos, sin) and x.dim() == 3 and cos.is_contiguous() and sin.is_contiguous():
            torch.ops.po_fused.norm_rope(x, cos, sin, _EMPTY, _EMPTY, 0, 0.0)
            return
        rot = 2 * cos.shape[-1]
        if rot < x.shape[-1]:
            x = x[..., :rot]
        x1, x2 = x.chunk(2, dim=-1)
        # transformers computes x*cos + rotate_half(x)*sin in the model dtype; the same
        # products, each rounded, in the same order keep bf16 results bit-identical to it.
        # Two half-size temporaries instead of six: fewer passes over a memory-bound op.
        r1 = x1 * cos
        t = x2 * sin
        r1.sub_(t)
        torch.mul(x1, sin, out=t)
        x2.mul_(cos).add_(t)
        x1.copy_(r1)
