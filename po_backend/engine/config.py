"""Frozen configuration records. No I/O here: loaders read files and hand dicts to `from_hf`;
what the CPU can do comes from `po_backend.core.cpu`."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from po_backend.core.choices import (
    CACHE_POLICIES,
    PREFILL_MODES,
    QUANTIZATIONS,
    RESIDUAL_DTYPES,
    CachePolicy,
    PrefillMode,
    ResidualDtype,
    check_choice,
)
from po_backend.core.cpu import cpu_has_fast_bf16
from po_backend.core.errors import UnsupportedModelError
from po_backend.core.settings import CPU_HYBRID_CHUNK_SIZE, CUDA_CHUNK_SIZE, DEFAULT_CHUNK_SIZE
from po_backend.engine.device import cuda_dtype, resolve_device
from po_backend.engine.memory import available_bytes

# model_type -> (qkv projections carry a bias, per-head RMSNorm on q and k) for the Llama family
_FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}
# Decoders with their own model code (engine/models/gemma.py, phi.py). "gemma3" is the multimodal
# checkpoint: its text model is served, the vision tower ignored.
_OTHER_TYPES = ("gemma", "gemma2", "gemma3", "gemma3_text", "phi3")
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted((*_FAMILIES, *_OTHER_TYPES)))
_ROPE_KINDS = ("default", "linear", "llama3", "longrope")


def _rope_params(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """One layer type's RoPE parameters from a config.json of any transformers version.

    transformers 5 keeps theta and scaling together in `rope_parameters` (per layer type for
    Gemma 3); 4.x used `rope_theta` + `rope_scaling` (+ Gemma 3's `rope_local_base_freq`, its
    scaling applying to the global layers only)."""
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    if layer_type == "sliding_attention":
        # Gemma 3 before transformers 5: local layers rotate with their own base, unscaled.
        return {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    scaling = cfg.get("rope_scaling") or {}
    return {**scaling, **params}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3 | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # Fraction of each head's dims that rotate (Phi-4-mini: 0.75); the rest pass through.
    partial_rotary_factor: float = 1.0
    # longrope: per-pair divisors of the frequencies, and the factor cos/sin are multiplied by.
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    @classmethod
    def from_hf(
        cls, cfg: dict[str, Any], layer_type: str | None = None, default_theta: float = 10000.0
    ) -> RopeConfig:
        params = _rope_params(cfg, layer_type)
        theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        kind = "longrope" if kind == "su" else kind  # "su" is longrope's first name (Phi-3)
        if kind not in _ROPE_KINDS:
            raise UnsupportedModelError(f"rope type {kind!r} is not supported ({', '.join(_ROPE_KINDS)} are)")
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        original = params.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        attention_factor = 1.0
        if kind == "longrope":
            original = int(original or cfg.get("max_position_embeddings", 2048))
            if params.get("attention_factor") is not None:
                attention_factor = float(params["attention_factor"])
            else:
                # transformers' rule: the factor defaults to the context's growth over pretraining.
                factor = params.get("factor") or cfg.get("max_position_embeddings", original) / original
                if factor > 1.0:
                    attention_factor = math.sqrt(1 + math.log(factor) / math.log(original))
        return cls(
            theta=theta,
            kind=kind,
            factor=float(params.get("factor") or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(original or 8192),
            partial_rotary_factor=partial,
            short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
            long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
            attention_factor=attention_factor,
        )

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Per-pair rotation frequencies (fp32), following the transformers definitions."""
        dim = self.rotary_dim(head_dim)
        inv = 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if self.kind == "linear":
            return inv / self.factor
        if self.kind == "longrope":
            # The short factors: contexts are capped at the pretraining length (ModelConfig.from_hf),
            # within which transformers uses them too.
            if len(self.short_factor) != dim // 2:
                raise UnsupportedModelError(
                    f"longrope short_factor has {len(self.short_factor)} entries, the rotary dims need {dim // 2}"
                )
            return 1.0 / (
                torch.tensor(self.short_factor, dtype=torch.float32)
                * self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
            )
        if self.kind == "llama3":
            low_wavelen = self.original_max_position / self.low_freq_factor
            high_wavelen = self.original_max_position / self.high_freq_factor
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > low_wavelen, inv / self.factor, inv)
            smooth = (self.original_max_position / wavelen - self.low_freq_factor) / (
                self.high_freq_factor - self.low_freq_factor
            )
            smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            return torch.where(medium, smoothed, scaled)
        return inv


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (Gemma)
    attn_scale: float | None = None  # None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # the same on the LM head's logits (Gemma 2)
    sliding_window: int | None = None  # a key is seen by queries fewer than this many positions on
    sliding_layers: tuple[bool, ...] = ()  # which layers use sliding_window (empty: none)
    rope_local: RopeConfig | None = None  # RoPE of the sliding layers, where it differs (Gemma 3)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None where it attends to the whole context."""
        return self.sliding_window if self.sliding_layers and self.sliding_layers[layer] else None

    def layer_rope(self, layer: int) -> RopeConfig:
        if self.rope_local is not None and self.sliding_layers and self.sliding_layers[layer]:
            return self.rope_local
        return self.rope

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict; unsupported features raise, never degrade."""
        model_type = cfg.get("model_type", "")
        if model_type == "gemma3" and isinstance(cfg.get("text_config"), dict):
            tie = cfg.get("tie_word_embeddings", cfg["text_config"].get("tie_word_embeddings", True))
            cfg = {**cfg["text_config"], "model_type": "gemma3_text", "tie_word_embeddings": tie}
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = cfg.get("architectures") or []
            raise UnsupportedModelError(
                f"unsupported architecture {model_type or archs!r}; supported model types: "
                f"{list(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type in _FAMILIES:
            return _llama_family(cfg, model_type)
        if model_type == "phi3":
            return _phi3(cfg)
        return _gemma(cfg, model_type)


def _common(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The fields every decoder's config.json spells the same way."""
    if cfg.get("mlp_bias", False):
        raise UnsupportedModelError("mlp_bias=True is not supported")
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return dict(
        model_type=model_type,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def _check_act(act: str, supported: tuple[str, ...]) -> str:
    if act not in supported:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only {', '.join(supported)})")
    return act


