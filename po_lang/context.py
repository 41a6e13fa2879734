"""The current backend: the one piece of module state in po_lang.

Classifiers without their own `backend=` use it at call time. It starts unset and becomes
`Local("embedded")` on first use (building that costs nothing until a request is scored).
`set_backend` replaces it for the process; `using` swaps it for a `with` block. Neither is
thread-safe against concurrent swaps: set the backend once, before starting threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from po_lang.backends import Backend
from po_lang.local import Local

_current: Backend | None = None


def set_backend(backend: Backend) -> None:
    global _current
    _check(backend)
    _current = backend


def get_backend() -> Backend:
    global _current
    if _current is None:
        _current = Local("embedded")
    return _current


@contextmanager
def using(backend: Backend) -> Iterator[Backend]:
    """`with po.using(po.Remote(url)): ...` scores with `backend` inside the block."""
    global _current
    _check(backend)
    previous = _current
    _current = backend
    try:
        yield backend
    finally:
        _current = previous


def _check(backend: object) -> None:
    if not isinstance(backend, Backend):
        raise TypeError(
            f"{type(backend).__name__} is not a backend (needs tokenize, chat_template and score); "
            "use po.Local(...), po.Remote(url) or po.Fake()"
        )
