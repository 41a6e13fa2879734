"""Model code: one decoder implementation per architecture family, picked by `model_type`."""

from __future__ import annotations

from po_backend.core.errors import UnsupportedModelError
from po_backend.engine.config import ModelConfig
from po_backend.engine.models.llama import LlamaForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[cfg.model_type]
    except KeyError:
        raise UnsupportedModelError(f"no model code for {cfg.model_type!r}") from None
