"""Typed errors. Every rejection names the problem; the server maps these to HTTP 4xx/503."""

from __future__ import annotations


class PrefillOnlyError(Exception):
    """Base class of every error the engine raises on purpose."""


class InvalidRequestError(PrefillOnlyError, ValueError):
    """The request itself is wrong (HTTP 400)."""


class EmptyPromptError(InvalidRequestError):
    pass


class PromptTooLongError(InvalidRequestError):
    pass


class InvalidTokenError(InvalidRequestError):
    """A prompt or label token id outside the vocabulary."""


class UnsupportedModelError(PrefillOnlyError):
    """An architecture or config feature our model code does not implement."""


class ModelNotFoundError(PrefillOnlyError, FileNotFoundError):
    pass


class DeviceUnavailableError(PrefillOnlyError, ValueError):
    """The device asked for (`--device`) does not exist here: CUDA on a CPU-only torch or
    machine, a GPU index beyond the visible ones, an unknown device name."""


class CapacityError(PrefillOnlyError):
    """The configured memory budget cannot hold what was asked (e.g. max_input_len at start)."""


class OverloadedError(PrefillOnlyError):
    """The engine's queue is full (HTTP 503)."""


class UnavailableError(PrefillOnlyError):
    """This worker takes no new work: it is shutting down (HTTP 503 with Retry-After: another
    worker, or this one restarted, can serve the request). Not an OverloadedError: nothing is
    full, and waiting on this worker will not help."""


class DrainingError(UnavailableError):
    """The server is shutting down and takes no more work."""


class LoopClosedError(UnavailableError):
    """The engine loop is shutting down and accepts no new requests."""


class CancelledError(PrefillOnlyError):
    """The request was cancelled before it ran."""


class CacheInUseError(PrefillOnlyError):
    """The cache cannot be flushed while running requests hold locked prefixes."""


class TaskMismatchError(InvalidRequestError):
    """A request or route the loaded model's task cannot answer (label tokens from a classifier,
    an embedding from a causal LM); the text names the routes the model serves (HTTP 400)."""


class LoRAError(InvalidRequestError):
    """A LoRA adapter that cannot be served (a missing file, an option we do not implement, a
    rank or shape that does not fit the base model, the adapter limit), or a request naming an
    adapter that is not loaded (HTTP 400); the text names what is wrong."""
