"""Operations endpoints: `/health` (liveness) and `/ready` (readiness), open without the API key
for load balancers and orchestrators; `/health_generate` (a one-token forward through the loop);
Prometheus `/metrics`."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from po_backend.core.request import ScoreRequest
from po_backend.server.body import BodyRoute
from po_backend.server.context import RuntimeDep

router = APIRouter(route_class=BodyRoute)


@router.get("/health")
async def health(rt: RuntimeDep) -> Response:
    """200 while the scoring loop runs; 503 once it died or the server is draining (a router
    then stops sending here)."""
    return Response(status_code=200 if rt.healthy() else 503)


@router.get("/ready")
async def ready(rt: RuntimeDep) -> Response:
    """200 when a call would be queued now: healthy and the queue has room."""
    stats = await asyncio.to_thread(rt.service.stats)
    room = float(stats.get("queued", 0) or 0) < rt.args.max_queue
    return Response(status_code=200 if rt.healthy() and room else 503)


@router.get("/health_generate")
async def health_generate(request: Request, rt: RuntimeDep) -> Response:
    await rt.run(request, [ScoreRequest((0,), ())])
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(rt: RuntimeDep) -> Response:
    # Off the event loop: the gauges read the loop's stats under its lock.
    body = await asyncio.to_thread(rt.metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
