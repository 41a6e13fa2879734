"""The user's cache folders (`$PREFILLONLY_CACHE` or `~/.cache/prefillonly`: model conversions,
the attention kernel build, JCT and memory profiles) and the one check every one of them passes
before anything is read from it: owned by this user and writable by nobody else. A folder that
another user may write to could hold their "converted model", profile or library, so it is
refused, never used. Torch-free."""

from __future__ import annotations

import os
import stat
from pathlib import Path

CACHE_ENV = "PREFILLONLY_CACHE"


class UnsafeCacheError(RuntimeError):
    """A cache folder that another user owns or may write to."""


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "prefillonly"


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
