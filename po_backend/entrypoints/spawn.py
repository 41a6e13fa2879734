"""Child processes that serve HTTP: a free loopback port, waiting until a URL answers, and a server
process started, waited for and stopped. One helper for `launch_cluster`, the benchmarks and the
tests, so they all wait the same way (poll the URL, fail at once when the child exits)."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

log = logging.getLogger(__name__)

# Set by whoever starts a server (this module, launch_cluster) to "PID" or "PID:main" (started
# from the parent's main thread): the server then dies with that parent (`die_with_parent`).
PARENT_PID_ENV = "PREFILLONLY_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` for a child that must not outlive this process (see `die_with_parent`)."""
    main = threading.current_thread() is threading.main_thread()
    return {**env, PARENT_PID_ENV: f"{os.getpid()}{':main' if main else ''}"}


def die_with_parent() -> None:
    """Exit (SIGKILL) when the process that started this one dies, as SGLang's servers do: a
    worker whose launcher was killed must not keep serving, re-parented to init, with the API key
    in its environment. Linux's PR_SET_PDEATHSIG fires when the parent *thread* that started us
    exits, so it is used only when that was the parent's main thread; a watchdog thread also
    polls getppid(), which changes once the parent is gone. No-op without $PREFILLONLY_PARENT_PID;
    the variable is removed, so our own children never read their grandparent's pid."""
    raw = os.environ.pop(PARENT_PID_ENV, "")
    pid, _, how = raw.partition(":")
    if not pid.isdigit():
        return
    parent = int(pid)
    if how == "main" and sys.platform == "linux":
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the watchdog below still works
    if os.getppid() != parent:  # it died before we could ask to follow it
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.error("the process that started this server (pid %d) is gone: exiting", parent)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="po-parent-watch", daemon=True).start()


class ChildExitedError(RuntimeError):
    """A child process that was to serve exited first."""


class NotReadyError(RuntimeError):
    """The URL did not answer 200 before the deadline."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def wait_until(
    url: str,
    procs: Sequence[subprocess.Popen[bytes]] = (),
    timeout: float = 600.0,
    *,
    headers: Mapping[str, str] | None = None,
    interval: float = 0.2,
    client: httpx.Client | None = None,
) -> None:
    """Until `url` answers 200; a process of `procs` exiting first, or the deadline, is an error.
    One HTTP client polls (`client`, or one made for this wait): a client per poll builds an SSL
    context each time, tens of milliseconds of CPU, beside the server starting on the same cores."""
    if client is None:
        with httpx.Client(timeout=2.0) as own:
            return wait_until(url, procs, timeout, headers=headers, interval=interval, client=own)
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if p.poll() is not None:
                raise ChildExitedError(f"{str(p.args)[:160]} exited with {p.returncode}")
        try:
            if client.get(url, timeout=2.0, headers=dict(headers or {})).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline:
            raise NotReadyError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(interval)


def stop(procs: Sequence[subprocess.Popen[bytes]], timeout: float = 60.0) -> None:
    """SIGTERM to every running one, then wait; whatever outlives `timeout` is killed."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class ServerProcess:
    """A command that serves HTTP at `url`, its output kept in a temporary file. `start()` returns
    at once (several servers can boot side by side), `wait_ready()` polls `health_path`, `stop()`
    drains it with SIGTERM (killed after `stop_timeout`)."""

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        *,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        health_path: str = "/health",
        log: IO[bytes] | None = None,
    ) -> None:
        self.command = list(command)
        self.url = url
        self.env = dict(os.environ if env is None else env)
        self.cwd = Path(cwd) if cwd is not None else None
        self.health_path = health_path
        self._log = log if log is not None else tempfile.TemporaryFile()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerProcess:
        # A test worker or benchmark that crashes takes its servers with it.
        self.proc = subprocess.Popen(
            self.command, cwd=self.cwd, env=child_env(self.env), stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    def log_text(self, last: int = 4000) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-last:]

    def wait_ready(self, timeout: float = 600.0, headers: Mapping[str, str] | None = None) -> ServerProcess:
        assert self.proc is not None, "start() first"
        try:
            wait_until(self.url + self.health_path, [self.proc], timeout, headers=headers)
        except RuntimeError as e:
            self.stop()
            raise RuntimeError(f"{e}; its output ends:\n{self.log_text()}") from None
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None:
            stop([self.proc], timeout)

    def __enter__(self) -> ServerProcess:
        """Started and ready for the `with` block, stopped after it."""
        return self.start().wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()
