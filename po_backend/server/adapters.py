"""Which LoRA adapter a call runs with: SGLang's `lora_path` on native routes, or a loaded
adapter's name as `model` on OpenAI / vLLM-shaped routes (`Runtime.run` applies it to every
request of the call); and the loaded adapters as the routes list them (torch-free)."""

from __future__ import annotations

from typing import Any

from po_backend.server.errors import bad


def registry(service: Any) -> Any:
    """The engine's `LoRARegistry`, or None (LoRA off, or a scorer without adapters)."""
    return getattr(service, "loras", None)


def adapters(service: Any) -> dict[str, str]:
    """Loaded adapters, name -> path."""
    reg = registry(service)
    return {a.name: a.path for a in reg.adapters()} if reg is not None else {}


def adapter_of(service: Any, body: Any) -> str | None:
    """The adapter a call's body asks for: `lora_path` (SGLang: a loaded name or its path; a
    list, one per prompt, must name one adapter) or a loaded adapter's name as `model`; None: the
    base model. A name not loaded is left for the engine to refuse (400, naming those loaded)."""
    if not isinstance(body, dict):
        return None
    path = body.get("lora_path")
    if isinstance(path, list):
        named = {p for p in path if p is not None}
        if len(named) > 1 or (named and None in path):
            raise bad(f"lora_path names several adapters {sorted(map(str, named))}: one adapter per call")
        path = next(iter(named), None)
    if path is None and not isinstance(body.get("model"), str):
        return None
    loaded = adapters(service)
    if path is not None:
        if not isinstance(path, str):
            raise bad("lora_path must be a string (an adapter's name or path) or a list of them")
        by_path = {p: n for n, p in loaded.items()}
        return path if path in loaded else by_path.get(path, path)
    model = body["model"]
    return model if model in loaded else None
