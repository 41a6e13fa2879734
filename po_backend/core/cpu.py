"""What the CPU is: its model name, its feature flags and whether it has fast bf16. Reads /proc/cpuinfo, which is why
it lives here and not in `config` (frozen records, no I/O)."""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Literal

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
    """AVX512-bf16 or AMX run bf16 GEMMs in hardware, several times faster than fp32 on CPU; without
    them bf16 is emulated and slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & cpu_flags())


CpuClass = Literal["AMX", "AVX512-BF16", "AVX2-only", "other"]


def cpu_class(flags: frozenset[str] | None = None) -> CpuClass:
    """The class that decides `--dtype auto` and the attention kernel: AMX (bf16 GEMMs and SDPA on
    the AMX tiles), AVX512-BF16 without AMX (bf16 GEMMs on vdpbf16ps; SDPA's bf16 at fp32 speed,
    so the bf16 attention kernel), AVX2-only (bf16 emulated: fp32), other (no x86 flags)."""
    f = cpu_flags() if flags is None else flags
    if "amx_bf16" in f:
        return "AMX"
    if "avx512_bf16" in f:
        return "AVX512-BF16"
    if "avx2" in f:
        return "AVX2-only"
    return "other"
