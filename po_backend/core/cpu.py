"""What the CPU is: its model name, its feature flags and whether it has fast bf16. Reads /proc/cpuinfo, which is why
it lives here and not in `config` (frozen records, no I/O)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

_CPUINFO = Path("/proc/cpuinfo")


@functools.cache
def _cpuinfo() -> str:
    """The kernel's CPU description, read once per process ("" where /proc is missing)."""
    try:
        return _CPUINFO.read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    """The CPU's model name (keys the persisted JCT profile; printed by benchmarks)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 "flags"; empty where /proc/cpuinfo has none, e.g. macOS)."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_fast_bf16() -> bool:
    """AVX512-bf16 or AMX make bf16 GEMMs ~3.5x faster than fp32 on CPU; without them bf16 is slow."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())
