"""Test helpers: our real server in a subprocess on a free loopback port, and an import shim for
SGLang's frontend."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from po_backend.entrypoints import spawn
from po_backend.entrypoints.spawn import free_port
from po_lang.sglang_shim import import_sglang_frontend

REPO_ROOT = Path(__file__).resolve().parent.parent


def error_message(resp: httpx.Response) -> str:
    """The message of either of SGLang's error shapes (flat on /v1/*, nested on native routes)."""
    body = resp.json()
    return str(body["error"]["message"] if "error" in body else body["message"])


class ServerProcess(spawn.ServerProcess):
    """`python -m po_backend.entrypoints.launch_server ...` on 127.0.0.1 and a free port."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "po_backend.entrypoints.launch_server", "--host", "127.0.0.1"]
        command += ["--port", str(self.port), *args]
        # One thread each: several servers and the test process share two cores.
        # Tiny-model servers profile their JCT model and persist it under the cache root: keep
        # that in a temp dir rather than littering the user's ~/.cache with throwaway profiles.
        self._cache = tempfile.TemporaryDirectory(prefix="po-test-cache-")
        full_env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PREFILLONLY_CACHE": self._cache.name,
            **(env or {}),
        }
        super().__init__(command, f"http://127.0.0.1:{self.port}", env=full_env, cwd=REPO_ROOT)
        self.args = command

    def wait_ready(self, timeout: float = 120.0, headers: Mapping[str, str] | None = None) -> ServerProcess:
        super().wait_ready(timeout, headers)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        super().stop(timeout)
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
