"""PrefillOnly engine: prefill-only scoring with hybrid prefilling and a radix prefix cache.

Exports resolve lazily (PEP 562): `import po_backend.request`, `.scheduler` or `.jct` must work on a
machine without torch (a router, a client, the simulator), so importing the package itself must not
import the engine.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Engine": "po_backend.engine",
    "ScoreRequest": "po_backend.request",
    "ScoreResult": "po_backend.request",
    "CapacityError": "po_backend.errors",
    "EmptyPromptError": "po_backend.errors",
    "InvalidRequestError": "po_backend.errors",
    "InvalidTokenError": "po_backend.errors",
    "ModelNotFoundError": "po_backend.errors",
    "OverloadedError": "po_backend.errors",
    "PrefillOnlyError": "po_backend.errors",
    "PromptTooLongError": "po_backend.errors",
    "UnsupportedModelError": "po_backend.errors",
}

__all__ = [
    "CapacityError",
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
    from po_backend.engine import Engine
    from po_backend.errors import (
        CapacityError,
        EmptyPromptError,
        InvalidRequestError,
        InvalidTokenError,
        ModelNotFoundError,
        OverloadedError,
        PrefillOnlyError,
        PromptTooLongError,
        UnsupportedModelError,
    )
    from po_backend.request import ScoreRequest, ScoreResult


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'po_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
