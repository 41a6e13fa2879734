"""`ServerArgs`: every setting of one server, nested as in mini-sglang (the engine's options, the
scheduler's config, then the HTTP edge's own fields). `launch_server.server_args` fills it from the
command line in one place; /server_info reports it. Torch-free: the engine options stay the
strings a user typed and become an `EngineConfig` in `Engine.from_pretrained(path, **overrides)`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from po_backend.sched.scheduler import SchedulerConfig

BACKENDS = ("prefillonly", "hf")


@dataclass(frozen=True)
class EngineOptions:
    """The engine settings a user chooses; None means the engine's or the model's default."""

    model_path: str
    backend: str = "prefillonly"  # "prefillonly" (ours) | "hf" (the transformers baseline)
    dtype: str = "auto"  # auto | bf16 | fp16 | fp32
    device: str | None = None  # default: cuda when available
    max_input_len: int | None = None  # default: the model's context
    max_batch_tokens: int | None = None
    memory_budget: int | None = None  # bytes beyond the weights
    memory_fraction: float | None = None  # or this share of the memory available at start
    chunk_size: int = 512
    prefill_mode: str = "hybrid"
    enable_cache: bool = True

    def __post_init__(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required (a HF folder, a .gguf file, or 'embedded')")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        for name in ("max_input_len", "max_batch_tokens", "memory_budget"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0 = no chunking), got {self.chunk_size}")

    def overrides(self) -> dict[str, Any]:
        """`Engine.from_pretrained` keyword arguments (EngineConfig field names); unset ones are
        left out so the engine picks its defaults."""
        out = {
            "dtype": None if self.dtype == "auto" else self.dtype,
            "device": self.device,
            "max_input_len": self.max_input_len,
            "max_batch_tokens": self.max_batch_tokens,
            "memory_budget": self.memory_budget,
            "chunk_size": self.chunk_size,
            "prefill_mode": self.prefill_mode,
            "enable_cache": self.enable_cache,
        }
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True)
class ServerArgs:
    """One server: what runs (engine, scheduler) and how it is reached (the HTTP edge)."""

    engine: EngineOptions
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Prompts the loop may hold queued; a call that does not fit gets 503 "overloaded".
    max_queue: int = 4096
    served_model_name: str = ""
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    max_body_bytes: int = 64 << 20
    timeout_keep_alive: float = 65.0  # seconds an idle keep-alive connection stays open
    shutdown_timeout: float = 30.0  # on SIGTERM: seconds to finish queued work, then 503s
    timeout_request_read: float = 30.0  # seconds a client may take to send headers and body
    log_level: str = "info"
    # Rerank prompt with {query} before {doc} (and optional {instruct}); "" = Qwen3-Reranker's
    # turns in the model's chat template (po_backend/server/rerank.py).
    rerank_template: str = ""
    # Per-call limits, checked before any tokenizing. Top log-probs per position are capped like
    # vLLM's max_logprobs (a full-vocabulary list per item would be a response of gigabytes).
    max_top_logprobs: int = 20
    max_items_per_request: int = 1024  # prompts (or documents) in one call
    max_labels: int = 64  # labels in one classify call
    # SGLang/vLLM-style /v1/classify: the labels and the prompt around {input}.
    classify_labels: tuple[str, ...] = ()
    classify_template: str = "{input}"

    def __post_init__(self) -> None:
        if self.rerank_template and not (
            self.rerank_template.count("{query}") == 1
            and self.rerank_template.count("{doc}") == 1
            and self.rerank_template.index("{query}") < self.rerank_template.index("{doc}")
        ):
            raise ValueError("rerank_template needs {query} once, then {doc} once")
        labels = self.classify_labels
        if labels and (
            len(labels) < 2 or len(set(labels)) != len(labels) or not all(x.strip() for x in labels)
        ):
            raise ValueError(
                f"classify_labels must be 2 or more distinct non-empty labels, got {list(labels)}"
            )
        if self.classify_template.count("{input}") != 1:
            raise ValueError("classify_template needs {input} exactly once")
        for name in ("max_top_logprobs", "max_items_per_request", "max_labels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {self.max_queue}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        for name in ("shutdown_timeout", "timeout_request_read"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {value}")
        if not (math.isfinite(self.timeout_keep_alive) and self.timeout_keep_alive > 0):
            raise ValueError(
                f"timeout_keep_alive must be a positive number of seconds, got {self.timeout_keep_alive}"
            )

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def backend(self) -> str:
        return self.engine.backend

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model_path

    def public(self) -> dict[str, Any]:
        """The settings as one flat JSON object (what /server_info reports, as SGLang's does),
        without the API key."""
        out: dict[str, Any] = {**asdict(self.engine), **asdict(self.scheduler)}
        out["schedule_policy"] = out.pop("policy")
        out.update((k, v) for k, v in asdict(self).items() if k not in ("engine", "scheduler", "api_key"))
        return out
