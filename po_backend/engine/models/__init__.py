"""Model code: one decoder implementation per architecture family, picked by `model_type`."""

from __future__ import annotations

from po_backend.core.errors import UnsupportedModelError
from po_backend.engine.config import SUPPORTED_MODEL_TYPES, ModelConfig
from po_backend.engine.models.gemma import Gemma1ForCausalLM, GemmaForCausalLM
from po_backend.engine.models.llama import LlamaForCausalLM
from po_backend.engine.models.phi import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma": Gemma1ForCausalLM,
    "gemma2": GemmaForCausalLM,
    "gemma3_text": GemmaForCausalLM,  # "gemma3" (multimodal) configs are read as their text model
    "phi3": Phi3ForCausalLM,
}
assert set(MODEL_REGISTRY) | {"gemma3"} == set(SUPPORTED_MODEL_TYPES), "config and model code disagree"


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    try:
        return MODEL_REGISTRY[cfg.model_type]
    except KeyError:
        raise UnsupportedModelError(
            f"no model code for {cfg.model_type!r}; supported model types: {list(SUPPORTED_MODEL_TYPES)}"
        ) from None