def _llama_family(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    _check_act(cfg.get("hidden_act", "silu"), ("silu",))
    qkv_bias, qk_norm = _FAMILIES[model_type]
    if model_type in ("llama", "mistral") and cfg.get("attention_bias", False):
        qkv_bias = True  # some Llama derivatives (e.g. InternLM-style) set attention_bias
    fields = _common(cfg, model_type)
    n = fields["num_layers"]
    # Sliding windows as transformers applies them: on every layer for Mistral (v0.1 sets one),
    # on the layers from max_window_layers on for Qwen2/Qwen3 when use_sliding_window is set.
    window = cfg.get("sliding_window")
    sliding: tuple[bool, ...] = ()
    if window and model_type == "mistral":
        sliding = (True,) * n
    elif window and model_type in ("qwen2", "qwen3") and cfg.get("use_sliding_window", False):
        types = cfg.get("layer_types") or [
            "sliding_attention" if i >= int(cfg.get("max_window_layers", n)) else "full_attention"
            for i in range(n)
        ]
        sliding = tuple(t == "sliding_attention" for t in types)
    return ModelConfig(
        **fields,
        rope=RopeConfig.from_hf(cfg),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        sliding_window=int(window) if window and any(sliding) else None,
        sliding_layers=sliding if any(sliding) else (),
    )


def _phi3(cfg: dict[str, Any]) -> ModelConfig:
    """Phi-3 / Phi-3.5 / Phi-4-mini: Llama's layer with fused checkpoint projections, partial
    rotary (Phi-4-mini), longrope, and a sliding window over every layer where set (Phi-3-mini)."""
    _check_act(cfg.get("hidden_act", "silu"), ("silu",))
    if cfg.get("attention_bias", False):
        raise UnsupportedModelError("phi3 with attention_bias=True is not supported")
    fields = _common(cfg, "phi3")
    rope = RopeConfig.from_hf(cfg)
    if rope.kind == "longrope" and fields["max_position_embeddings"] > rope.original_max_position:
        # Beyond the pretraining length transformers switches EVERY position to the long factors
        # (the whole sequence's frequencies depend on its length), so K/V cached for a shorter
        # prompt would be wrong for a longer one: serve the short-factor range, exactly.
        fields["max_position_embeddings"] = rope.original_max_position
    window = cfg.get("sliding_window")
    return ModelConfig(
        **fields,
        rope=rope,
        qkv_bias=False,
        qk_norm=False,
        sliding_window=int(window) if window else None,
        sliding_layers=(True,) * fields["num_layers"] if window else (),
    )


def _gemma(cfg: dict[str, Any], model_type: str) -> ModelConfig:
    """Gemma 1, 2 and 3 text: (1 + w) norms, scaled embeddings, gelu-tanh MLP, sliding-window
    layers, soft-capping (Gemma 2), q/k norms and local/global RoPE bases (Gemma 3). Gemma 1 has
    no sliding layers and scales scores by head_dim ** -0.5."""
    gemma3 = model_type == "gemma3_text"
    if model_type == "gemma":
        cfg = {**cfg, "layer_types": ["full_attention"] * int(cfg["num_hidden_layers"])}
        cfg["query_pre_attn_scalar"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    _check_act(act, ("gelu_pytorch_tanh",))
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("bidirectional attention (use_bidirectional_attention) is not supported")
    if cfg.get("attention_bias", False):
        raise UnsupportedModelError(f"{model_type} with attention_bias=True is not supported")
    fields = _common(cfg, model_type)
    n = fields["num_layers"]
    types = cfg.get("layer_types")
    if not types:  # configs written before transformers listed layer types: the fixed pattern
        pattern = int(
            cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or (6 if gemma3 else 2)
        )
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(
            f"layer_types {types!r} is not supported (sliding_attention, full_attention)"
        )
    window = cfg.get("sliding_window")
    sliding = tuple(t == "sliding_attention" and bool(window) for t in types)

    def cap(key: str) -> float | None:
        value = cfg.get(key)
        return float(value) if value else None

    return ModelConfig(
        **fields,
        rope=RopeConfig.from_hf(cfg, "full_attention" if gemma3 else None, 1e6 if gemma3 else 1e4),
        rope_local=RopeConfig.from_hf(cfg, "sliding_attention") if gemma3 else None,
        qkv_bias=False,
        qk_norm=gemma3,
        hidden_act=act,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or 256) ** -0.5,
        # Gemma 3's attention does not soft-cap (transformers ignores the field there).
        attn_softcap=None if gemma3 else cap("attn_logit_softcapping"),
        final_softcap=cap("final_logit_softcapping"),
        sliding_window=int(window) if window else None,
        sliding_layers=sliding if any(sliding) else (),
    )


def default_device() -> torch.device:
    return resolve_device(None)


def default_chunk_size(device: torch.device, prefill_mode: str = "hybrid") -> int:
    """The chunk when none is asked for: longer on CUDA (see CUDA_CHUNK_SIZE) and for hybrid
    prefilling on a CPU (CPU_HYBRID_CHUNK_SIZE); the chunked baseline's is Sarathi's 512 there."""
    if device.type == "cuda":
        return CUDA_CHUNK_SIZE
    return CPU_HYBRID_CHUNK_SIZE if prefill_mode == "hybrid" else DEFAULT_CHUNK_SIZE


def default_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return cuda_dtype(device)
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp32": torch.float32,
        "float32": torch.float32,
        "float": torch.float32,
        "fp16": torch.float16,
        "float16": torch.float16,
        "half": torch.float16,
    }
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)} or 'auto'")
    return table[dtype]


