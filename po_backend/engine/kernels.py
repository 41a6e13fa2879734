"""Building and loading the engine's own C++ CPU kernels (`csrc/`), shared by every kernel module
(`attention_cpu`, `int8_kernel`, `fused_cpu`).

`torch.utils.cpp_extension.load` compiles a kernel into a per-user cache (`$PREFILLONLY_CACHE` or
`~/.cache/prefillonly`, under `ext/<name>-<key>/`, the key a hash of the sources, the compiler and
its flags and torch's version) when an engine that will use it starts, never inside a request;
later processes load the cached library. Builds of one folder take turns under an OS file lock
(`fcntl.flock`, released when its holder dies; the wait is bounded by $PO_KERNEL_LOCK_TIMEOUT
seconds). A cache folder owned by another user or writable by others is refused: the library
loaded from it could be theirs. No install step compiles anything; each kernel module decides
what to do when a build fails (log once and fall back).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from po_backend.core.fs import cache_root, private_dir

# For the test suite only: a kernel built with portable stand-ins for intrinsics the CPU lacks,
# so its logic runs (slowly) on CPUs that cannot run the real one.
EMULATE_ENV = "PO_KERNEL_EMULATE"
LOCK_TIMEOUT_ENV = "PO_KERNEL_LOCK_TIMEOUT"
# Added to every kernel's cflags and ldflags: at::parallel_for is a header template whose
# `#pragma omp parallel` is compiled in the extension; without OpenMP every call runs on one thread.
OPENMP = ("-fopenmp",)
# A build takes ~10 s on one core; a wait this long means a stuck build, not a slow one.
_LOCK_TIMEOUT_S = 300.0


def emulated() -> bool:
    """Whether kernels are to be built with their portable stand-ins (tests only)."""
    return os.environ.get(EMULATE_ENV) == "1"


def compiler() -> str | None:
    """The C++ compiler torch will call ($CXX or c++), if there is one."""
    return shutil.which(os.environ.get("CXX", "c++"))


def build_key(sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str]) -> str:
    """What a library depends on: its sources, the compiler and its flags, torch's version. Two
    checkouts with different kernel sources (or torch versions) never share a library."""
    h = hashlib.sha256(b"".join(p.read_bytes() for p in sources))
    for part in (*cflags, *OPENMP, *ldflags, *OPENMP, os.environ.get("CXX", "c++"), torch.__version__):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:16]


def build_dir(name: str, key: str) -> Path:
    return cache_root() / "ext" / f"{name}-{key}"


def is_built(name: str, folder: Path) -> bool:
    """Whether `folder` already holds the library (a build would only load it)."""
    return (folder / f"{name}.so").is_file()


@contextlib.contextmanager
def build_lock(folder: Path, timeout: float) -> Iterator[None]:
    """An exclusive OS lock on the build folder (released by the OS when its holder dies, so a
    killed build never leaves a lock behind), waited for at most `timeout` seconds."""
    fd = os.open(folder / ".po_build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held the kernel build lock in {folder} for more than "
                        f"{timeout:.0f} s ({LOCK_TIMEOUT_ENV} sets the wait)"
                    ) from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _ninja_on_path() -> None:
    """torch builds with the `ninja` found on PATH; a venv's pip-installed ninja (a declared
    dependency) is not on PATH unless the venv is activated, so add its directory."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def build_and_load(
    name: str, sources: Sequence[Path], cflags: Sequence[str], ldflags: Sequence[str], folder: Path, what: str
) -> None:
    """Compile (first time) and load the library `name` from `folder`, which registers its
    operators. Raises on any failure (a compiler error, a missing
    header, ninja absent, a held lock, an unsafe folder): the caller logs it and falls back. The
    caller loads a library at most once per process: a second copy registering the same operators
    aborts the interpreter."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    for f in (cache_root(), folder.parent, folder):
        private_dir(f, what)
    with build_lock(folder, float(os.environ.get(LOCK_TIMEOUT_ENV, _LOCK_TIMEOUT_S))):
        # torch's own lock file, left by a build killed midway, makes torch wait without a
        # timeout; under our lock no other build of this folder runs, so it is stale.
        (folder / "lock").unlink(missing_ok=True)
        cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            extra_cflags=[*cflags, *OPENMP],
            extra_ldflags=[*ldflags, *OPENMP],
            build_directory=str(folder),
            is_python_module=False,
            verbose=False,
        )


def load(
    name: str,
    sources: Sequence[Path],
    cflags: Sequence[str],
    ldflags: Sequence[str],
    folder: Path,
    *,
    registered: Callable[[], bool],
    what: str,
    fallback: str,
    log: logging.Logger,
) -> bool:
    """Build (first time) and load a kernel module's library; False, with one warning on the
    module's `log` saying what runs instead (`fallback`), if there is no compiler or anything
    fails. Each module calls it at most once per process (behind `functools.cache`)."""
    if registered():
        return True
    if compiler() is None:
        log.warning("no C++ compiler: %s", fallback)
        return False
    try:
        if not is_built(name, folder):
            log.info("building %s once into %s (about 10-20 s)", what, folder)
        build_and_load(name, sources, cflags, ldflags, folder, what)
    except Exception as e:  # a compiler error, a missing header, ninja absent, a lock, an unsafe dir
        log.warning("%s is unavailable; %s: %s", what, fallback, e)
        return False
    return registered()
