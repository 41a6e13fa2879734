"""HTTP server: SGLang's native API, OpenAI completions, scoring (`/v1/score`, our `/v1/classify`),
health and Prometheus metrics.

Every endpoint reads as parse -> run -> format: it turns its body into `ScoreRequest`s, submits
them to the scheduling loop (which validates them and owns the engine) through `Runtime.run`,
and formats the results in the shape its clients expect. The event loop never runs model code; a
client that disconnects cancels its requests. `create_app` takes any `ScoringService`, so `--backend hf`
(the transformers baseline) serves the same API.

Shapes follow SGLang 0.5.23 (`/generate` meta_info, `/v1/score`) and OpenAI (`/v1/completions`);
errors are `{"error": {"message", "type", "param", "code"}}` (what the openai client parses).

Modules, each importing only those above it:
    protocol       request bodies (pydantic, the edge only)
    args           `ServerArgs` (the engine's `core.settings.Settings`, the HTTP edge's own fields)
    service        the `ScoringService` protocol, `LoopService` (a serving runtime behind the app)
    errors         `HTTPError`, error bodies, validation messages, exception handlers
    translate      pure request/result conversions (per-item fields, logit_bias, log-probs)
    metrics        Prometheus metrics
    middleware     API key, body limit, request metrics (pure ASGI)
    runtime        `Runtime`: what handlers share (tokens, log-prob entries, run with cancel)
    API families, one `APIRouter` each:
      admin          /health, /health_generate, /metrics
      sglang_native  /generate, /model_info, /server_info, /flush_cache (and get_* aliases)
      tokenizer      /tokenize, /detokenize, /apply_chat_template
      openai         /v1/models, /v1/completions
      scoring        /v1/score, /v1/classify
    app            `create_app`: the routers, handlers and middleware in one app
"""

from __future__ import annotations

from po_backend.core.settings import Settings
from po_backend.server.app import create_app
from po_backend.server.args import ServerArgs
from po_backend.server.service import LoopService, ScoringService

__all__ = ["LoopService", "ScoringService", "ServerArgs", "Settings", "create_app"]
