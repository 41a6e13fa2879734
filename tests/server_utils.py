"""Test helpers: our real server in a subprocess on a free loopback port, and an import shim for
SGLang's frontend."""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m po_backend.launch_server ...` on 127.0.0.1; `start()` returns at once so several
    servers can boot in parallel, `wait_ready()` polls /health."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "po_backend.launch_server", "--host", "127.0.0.1"]
        self.args += ["--port", str(self.port), *args]
        # One thread each: several servers and the test process share two cores.
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.TemporaryFile()

    def start(self) -> ServerProcess:
        self.proc = subprocess.Popen(
            self.args, cwd=REPO_ROOT, env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    def log_text(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def wait_ready(self, timeout: float = 120.0) -> ServerProcess:
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout:.0f}s:\n{self.log_text()[-4000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---- SGLang frontend shim ---------------------------------------------------------------------

# Imported by `sglang.lang` / `sglang.utils` at module level but used only for images (pybase64),
# notebooks (IPython.display), the async client (aiohttp) and launching SGLang's own server
# (msgspec): none is on the path of RuntimeEndpoint + select/gen.
_FRONTEND_ONLY_STUBS = {
    "IPython": {},
    "IPython.display": {"HTML": None, "display": None},
    "pybase64": {},
    "msgspec": {},
    "msgspec.structs": {},
    "aiohttp": {},
}


def import_sglang_frontend() -> types.SimpleNamespace:
    """SGLang's frontend language (`sgl.function`, `select`, `gen`, `RuntimeEndpoint`) from an
    sglang installed with `pip install --no-deps sglang==0.5.23`.

    `import sglang` would run sglang/__init__.py, which imports the SRT server runtime (orjson,
    torch-only helpers, transformers patches) that a client never uses. Instead a bare package
    module whose __path__ is the installed folder stands in for `sglang`, so its __init__ is
    skipped, and the handful of third-party modules the frontend imports without using on this
    path get empty stubs when they are not installed. Raises ImportError without sglang.
    """
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    if "sglang" not in sys.modules:
        pkg = types.ModuleType("sglang")
        pkg.__path__ = list(spec.submodule_search_locations)
        pkg.__spec__ = spec
        sys.modules["sglang"] = pkg
    for name, attrs in _FRONTEND_ONLY_STUBS.items():
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError:
            mod = types.ModuleType(name)
            mod.__dict__.update(attrs)
            sys.modules[name] = mod
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(sys.modules[parent], child, mod)
    api = importlib.import_module("sglang.lang.api")
    endpoint = importlib.import_module("sglang.lang.backend.runtime_endpoint")
    return types.SimpleNamespace(
        function=api.function,
        select=api.select,
        gen=api.gen,
        set_default_backend=api.set_default_backend,
        RuntimeEndpoint=endpoint.RuntimeEndpoint,
    )


def sglang_frontend_or_reason() -> tuple[Any, str]:
    """(frontend, "") or (None, why it cannot be used) for pytest.skip."""
    try:
        return import_sglang_frontend(), ""
    except Exception as e:  # ImportError, or a newer sglang whose frontend imports differ
        return (
            None,
            f"SGLang frontend unavailable ({type(e).__name__}: {e}); pip install --no-deps sglang==0.5.23",
        )
