"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama's decoder layer exactly (SwiGLU, plain RMSNorm, no biases).

What differs is outside the layer: the checkpoint stores q/k/v as one `qkv_proj` and gate/up as
one `gate_up_proj` (the layouts our fused parameters already use, so they load whole); head dim 96
on Phi-3-mini; RoPE with longrope's per-frequency factors and attention factor, over part of
each head on Phi-4-mini (`RopeConfig`); and a sliding window over every layer where the config
sets one (Phi-3-mini-4k), which the runner applies.
"""

from __future__ import annotations

from po_backend.engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    # Shard None: the fused tensor as stored fills the whole parameter.
    packed_modules_mapping = {
        **LlamaForCausalLM.packed_modules_mapping,
        "self_attn.qkv_proj.weight": ("qkv_proj", None),
        "mlp.gate_up_proj.weight": ("gate_up_proj", None),
    }
