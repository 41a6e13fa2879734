"""PrefillOnly engine: prefill-only scoring with hybrid prefilling and a radix prefix cache.

Exports resolve lazily (PEP 562): `import po_backend.core.request`, `.scheduler` or `.jct` must work on a
machine without torch (a router, a client, the simulator), so importing the package itself must not
import the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "po_backend.engine.engine",
    "ScoreRequest": "po_backend.core.request",
    "ScoreResult": "po_backend.core.request",
    "CapacityError": "po_backend.core.errors",
    "DeviceUnavailableError": "po_backend.core.errors",
    "EmptyPromptError": "po_backend.core.errors",
    "InvalidRequestError": "po_backend.core.errors",
    "InvalidTokenError": "po_backend.core.errors",
    "ModelNotFoundError": "po_backend.core.errors",
    "OverloadedError": "po_backend.core.errors",
    "PrefillOnlyError": "po_backend.core.errors",
    "PromptTooLongError": "po_backend.core.errors",
    "UnsupportedModelError": "po_backend.core.errors",
}

__all__ = [
    "CapacityError",
    "DeviceUnavailableError",
    "EmptyPromptError",
    "Engine",
    "InvalidRequestError",
    "InvalidTokenError",
    "ModelNotFoundError",
    "OverloadedError",
    "PrefillOnlyError",
    "PromptTooLongError",
    "ScoreRequest",
    "ScoreResult",
    "UnsupportedModelError",
]
assert sorted(__all__) == sorted(_EXPORTS), "__all__ and _EXPORTS must name the same things"

if TYPE_CHECKING:
    from po_backend.core.errors import (
        CapacityError,
        DeviceUnavailableError,
        EmptyPromptError,
        InvalidRequestError,
        InvalidTokenError,
        ModelNotFoundError,
        OverloadedError,
        PrefillOnlyError,
        PromptTooLongError,
        UnsupportedModelError,
    )
    from po_backend.core.request import ScoreRequest, ScoreResult
    from po_backend.engine.engine import Engine


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'po_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
