"""The filesystem helpers the caches share (converted models, memory and JCT profiles, the kernel
build): where they live, a lock for work one machine does once, and writes a reader never sees
half of. Torch-free."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "PREFILLONLY_CACHE"


def cache_root() -> Path:
    """`$PREFILLONLY_CACHE`, else ~/.cache/prefillonly."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "prefillonly"


@contextlib.contextmanager
def file_lock(path: Path, waiting: str) -> Iterator[None]:
    """An exclusive OS lock (fcntl.flock on `path`) for work that processes of one machine must
    do once (converting a model, measuring a profile): the others wait, logging `waiting`, and
    the kernel releases it when its holder exits, even killed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("%s (lock %s)", waiting, path)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def write_atomic(path: Path, text: str) -> None:
    """Write through a unique temporary file renamed over `path`: a concurrent reader finds the
    old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
