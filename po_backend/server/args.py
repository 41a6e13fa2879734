"""`ServerArgs`: every setting of one server: what runs (`core.settings.Settings`, declared once
for every entry point) and the HTTP edge's own fields, declared here with their defaults, help and
checks (launch_server generates its flags from both with `core.flags.add_fields`).
/server_info reports the resolved settings. Torch-free.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from po_backend.core.choices import LOG_LEVELS
from po_backend.core.settings import Settings, arg_bytes, flag
from po_backend.sched.config import SchedulerConfig
from po_backend.server.rerank_presets import CHOICES as RERANK_PRESETS
from po_backend.server.tracing import endpoint_url


def _labels(text: str) -> tuple[str, ...]:
    """--classify-labels: comma-separated."""
    return tuple(x.strip() for x in text.split(",")) if text else ()


def _text_or_file(value: str) -> str:
    """A template flag: the text itself, or the contents of the file it names."""
    return Path(value).read_text() if value and os.path.isfile(value) else value


@dataclass(frozen=True)
class ServerArgs:
    """One server: what runs (engine, scheduler) and how it is reached (the HTTP edge). Each HTTP
    field is declared once here: default, command-line help (`core.settings.flag`) and check."""

    engine: Settings
    served_model_name: str = field(
        default="", metadata=flag("model name in API responses (default: the model path)")
    )
    host: str = field(default="127.0.0.1", metadata=flag("bind address (loopback only unless given)"))
    port: int = field(default=30000, metadata=flag("TCP port", type=int))
    api_key: str | None = field(
        default=None,
        metadata=flag(
            "require 'Authorization: Bearer KEY' (or set $PREFILLONLY_API_KEY, which keeps the key out of `ps`)"
        ),
    )
    # JSON is parsed on the event loop (holding the GIL, whatever thread parses it), in time
    # proportional to the body: the limit bounds how long one call can stall every other client.
    max_body_bytes: int = field(
        default=2 << 20,
        metadata=flag(
            "larger request bodies get 413, from Content-Length before any byte is read (e.g. 16M; "
            "TEI's payload limit is 2 MB too)",
            type=arg_bytes,
        ),
    )
    admin_api_key: str | None = field(
        default=None,
        metadata=flag(
            "the key /flush_cache needs (or set $PREFILLONLY_ADMIN_KEY); without it /flush_cache takes "
            "the API key, and on a keyless server only same-origin calls"
        ),
    )
    # Requests, not connections: an idle keep-alive socket costs a file descriptor, never a slot.
    # Above the ~1,000-call bursts the server is tested with (its kernel backlog is 4096).
    max_concurrent_requests: int = field(
        default=2048,
        metadata=flag(
            "calls served at once (TEI's --max-concurrent-requests); beyond it 503 + Retry-After. "
            "GET /health, /ready and /metrics never count",
            type=int,
        ),
    )
    limit_concurrency: int | None = field(
        default=None,
        metadata=flag(
            "open connections at once (uvicorn's limit_concurrency; default: no limit, see "
            "--max-concurrent-requests); beyond it 503 for every call, /health included",
            type=int,
        ),
    )
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "Host header values accepted, comma-separated (e.g. localhost,127.0.0.1; '*.example.com' "
            "for subdomains): a guard against DNS rebinding; default any",
            type=_labels,
        ),
    )
    timeout_keep_alive: float = field(
        default=5.0,
        metadata=flag("seconds an idle keep-alive connection stays open (uvicorn's default)", type=float),
    )
    shutdown_timeout: float = field(
        default=30.0,
        metadata=flag(
            "on SIGTERM: seconds to finish queued work; what is still queued then gets 503 + Retry-After",
            type=float,
        ),
    )
    timeout_request_read: float = field(
        default=30.0,
        metadata=flag(
            "seconds a client may take to send a request's headers and body before it is cut off", type=float
        ),
    )
    log_level: str = field(default="info", metadata=flag("the server's log level", choices=LOG_LEVELS))
    # Rerank prompt with {query} before {doc} (and optional {instruct}); "" = Qwen3-Reranker's
    # turns in the model's chat template (po_backend/server/rerank.py).
    rerank_template: str = field(
        default="",
        metadata=flag(
            "rerank prompt (text or a file) with {query} before {doc}, optional {instruct}; default: "
            "Qwen3-Reranker's format in the chat template",
            type=_text_or_file,
        ),
    )
    rerank_preset: str = field(
        default="auto",
        metadata=flag(
            "a reranker's built-in prompt and answer tokens: auto (read from the model folder's "
            "name) | none | " + " | ".join(RERANK_PRESETS[2:]),
            choices=RERANK_PRESETS,
        ),
    )
    # OpenTelemetry traces (po_backend/server/tracing.py, the [otel] extra).
    otlp_traces_endpoint: str = field(
        default="",
        metadata=flag(
            "export a trace span per call (tokenize, queue, forward, response) to this OTLP/HTTP "
            "receiver, e.g. http://localhost:4318/v1/traces (vLLM's flag; needs the [otel] extra)"
        ),
    )
    enable_trace: bool = field(
        default=False,
        metadata=flag(
            f"SGLang's switch for traces: to --otlp-traces-endpoint, else {endpoint_url('', True)}"
        ),
    )
    # Per-call limits, checked before any tokenizing. Top log-probs per position are capped like
    # vLLM's max_logprobs (a full-vocabulary list per item would be a response of gigabytes).
    max_top_logprobs: int = field(
        default=20,
        metadata=flag(
            "top log-probs per position, /generate and /v1/completions (like vLLM's max_logprobs)", type=int
        ),
    )
    max_items_per_request: int = field(
        default=1024, metadata=flag("prompts or documents in one call", type=int)
    )
    # A shared query is tokenized with each of a call's items: 1,024 items over a 8,000-character
    # query is 8 M characters, a few seconds of tokenizer CPU.
    max_tokenize_chars: int = field(
        default=8 << 20,
        metadata=flag(
            "characters of text one call may give the tokenizer in all (a shared query counts once per "
            "item); larger calls get 413 before any tokenizing",
            type=int,
        ),
    )
    max_labels: int = field(default=64, metadata=flag("labels in one classify call", type=int))
    max_label_tokens: int = field(
        default=32, metadata=flag("tokens of one classify label (longer labels get 400)", type=int)
    )
    max_logit_bias: int = field(
        default=300, metadata=flag("logit_bias entries per prompt (OpenAI's limit)", type=int)
    )
    # What one call may return in all, whatever the per-position caps allow: items x labels,
    # top-k and prompt log-probs (each position's entries) summed over the call's prompts.
    max_logprobs_per_request: int = field(
        default=1 << 18,
        metadata=flag(
            "log-prob values one call may return in all (items x label_token_ids, top log-probs, "
            "prompt log-probs); larger calls get 413",
            type=int,
        ),
    )
    # SGLang/vLLM-style /v1/classify: the labels and the prompt around {input}.
    classify_labels: tuple[str, ...] = field(
        default=(),
        metadata=flag(
            "labels of SGLang/vLLM-style /v1/classify {model, input}, comma-separated (e.g. yes,no)",
            type=_labels,
        ),
    )
    classify_template: str = field(
        default="{input}",
        metadata=flag("prompt of /v1/classify around {input} (text or a file)", type=_text_or_file),
    )

    def __post_init__(self) -> None:
        if self.rerank_template and not (
            self.rerank_template.count("{query}") == 1
            and self.rerank_template.count("{doc}") == 1
            and self.rerank_template.index("{query}") < self.rerank_template.index("{doc}")
        ):
            raise ValueError("rerank_template needs {query} once, then {doc} once")
        if self.rerank_preset not in RERANK_PRESETS:
            raise ValueError(f"rerank_preset must be one of {RERANK_PRESETS}, got {self.rerank_preset!r}")
        if self.rerank_template and self.rerank_preset not in ("auto", "none"):
            raise ValueError("give rerank_template or a rerank_preset, not both")
        endpoint_url(self.otlp_traces_endpoint, self.enable_trace)  # raises on a bad URL
        labels = self.classify_labels
        if labels and (
            len(labels) < 2 or len(set(labels)) != len(labels) or not all(x.strip() for x in labels)
        ):
            raise ValueError(
                f"classify_labels must be 2 or more distinct non-empty labels, got {list(labels)}"
            )
        if self.classify_template.count("{input}") != 1:
            raise ValueError("classify_template needs {input} exactly once")
        for name in (
            "max_top_logprobs", "max_items_per_request", "max_labels", "max_label_tokens",
            "max_logit_bias", "max_logprobs_per_request", "max_concurrent_requests", "max_tokenize_chars",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency must be >= 1, got {self.limit_concurrency}")
        for host in self.allowed_hosts:
            if not host or "*" in host[1:] or (host.startswith("*") and not host.startswith("*.")):
                raise ValueError(f"allowed_hosts: {host!r} is not a host name or '*.domain'")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
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
    def traces_endpoint(self) -> str:
        """Where trace spans go ("" = no tracing)."""
        return endpoint_url(self.otlp_traces_endpoint, self.enable_trace)

    @property
    def scheduler(self) -> SchedulerConfig:
        return SchedulerConfig.from_settings(self.engine)

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
            (f.name, getattr(self, f.name))
            for f in fields(self)
            if f.name not in ("engine", "api_key", "admin_api_key")
        )
        return out
