"""LoRA adapters over HTTP: SGLang's `/load_lora_adapter` and `/unload_lora_adapter`, vLLM's
`/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (same bodies: `lora_name`, `lora_path`),
(which adapter a call runs with is `adapters.adapter_of`). A bad adapter is a 400 naming what is
wrong, at load; the engine checks the files, this module only routes (torch-free)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from po_backend.core.errors import LoRAError
from po_backend.server.adapters import adapters, registry
from po_backend.server.body import BodyRoute
from po_backend.server.context import Runtime, RuntimeDep
from po_backend.server.errors import bad
from po_backend.server.protocol import LoadLoRARequest, UnloadLoRARequest

router = APIRouter(route_class=BodyRoute)


def _enabled(rt: Runtime) -> Any:
    reg = registry(rt.service)
    if reg is None:
        raise LoRAError("LoRA is off on this server: start it with --enable-lora")
    return reg


async def _load(rt: Runtime, body: LoadLoRARequest) -> None:
    if body.lora_name == rt.args.model_name:
        raise bad(f"lora_name {body.lora_name!r} is the base model's name")
    # Reading the weights is file I/O and tensor copies: off the event loop.
    await asyncio.to_thread(_enabled(rt).load, body.lora_name, body.lora_path)


@router.post("/load_lora_adapter")
async def load_sglang(body: LoadLoRARequest, rt: RuntimeDep) -> Response:
    await _load(rt, body)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": adapters(rt.service)})


@router.post("/unload_lora_adapter")
async def unload_sglang(body: UnloadLoRARequest, rt: RuntimeDep) -> Response:
    _enabled(rt).unload(body.lora_name)
    return JSONResponse({"success": True, "error_message": "", "loaded_adapters": adapters(rt.service)})


@router.post("/v1/load_lora_adapter")
async def load_vllm(body: LoadLoRARequest, rt: RuntimeDep) -> Response:
    await _load(rt, body)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_vllm(body: UnloadLoRARequest, rt: RuntimeDep) -> Response:
    _enabled(rt).unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
