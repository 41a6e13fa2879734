"""`create_app`: one FastAPI app over one scoring service, assembled from the API modules' routers, the
error handlers and the middleware."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI
from starlette.middleware.trustedhost import TrustedHostMiddleware

from po_backend.server import admin, embeddings, lora, openai, rerank, scoring, sglang_native, tokenizer
from po_backend.server.args import ServerArgs
from po_backend.server.context import VERSION, Runtime
from po_backend.server.errors import add_exception_handlers
from po_backend.server.middleware import (
    ApiKeyMiddleware,
    BodyLimitMiddleware,
    ConcurrencyLimitMiddleware,
    MetricsMiddleware,
)
from po_backend.server.service import ScoringService

ROUTERS = (
    admin.router,
    sglang_native.router,
    tokenizer.router,
    openai.router,
    scoring.router,
    rerank.router,
    embeddings.router,
    lora.router,
)


def create_app(service: ScoringService, args: ServerArgs) -> FastAPI:
    """The FastAPI app over `service`. `service.shutdown()` runs when the app stops. ValueError
    for settings this model cannot serve (a rerank preset it cannot use)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(service.shutdown)
        if runtime.tracing is not None:
            await asyncio.to_thread(runtime.tracing.shutdown)

    app = FastAPI(title="PrefillOnly", version=VERSION, lifespan=lifespan)
    runtime = app.state.runtime = Runtime(service, args)
    rerank.check_preset(runtime)  # a preset that cannot serve this model fails here, not per call
    add_exception_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    # From the routers themselves: FastAPI may keep an included router as one opaque route.
    routes = [*app.routes, *(r for router in ROUTERS for r in router.routes)]
    paths = {getattr(r, "path") for r in routes if hasattr(r, "path")}  # noqa: B009 (Starlette BaseRoute has no `path`)
    posts = frozenset(getattr(r, "path") for r in routes if "POST" in (getattr(r, "methods", None) or ()))  # noqa: B009
    # Each add wraps the previous: metrics end up outermost (401s and 413s are counted too), then
    # the Host check and auth (400 / 401 before a body is read), the limit of calls in flight
    # (counting authorized calls only), then the body limit around the endpoints.
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_body_bytes, posts=posts)
    app.add_middleware(ConcurrencyLimitMiddleware, max_requests=args.max_concurrent_requests)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, admin_key=args.admin_api_key)
    if args.allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(args.allowed_hosts), www_redirect=False)
    app.add_middleware(MetricsMiddleware, metrics=runtime.metrics, paths=paths)
    endpoint = args.traces_endpoint
    if endpoint:  # outermost: a call's span covers everything the server does for it
        from po_backend.server.tracing import Tracing

        runtime.tracing = Tracing(endpoint, args.model_name)
        app.add_middleware(runtime.tracing.middleware)
    return app
