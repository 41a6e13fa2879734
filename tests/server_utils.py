"""Test helpers: our real server in a subprocess on a free loopback port, and an import shim for
SGLang's frontend."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from po_lang.sglang_shim import import_sglang_frontend

REPO_ROOT = Path(__file__).resolve().parent.parent


def error_message(resp: httpx.Response) -> str:
    """The message of either of SGLang's error shapes (flat on /v1/*, nested on native routes)."""
    body = resp.json()
    return str(body["error"]["message"] if "error" in body else body["message"])


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m po_backend.entrypoints.launch_server ...` on 127.0.0.1; `start()` returns at once so several
    servers can boot in parallel, `wait_ready()` polls /health."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "po_backend.entrypoints.launch_server", "--host", "127.0.0.1"]
        self.args += ["--port", str(self.port), *args]
        # One thread each: several servers and the test process share two cores.
        # Tiny-model servers profile their JCT model and persist it under the cache root: keep
        # that in a temp dir rather than littering the user's ~/.cache with throwaway profiles.
        self._cache = tempfile.TemporaryDirectory(prefix="po-test-cache-")
        self.env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PREFILLONLY_CACHE": self._cache.name,
            **(env or {}),
        }
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
        self._cache.cleanup()


# ---- SGLang frontend -------------------------------------------------------------------------


def sglang_frontend_or_reason() -> tuple[Any, str]:
    """(frontend, "") or (None, why it cannot be used) for pytest.skip."""
    try:
        return import_sglang_frontend(), ""
    except Exception as e:  # ImportError, or a newer sglang whose frontend imports differ
        return (
            None,
            f"SGLang frontend unavailable ({type(e).__name__}: {e}); pip install --no-deps sglang==0.5.23",
        )
