"""Operations endpoints: `/health` (liveness, open without the API key), `/health_generate` (a
one-token forward through the loop) and Prometheus `/metrics`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from po_backend.request import ScoreRequest
from po_backend.server.runtime import RuntimeDep

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request, rt: RuntimeDep) -> Response:
    await rt.run(request, [ScoreRequest((0,), ())])
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(rt: RuntimeDep) -> Response:
    return Response(generate_latest(rt.metrics.registry), media_type=CONTENT_TYPE_LATEST)
