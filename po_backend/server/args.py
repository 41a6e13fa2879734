"""`ServerArgs`: every setting of one server: what runs (`core.settings.Settings`, declared once
for every entry point) and the HTTP edge's own fields, declared here with their defaults and help
(`HTTP_HELP`; launch_server generates its flags from both). /server_info reports the resolved
settings. Torch-free.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from po_backend.core.settings import Settings, parse_bytes
from po_backend.sched.scheduler import SchedulerConfig


@dataclass(frozen=True)
class ServerArgs:
    """One server: what runs (engine, scheduler) and how it is reached (the HTTP edge)."""

    engine: Settings
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
    def scheduler(self) -> SchedulerConfig:
        e = self.engine
        return SchedulerConfig(e.schedule_policy, e.fairness_lambda, e.min_shared_prefix)

    @property
    def max_queue(self) -> int:
        return self.engine.max_queue

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
        out: dict[str, Any] = self.engine.public()
        out.update(
            (f.name, getattr(self, f.name)) for f in fields(self) if f.name not in ("engine", "api_key")
        )
        return out


# The HTTP edge's flags: help text and command-line type of each ServerArgs field (the defaults
# are the fields' own). launch_server generates `--name-with-dashes` from these.
HTTP_HELP: dict[str, tuple[str, Any]] = {
    "host": ("bind address (default: loopback only)", str),
    "port": ("TCP port", int),
    "api_key": ("require 'Authorization: Bearer KEY' (or set $PREFILLONLY_API_KEY, which keeps the key out of `ps`)", str),
    "served_model_name": ("model name in API responses (default: the model path)", str),
    "max_body_bytes": ("larger request bodies get 413 (e.g. 64M)", parse_bytes),
    "timeout_keep_alive": ("seconds an idle keep-alive connection stays open", float),
    "shutdown_timeout": ("on SIGTERM: seconds to finish queued work; what is still queued then gets 503 + Retry-After", float),
    "timeout_request_read": ("seconds a client may take to send a request's headers and body before it is cut off", float),
    "log_level": ("debug | info | warning | error | critical", str),
    "rerank_template": ("rerank prompt (text or a file) with {query} before {doc}, optional {instruct}; default: Qwen3-Reranker's format in the chat template", str),
    "max_top_logprobs": ("top log-probs per position, /generate and /v1/completions (like vLLM's max_logprobs)", int),
    "max_items_per_request": ("prompts or documents in one call", int),
    "max_labels": ("labels in one classify call", int),
    "classify_labels": ("labels of SGLang/vLLM-style /v1/classify {model, input}, comma-separated (e.g. yes,no)", str),
    "classify_template": ("prompt of /v1/classify around {input} (text or a file)", str),
}  # fmt: skip