__all__ = ["PREFILL_MODES", "PrefillMode", "ResidualDtype"]  # re-exported for the runner


def resolve_residual(dtype: torch.dtype, residual: ResidualDtype) -> torch.dtype:
    """The residual stream's dtype for weights in `dtype`. "fp32" keeps the stream (and so every
    norm's input) in fp32 under bf16/fp16 weights, as llama.cpp keeps its activations: each layer
    adds a rounded sublayer output to an unrounded sum, so the rounding error does not compound
    over the layers into reordered rankings. "model" rounds the stream to `dtype` after every add
    (what transformers does in bf16)."""
    check_choice("residual_dtype", residual, RESIDUAL_DTYPES)
    if residual == "fp32" and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model (not what the model is). None: the default, resolved by
    `Engine.from_pretrained` against the model and the device (`resolved`), the same defaults as
    `core.settings.Settings` documents."""

    dtype: torch.dtype
    device: torch.device
    # Tokens per chunk of the token-wise work (hybrid prefilling); 0 = off; None: the device's.
    chunk_size: int | None = None
    max_input_len: int | None = None  # None: the model's context
    # Packing several short prompts into one forward makes GEMMs big enough to be efficient.
    max_batch_tokens: int | None = None  # None: max(max_input_len, 2048)
    enable_cache: bool = True
    # Bytes beyond the weights (activations + prefix-KV pool); None = `memory.default_budget`, or
    # mem_fraction_static of what the device has available when the config is resolved.
    memory_budget: int | None = None
    mem_fraction_static: float | None = None
    # Which leading tokens of a request that declares nothing enter the prefix cache.
    cache_policy: CachePolicy = "all-but-last-k"
    cache_last_k: int = 1
    profile_full: bool | None = None  # profile at the full length (None: on CUDA only; slow on CPU)
    # "hybrid": the paper's hybrid prefilling (attention unchunked, last-layer-only KV).
    # "chunked": Sarathi-style chunked prefill, kept as the baseline the paper compares against:
    # every op, attention included, runs chunk by chunk, so every layer's K/V must stay resident.
    prefill_mode: PrefillMode = "hybrid"
    # Tokens the prefix-KV pool may hold at most; None = what the memory budget leaves after the
    # activations (capped at 64 full-length prompts under the default budget).
    prefix_pool_tokens: int | None = None
    # What the model is served for (core.task.TASKS; "auto": from the checkpoint's files) and an
    # embedder's pooling (None: its sentence-transformers config, else last token).
    task: str = "auto"
    pooling: str | None = None
    # The residual stream's dtype under bf16/fp16 weights (see `resolve_residual`).
    residual_dtype: ResidualDtype = "fp32"
    # LoRA adapters (`models/lora.py`): served at all, how many at once and their largest rank,
    # which together set aside their memory from the budget at start.
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16

    # "w8a8_int8" / "w8a8x2_int8": the decoder's projections in int8 (models/int8.py); None: all in `dtype`.
    quantization: str | None = None

    def __post_init__(self) -> None:
        check_choice("cache_policy", self.cache_policy, CACHE_POLICIES)
        check_choice("prefill_mode", self.prefill_mode, PREFILL_MODES)
        check_choice("residual_dtype", self.residual_dtype, RESIDUAL_DTYPES)
        if self.quantization is not None:
            check_choice("quantization", self.quantization, QUANTIZATIONS)
            if self.enable_lora:
                # Smoothing rescales the projections' inputs, which a LoRA adapter reads as trained.
                raise ValueError(
                    "enable_lora does not combine with quantization (int8 smooths the adapters' inputs)"
                )
        for name, low in (
            ("cache_last_k", 0),
            ("chunk_size", 0),  # 0 = no chunking
            ("max_input_len", 1),
            ("max_batch_tokens", 1),
            ("max_loras", 1),
            ("max_lora_rank", 1),
        ):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1], got {self.mem_fraction_static}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"memory_budget must be >= 1 byte, got {self.memory_budget}")
        if self.prefix_pool_tokens is not None and self.prefix_pool_tokens < 1:
            raise ValueError(f"prefix_pool_tokens must be >= 1, got {self.prefix_pool_tokens}")

    def resolved(self, context: int) -> EngineConfig:
        """Every None replaced by its default, for a model of `context` tokens: dtype and device
        as `parse_dtype` / `resolve_device` choose, the device's chunk, the model's context, the
        memory budget from mem_fraction_static when that is given."""
        dev = resolve_device(self.device)
        max_input_len = self.max_input_len if self.max_input_len is not None else context
        budget = self.memory_budget
        if budget is None and self.mem_fraction_static is not None:
            budget = int(self.mem_fraction_static * available_bytes(dev))
        return replace(
            self,
            device=dev,
            memory_budget=budget,
            dtype=parse_dtype(self.dtype, dev),
            chunk_size=default_chunk_size(dev, self.prefill_mode)
            if self.chunk_size is None
            else self.chunk_size,
            max_input_len=max_input_len,
            max_batch_tokens=self.max_batch_tokens
            if self.max_batch_tokens is not None
            else max(max_input_len, 2048),
            profile_full=dev.type == "cuda" if self.profile_full is None else self.profile_full,
        )

    @property
    def input_len(self) -> int:
        """max_input_len, resolved (`resolved`)."""
        assert self.max_input_len is not None, "EngineConfig.resolved() first"
        return self.max_input_len

    @property
    def chunk_tokens(self) -> int:
        """chunk_size, resolved (`resolved`)."""
        assert self.chunk_size is not None, "EngineConfig.resolved() first"
        return self.chunk_size

    @property
    def batch_tokens(self) -> int:
        """max_batch_tokens, resolved (`resolved`)."""
        assert self.max_batch_tokens is not None, "EngineConfig.resolved() first"
        return self.max_batch_tokens
