"""PrefillOnly engine: prefill-only scoring with hybrid prefilling and a radix prefix cache."""

from __future__ import annotations

from po_backend.engine import Engine, ScoreRequest, ScoreResult
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
