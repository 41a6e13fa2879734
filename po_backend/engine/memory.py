"""Measuring peak memory of a piece of work, on CPU (process RSS high-water mark) or CUDA, and
keeping the start-up profile run's measurement for later starts."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from po_backend.core.cpu import cpu_flags, cpu_model
from po_backend.core.fs import file_lock, private_cache_dir, write_atomic

log = logging.getLogger(__name__)

# Where measured profiles live: `$PREFILLONLY_MEMORY_CACHE`, else `memory/` under the cache root
# (test runs keep their throwaway profiles apart, as they do the JCT's).
MEMORY_CACHE_ENV = "PREFILLONLY_MEMORY_CACHE"

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_bytes(device: torch.device) -> int:
    """Memory the process could still use: on CUDA the device's free memory plus the blocks torch's
    caching allocator holds without using (freed tensors it keeps for reuse: the driver counts them
    as used, yet they are this process's to fill); elsewhere MemAvailable of the machine."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(free) + max(0, int(cached))
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_bytes() -> int:
    """The machine's RAM (MemTotal)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def default_budget(device: torch.device) -> int:
    """The memory budget when none is given: 85% of what is available on CUDA; on a CPU a quarter
    of the machine's RAM, or what is available if less. RAM rather than what happens to be free
    at start, so two processes given the same arguments on one machine size the same pool."""
    if device.type == "cuda":
        return int(available_bytes(device) * 0.85)
    return min(total_bytes() // 4, available_bytes(device))


def release_free_memory() -> None:
    """Collect garbage and hand glibc's free heap pages back to the OS, so memory freed by earlier
    work is not silently reused inside a measured block (which would hide it from the peak)."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def rss_bytes() -> int:
    """Resident set size of this process now (0 where /proc is missing)."""
    return _status_bytes("VmRSS") or 0


def _reset_hwm() -> bool:
    """Linux: writing 5 to clear_refs resets VmHWM (peak RSS) to the current RSS. True if it did."""
    try:
        _CLEAR_REFS.write_text("5")
    except OSError:
        return False
    hwm, rss = _status_bytes("VmHWM"), _status_bytes("VmRSS")
    return hwm is not None and rss is not None and hwm <= rss + (1 << 20)  # within 1 MiB of the reset


class PeakMemory:
    """`with PeakMemory(device) as pm: work()` then `pm.peak` = bytes above the level at entry
    (weights and libraries are in the baseline, so on CPU this is the work's activation memory).

    CUDA: the allocator's peak statistics (`method` "cuda-allocator"). CPU: the kernel's RSS
    high-water mark, reset through /proc/self/clear_refs and read back from VmHWM (exact, no
    overhead; `method` "clear_refs"); where that is refused, a thread samples the RSS every
    `interval` seconds (`method` "sampling"; may miss spikes shorter than that). Freed memory that
    the allocator kept from earlier work can be reused without raising RSS, so on CPU this can
    under-count; callers that size budgets combine it with an analytic bound.
    """

    def __init__(self, device: torch.device | str = "cpu", interval: float = 0.001) -> None:
        self.device = torch.device(device)
        self.interval = interval
        self.peak = 0
        self.base = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._max = 0

    @property
    def peak_bytes(self) -> int:
        return self.peak

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            self.method = "cuda-allocator"
            return self
        release_free_memory()
        if _reset_hwm():
            self.method = "clear_refs"
            self.base = rss_bytes()
        else:
            self.method = "sampling"
            self.base = self._max = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.base
            return
        if self.method == "clear_refs":
            peak = _status_bytes("VmHWM") or rss_bytes()
        else:
            self._stop.set()
            assert self._thread is not None, "sampling thread was not started"
            self._thread.join()
            peak = max(self._max, rss_bytes())
        self.peak = max(0, peak - self.base)


@functools.cache
def _engine_source_digest() -> str:
    """The engine's code (Python and kernel sources): a change to the forward may change its
    memory, so a profile measured by other code is never reused. Read once per process: the
    files a process imported do not change under it."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(p for p in root.rglob("*") if p.suffix in {".py", ".cpp", ".h"}):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def profiled_peaks(key: dict[str, Any], measure: Callable[[], list[int]]) -> list[int]:
    """The activation peaks of the start-up profile run, measured once and kept in
    MEMORY_CACHE_ENV's folder. The peak depends on shapes, dtypes, the forward's code, torch and the
    machine, never on the weights' values, so `key` names those (this adds the code, torch, the
    CPU and the thread count); a later start, or another worker of the machine, reads the file
    instead of running the forwards again. Measuring takes an OS file lock, so workers starting
    together measure once; a fresh process also measures best (no freed memory to reuse)."""
    full = {**key, "source": _engine_source_digest(), "torch": torch.__version__}
    full |= {"cpu": cpu_model(), "flags": sorted(cpu_flags()), "threads": torch.get_num_threads()}
    digest = hashlib.sha256(json.dumps(full, sort_keys=True, default=str).encode()).hexdigest()[:20]
    path = private_cache_dir("memory", what="memory profiles", env=MEMORY_CACHE_ENV) / f"{digest}.json"

    def stored() -> list[int] | None:
        try:
            peaks = json.loads(path.read_text())["peaks"]
        except (OSError, ValueError, KeyError, TypeError):
            return None  # absent, or unreadable: measured again and rewritten
        return peaks if isinstance(peaks, list) and all(isinstance(p, int) for p in peaks) else None

    peaks = stored()
    if peaks is not None:
        log.info("memory profile loaded from %s", path)
        return peaks
    with file_lock(path.with_suffix(".lock"), "another process is measuring this memory profile: waiting"):
        peaks = stored()
        if peaks is None:
            peaks = measure()
            write_atomic(path, json.dumps({"key": full, "peaks": peaks}, indent=1, default=str))
    return peaks
