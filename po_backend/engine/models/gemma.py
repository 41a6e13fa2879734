"""Gemma (1), Gemma 2 and Gemma 3 text decoders on the Llama layer's buffers and chunking.

What differs from Llama, each as transformers computes it: every RMSNorm scales by (1 + w) in
fp32; embeddings are multiplied by sqrt(hidden); the attention output is normed before the
residual add, and the MLP (GeGLU, gelu_pytorch_tanh) sits between a pre- and a post-norm; scores
are scaled by query_pre_attn_scalar ** -0.5. Gemma 2 soft-caps attention scores and the final
logits; Gemma 3 norms q and k per head. Which layers slide, their window and RoPE base come from
the config (`ModelConfig.layer_window`, `layer_rope`); the runner applies them.

Gemma (1) has Llama's layer layout (no post-attention or feed-forward sandwich norms, no soft-caps,
no sliding layers) with the (1 + w) norms, scaled embeddings and GeGLU MLP.

Checkpoints: GemmaForCausalLM, Gemma2ForCausalLM / Gemma3ForCausalLM name tensors as Llama does (`model.layers...`);
the multimodal Gemma3ForConditionalGeneration nests the text model under `language_model`
(`model.language_model.*` in transformers 5, `language_model.model.*` before), and its vision
tower's tensors are ignored.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from po_backend.engine.config import ModelConfig
from po_backend.engine.models.layers import Rotary, gelu_tanh_mul, gemma_rms_norm
from po_backend.engine.models.llama import DecoderLayer, LlamaForCausalLM, WeightLoader, _param

# Where multimodal Gemma 3 checkpoints keep the text model's tensors -> the causal LM's names.
_TEXT_PREFIXES = {
    "model.language_model.": "model.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
}


class GemmaDecoderLayer(DecoderLayer):
    act_mul = staticmethod(gelu_tanh_mul)
    # Gemma's norms scale by (1 + w) and sandwich the MLP: int8's smoothing does not fold into them.
    smooth_norms: ClassVar[dict[str, str]] = {}

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        self.pre_feedforward_layernorm = _param(cfg.hidden_size, dtype=dtype)
        self.post_feedforward_layernorm = _param(cfg.hidden_size, dtype=dtype)

    def qkv_chunk(
        self, h: torch.Tensor, x: torch.Tensor, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        cfg = self.cfg
        gemma_rms_norm(h, self.input_layernorm, cfg.rms_norm_eps, out=x)
        self.project("qkv", x, self.qkv_proj, qkv)
        c = qkv.shape[0]
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(c, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            assert self.k_norm is not None, "q_norm and k_norm come together"
            q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)
            gemma_rms_norm(q, self.q_norm, cfg.rms_norm_eps, out=q)
            gemma_rms_norm(k, self.k_norm, cfg.rms_norm_eps, out=k)
        Rotary.apply_(qk, cos, sin)

    def out_mlp_chunk(
        self, h: torch.Tensor, attn: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor
    ) -> None:
        """h += norm(o_proj(attn)); h += norm(mlp(norm(h))), in place on the chunk view `h`."""
        eps = self.cfg.rms_norm_eps
        self.project("o", attn, self.o_proj, x)
        gemma_rms_norm(x, self.post_attention_layernorm, eps, out=x)
        h.add_(x)
        gemma_rms_norm(h, self.pre_feedforward_layernorm, eps, out=x)
        self.mlp(x, gate_up, act)
        gemma_rms_norm(x, self.post_feedforward_layernorm, eps, out=x)
        h.add_(x)


class Gemma1DecoderLayer(GemmaDecoderLayer):
    """Gemma (1): h += o_proj(attn); h += mlp(norm(h)), Llama's order with Gemma's norm and MLP."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        DecoderLayer.__init__(self, cfg, dtype)

    def out_mlp_chunk(
        self, h: torch.Tensor, attn: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor
    ) -> None:
        self.project("o", attn, self.o_proj, x)
        h.add_(x)
        gemma_rms_norm(h, self.post_attention_layernorm, self.cfg.rms_norm_eps, out=x)
        self.mlp(x, gate_up, act)
        h.add_(x)


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class: type[DecoderLayer] = GemmaDecoderLayer
    renamed = {
        **LlamaForCausalLM.renamed,
        "pre_feedforward_layernorm.weight": "pre_feedforward_layernorm",
        "post_feedforward_layernorm.weight": "post_feedforward_layernorm",
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        # transformers multiplies by sqrt(hidden) cast to the weights' dtype (55.4256 is 55.5 in bf16).
        self.embed_scale = torch.tensor(cfg.hidden_size**0.5, dtype=dtype)

    def resolve(self, name: str) -> tuple[torch.Tensor, WeightLoader, str | int | None] | None:
        for prefix, ours in _TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return super().resolve(ours + name[len(prefix) :])
        return super().resolve(name)

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        x = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        return gemma_rms_norm(h.float(), self.norm, self.cfg.rms_norm_eps, out=x)


class Gemma1ForCausalLM(GemmaForCausalLM):
    layer_class = Gemma1DecoderLayer
    renamed = LlamaForCausalLM.renamed
