"""Measuring peak memory of a piece of work, on CPU (process RSS high-water mark) or CUDA."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from pathlib import Path

import torch

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
    """Memory the process could still use: free GPU memory, or MemAvailable of the machine."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def release_free_memory() -> None:
    """Collect garbage and hand glibc's free heap pages back to the OS, so memory freed by earlier
    work is not silently reused inside a measured block (which would hide it from the peak)."""
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """`with PeakMemory(device) as pm: work()` then `pm.peak` = bytes above the level at entry.

    CPU: resets the kernel's RSS high-water mark (clear_refs 5) and reads VmHWM. Freed memory
    that the allocator kept from earlier work can be reused without raising RSS, so on CPU this
    can under-count; callers that size budgets combine it with an analytic bound.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self.supported = True

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            release_free_memory()
            try:
                _CLEAR_REFS.write_text("5")
            except OSError:
                self.supported = False
            self._base = _status_bytes("VmRSS") or 0
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            hwm = _status_bytes("VmHWM") if self.supported else None
            self.peak = max(0, (hwm or 0) - self._base)
