"""Typed errors of the DSL. Each message names the problem and, where there is one, the fix."""

from __future__ import annotations


class PoLangError(Exception):
    """Base class of every error po_lang raises on purpose."""


class PromptError(PoLangError, ValueError):
    """A prompt is malformed (e.g. a shared segment after a non-shared one)."""


class LabelError(PoLangError, ValueError):
    """Labels cannot be compiled to distinct single next tokens (see `multi_token=True`)."""


class BackendError(PoLangError):
    """The backend rejected or failed one request; carries the backend's message."""


class BackendUnavailable(BackendError):
    """The backend cannot be reached or stays overloaded (connection refused, HTTP 503 / 429 after
    the retries): the whole backend is down, not one request bad. Batch jobs stop on it."""
