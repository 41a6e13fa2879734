"""HTTP server: SGLang's native API, OpenAI completions, our `/v1/classify`, Prometheus metrics.

Every endpoint turns its body into `ScoreRequest`s, submits them to the scheduling loop (which
validates them and owns the engine), awaits the futures and formats the results in the shape its
clients expect. The event loop never runs model code; a client that disconnects cancels its
requests. `create_app` takes any `Backend`, so `--backend hf` (the transformers baseline) serves
the same API.

Shapes follow SGLang 0.5.23 (`/generate` meta_info, `/v1/score`) and OpenAI (`/v1/completions`);
errors are `{"error": {"message", "type", "param", "code"}}` (what the openai client parses).

Modules, each importing only those above it:
    protocol    request bodies (pydantic, the edge only)
    backend     the `Backend` protocol, `LoopBackend`, `ServerArgs`
    errors      `HTTPError`, error bodies, validation messages, exception handlers
    translate   pure request/result conversions (per-item fields, logit_bias, log-probs)
    metrics     Prometheus metrics
    middleware  API key, body limit, request metrics (pure ASGI)
    app         `Server` (endpoint logic) and `create_app` (routes)
"""

from __future__ import annotations

from po_backend.server.app import create_app
from po_backend.server.backend import Backend, LoopBackend, ServerArgs

__all__ = ["Backend", "LoopBackend", "ServerArgs", "create_app"]
