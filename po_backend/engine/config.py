"""Frozen configuration records. No I/O here: loaders read files and hand dicts to `from_hf`;
what the CPU can do comes from `po_backend.core.cpu`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch

from po_backend.core.cpu import cpu_has_fast_bf16
from po_backend.core.errors import UnsupportedModelError
from po_backend.core.settings import DEFAULT_CHUNK_SIZE
from po_backend.engine.device import cuda_dtype, resolve_device

# model_type -> (qkv projections carry a bias, per-head RMSNorm on q and k)
_FAMILIES: dict[str, tuple[bool, bool]] = {
    "llama": (False, False),
    "mistral": (False, False),
    "qwen2": (True, False),
    "qwen3": (False, True),
}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> RopeConfig:
        # transformers 5 keeps theta and scaling together in `rope_parameters`; 4.x used
        # `rope_theta` + `rope_scaling`. Accept both so any config.json on disk loads.
        params = dict(cfg.get("rope_parameters") or {})
        scaling = cfg.get("rope_scaling") or {}
        params = {**scaling, **params}
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        if kind not in ("default", "linear", "llama3"):
            raise UnsupportedModelError(f"rope type {kind!r} is not supported (default, linear, llama3 are)")
        return cls(
            theta=theta,
            kind=kind,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        )

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Per-pair rotation frequencies (fp32), following the transformers definitions."""
        inv = 1.0 / (self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if self.kind == "linear":
            return inv / self.factor
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a transformers `config.json` dict; unsupported features raise, never degrade."""
        model_type = cfg.get("model_type", "")
        if model_type not in _FAMILIES:
            archs = cfg.get("architectures") or []
            raise UnsupportedModelError(
                f"unsupported architecture {model_type or archs!r}; supported model types: {sorted(_FAMILIES)}"
            )
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
        qkv_bias, qk_norm = _FAMILIES[model_type]
        if model_type in ("llama", "mistral") and cfg.get("attention_bias", False):
            qkv_bias = True  # some Llama derivatives (e.g. InternLM-style) set attention_bias
        if cfg.get("mlp_bias", False):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        # A sliding window only changes attention beyond the window, so capping the usable
        # context at the window keeps our full-attention kernels exact (Mistral v0.1, Qwen2).
        window = cfg.get("sliding_window")
        if window and (model_type == "mistral" or cfg.get("use_sliding_window", False)):
            max_pos = min(max_pos, int(window))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg),
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
        )


def default_device() -> torch.device:
    return resolve_device(None)


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


PrefillMode = Literal["hybrid", "chunked"]
PREFILL_MODES: tuple[PrefillMode, ...] = ("hybrid", "chunked")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs a model (not what the model is)."""

    dtype: torch.dtype
    device: torch.device
    chunk_size: int = (
        DEFAULT_CHUNK_SIZE  # tokens per chunk of the token-wise work (hybrid prefilling); 0 = off
    )
    max_input_len: int = 8192
    # Packing several short prompts into one forward makes GEMMs big enough to be efficient.
    max_batch_tokens: int = 8192
    enable_cache: bool = True
    # Bytes beyond the weights (activations + prefix-KV pool); None = a quarter of the available
    # RAM on CPU, 85% of the free GPU memory on CUDA.
    memory_budget: int | None = None
    # Which leading tokens of a request that declares nothing enter the prefix cache.
    cache_policy: str = "all-but-last-k"  # | "declared" | "none"
    cache_last_k: int = 1
    profile_full: bool = False  # profile at the full length (default on CUDA; slow on CPU)
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

    def __post_init__(self) -> None:
        policies = ("all-but-last-k", "declared", "none")
        if self.cache_policy not in policies:
            raise ValueError(f"cache_policy must be one of {policies}, got {self.cache_policy!r}")
        if self.prefill_mode not in PREFILL_MODES:
            raise ValueError(f"prefill_mode must be one of {PREFILL_MODES}, got {self.prefill_mode!r}")
        for name, low in (
            ("cache_last_k", 0),
            ("chunk_size", 0),  # 0 = no chunking
            ("max_input_len", 1),
            ("max_batch_tokens", 1),
        ):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.memory_budget is not None and self.memory_budget < 1:
            raise ValueError(f"memory_budget must be >= 1 byte, got {self.memory_budget}")
        if self.prefix_pool_tokens is not None and self.prefix_pool_tokens < 1:
            raise ValueError(f"prefix_pool_tokens must be >= 1, got {self.prefix_pool_tokens}")
