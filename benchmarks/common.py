"""Helpers shared by the benchmarks: machine facts, GEMM peak, analytic FLOPs, peak-RSS measurement
(po_backend.memory's, re-exported), fresh-subprocess runs and small table/fit utilities. Imports
transformers only inside machine_info (for its version)."""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from po_backend.config import ModelConfig, cpu_model
from po_backend.memory import PeakMemory, release_free_memory, rss_bytes  # noqa: F401 - re-exported

MiB = 1 << 20
GiB = 1 << 30
RESULT_MARKER = "@@RESULT "  # a child prints exactly one line starting with this, then JSON
REPO_ROOT = Path(__file__).resolve().parent.parent
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- machine --------------------------------------------------------------------------------------


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:\s*(.*)$", text, re.M)
    return set(m.group(1).split()) if m else set()


def has_fast_bf16(flags: set[str] | None = None) -> bool:
    """AVX512-bf16 or AMX: bf16 GEMMs run natively. Without them (e.g. AVX2-only) oneDNN emulates
    bf16 and it is several times slower than fp32."""
    flags = cpu_flags() if flags is None else flags
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def mem_available_bytes() -> int:
    try:
        m = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        if m:
            return int(m.group(1)) * 1024
    except OSError:
        pass
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        return 8 * GiB


