"""The filesystem helpers the caches share (converted models, memory and JCT profiles, the kernel
build): where they live, the one check every cache folder passes before anything is read from it
(owned by this user, writable by nobody else: a folder another user may write to could hold their
"converted model", profile or library), a lock for work one machine does once, and writes a
reader never sees half of. Torch-free."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_ENV = "PREFILLONLY_CACHE"


def cache_root() -> Path:
    """`$PREFILLONLY_CACHE`, else ~/.cache/prefillonly."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "prefillonly"


class UnsafeCacheError(RuntimeError):
    """A cache folder that another user owns or may write to."""


def private_dir(path: Path, what: str) -> Path:
    """Create `path` (mode 0700) or check it; `what` names what it holds, for the error. Raises
    UnsafeCacheError for a folder of another user's or one that others may write to."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise UnsafeCacheError(
            f"{path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}): refusing to use "
            f"it for {what}; set {CACHE_ENV} to a folder of your own"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheError(
            f"{path} is writable by other users (mode {stat.filemode(st.st_mode)}): refusing to use it "
            f"for {what}; chmod go-w {path} or set {CACHE_ENV}"
        )
    return path


def private_cache_dir(*parts: str, what: str, env: str | None = None) -> Path:
    """`$env` when set, else `cache_root()/parts...`; every folder from the root down checked
    with `private_dir` (a writable root would let anyone swap a checked folder below it)."""
    given = os.environ.get(env) if env else None
    if given:
        return private_dir(Path(given), what)
    path = private_dir(cache_root(), what)
    for part in parts:
        path = private_dir(path / part, what)
    return path


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


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary file beside `path`, renamed over it when the block ends without an error (and
    removed when it raises): a concurrent reader finds the old file or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path` through `replacing`."""
    with replacing(path) as tmp:
        tmp.write_text(text)