def machine_info() -> dict[str, Any]:
    flags = cpu_flags()
    import transformers  # noqa: PLC0415 - only for its version string

    return {
        "cpu": cpu_model(),
        "arch": platform.machine(),
        "flags": {
            f: f in flags
            for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
        },
        "fast_bf16": has_fast_bf16(flags),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_total_gib": round(_meminfo_kib("MemTotal") / (1 << 20), 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }


def _meminfo_kib(key: str) -> int:
    try:
        m = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        return int(m.group(1)) if m else 0
    except OSError:
        return 0


def gemm_peak_gflops(dtype: torch.dtype, size: int = 2048, min_seconds: float = 1.0) -> float:
    """Best achieved GFLOP/s of a square GEMM (size^3 multiply-adds, 2 FLOPs each) on this machine
    with the default thread count: the roof the model's GEMMs can reach.

    The operand layout is nn.Linear's, x @ W.t() with W stored [out, in]: that is what every model
    GEMM does, and on CPUs without native bf16 a plain row-major `a @ b` in bf16 takes a ~10x
    slower path than the transposed-weight one, so the layout matters for the roof."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(size, size, generator=gen).to(dtype)
    w = torch.randn(size, size, generator=gen).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.matmul(x, w.t(), out=out)  # warm-up: thread pool, oneDNN kernel selection
    best = float("inf")
    start = time.perf_counter()
    reps = 0
    while reps < 2 or (time.perf_counter() - start < min_seconds and reps < 50):
        t = time.perf_counter()
        torch.matmul(x, w.t(), out=out)
        best = min(best, time.perf_counter() - t)
        reps += 1
    return 2.0 * size**3 / best / 1e9


def _cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) jiffies of all CPUs since boot, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    # `nice` time (fields[1]) counts as idle: niced background work (tests, builds) yields the
    # cores to a benchmark at normal priority, so it neither slows it much nor should stall it.
    busy = sum(fields[:8]) - idle - fields[1]
    return busy, sum(fields[:8])


def _own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


class CpuShare:
    """CPU cores used during a block by this process (`own_cores`) and by everything else on the
    machine (`other_cores`). Benchmarks on a shared machine report both: a forward that got fewer
    cores than it has threads, or ran while others were busy, is slower than the code is.

        with CpuShare() as cpu:
            work()
        cpu.own_cores, cpu.other_cores
    """

    def __enter__(self) -> CpuShare:
        self._t = time.perf_counter()
        self._own = _own_cpu_seconds()
        self._sys = _cpu_jiffies()
        self.own_cores = self.other_cores = math.nan
        return self

    def __exit__(self, *exc: object) -> None:
        wall = max(time.perf_counter() - self._t, 1e-9)
        own = _own_cpu_seconds() - self._own
        self.own_cores = own / wall
        end = _cpu_jiffies()
        if self._sys is not None and end is not None:
            busy = (end[0] - self._sys[0]) / os.sysconf("SC_CLK_TCK")
            self.other_cores = max(0.0, busy - own) / wall


def busy_other_cores(seconds: float = 1.0) -> float:
    """Cores kept busy by other processes over the next `seconds` (this process sleeps)."""
    with CpuShare() as cpu:
        time.sleep(seconds)
    return cpu.other_cores if not math.isnan(cpu.other_cores) else 0.0


def wait_for_quiet(max_wait: float, threshold: float = 0.3, probe: float = 2.0) -> tuple[float, float]:
    """Wait until other processes use fewer than `threshold` cores (or `max_wait` seconds pass).
    Returns (seconds waited, other cores at the last probe)."""
    start = time.perf_counter()
    while True:
        others = busy_other_cores(probe)
        waited = time.perf_counter() - start
        if others < threshold or waited >= max_wait:
            return waited, others


# ---- model arithmetic -----------------------------------------------------------------------------


def layer_matmul_params(cfg: ModelConfig) -> int:
    """Weights one token multiplies per layer: q, k, v, o projections and gate, up, down."""
    qkv = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size)
    o = cfg.q_size * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return qkv + o + mlp


def prefill_flops(cfg: ModelConfig, n: int, logit_rows: int = 1) -> float:
    """Useful FLOPs of one causal prefill of `n` tokens (the same count for every configuration, so
    TFLOP/s compare like tokens/s; work a configuration wastes, like (a)'s LM head over all n rows,
    is not credited).

      linear layers:  2 * P * n                    P = non-embedding matmul weights of all layers
                                                   (2 FLOPs = one multiply + one add per weight)
      attention:      2 * 2 * (n^2 / 2) * H * d * L
                      QK^T and PV each cost 2*n*n*d per head on the full square; the causal mask
                      leaves half of it (n^2/2 query-key pairs); H query heads, head_dim d, L layers
      LM head:        2 * hidden * vocab * logit_rows   (1 row: only the next-token distribution)

    Norms, rotary, softmax and SiLU are elementwise (well under 1% here) and are not counted.
    """
    linear = 2.0 * cfg.num_layers * layer_matmul_params(cfg) * n
    attention = 2.0 * 2.0 * (n * n / 2.0) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    head = 2.0 * cfg.hidden_size * cfg.vocab_size * logit_rows
    return linear + attention + head


# ---- peak memory ----------------------------------------------------------------------------------


# One implementation, shared with the engine's profile run: po_backend.memory.PeakMemory (kernel
# RSS high-water mark via clear_refs, sampling fallback). `PeakRSS()` is the CPU spelling the
# benchmarks use (`p.peak_bytes`, `p.method`).
malloc_trim = release_free_memory


class PeakRSS(PeakMemory):
    """`with PeakRSS() as p: work()` then `p.peak_bytes`: PeakMemory on the CPU."""

    def __init__(self, interval: float = 0.001, force_sampling: bool = False) -> None:
        super().__init__("cpu", interval=interval, force_sampling=force_sampling)


# ---- subprocess runs ------------------------------------------------------------------------------


@dataclass
class ChildOutcome:
    status: str  # ok | failed | timeout | oom
    result: dict[str, Any] | None
    wall_s: float
    detail: str = ""


def run_child(args: Sequence[str], timeout: float, env: dict[str, str] | None = None) -> ChildOutcome:
    """Run `python <args>` in a fresh interpreter; it must print one RESULT_MARKER + JSON line."""
    full_env = {**os.environ, **(env or {})}
    full_env.setdefault("PYTHONPATH", str(REPO_ROOT))
    t = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
            cwd=REPO_ROOT,
        )
    except subprocess.TimeoutExpired:
        return ChildOutcome("timeout", None, time.perf_counter() - t, f"no result within {timeout:.0f} s")
    wall = time.perf_counter() - t
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return ChildOutcome("ok", json.loads(line[len(RESULT_MARKER) :]), wall)
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    # SIGKILL (-9) with no traceback is what the kernel OOM killer leaves behind.
    status = "oom" if proc.returncode in (-9, 137) or "MemoryError" in proc.stderr else "failed"
    return ChildOutcome(status, None, wall, f"exit {proc.returncode}: " + " | ".join(tail))


def emit_result(result: dict[str, Any]) -> None:
    print(RESULT_MARKER + json.dumps(result), flush=True)


# ---- fits and tables ------------------------------------------------------------------------------


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares y = c0 + c1 * x (exact through two points)."""
    assert len(xs) == len(ys) and len(xs) >= 2, f"need >= 2 points to fit a line, got {len(xs)}"
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    assert sxx > 0, "points must have at least two distinct x"
    c1 = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - c1 * mx, c1


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
