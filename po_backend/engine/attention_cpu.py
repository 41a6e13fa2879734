"""CPU attention in bf16 on the AVX512-BF16 dot-product units (issue 17), through a small C++
kernel (`csrc/attention_bf16.cpp`) built on first use, and the decision of when to use it.

Why: torch's CPU `scaled_dot_product_attention` spends its bf16 FLOPs in matrix units only where
oneDNN has AMX; on AVX512-BF16 CPUs without AMX (AMD EPYC) its bf16 runs at fp32 speed, and
attention is most of a long prefill. An earlier version of this module ran tiles of torch bf16
GEMMs with an fp32 online softmax: 2x SDPA here, but still far from the GEMM peak (Python per-op
cost, scores rounded to bf16 by the GEMM, elementwise passes over the score tiles). The kernel
keeps the scores in fp32 registers between the two dot-product passes.

Build: `torch.utils.cpp_extension.load` compiles the kernel into a per-user cache
(`$PREFILLONLY_CACHE` or `~/.cache/prefillonly`, under `ext/<torch version>/`) the first time a
bf16 attention runs on a CPU with avx512_bf16; later processes load the cached library. No
install step compiles anything: without a compiler, or if the build fails, one warning is logged
and attention stays on SDPA (`po_backend.engine.attention`).

Used for: bf16 on a CPU with avx512_bf16 and no AMX (with AMX, SDPA's own kernel uses AMX), head
dims that are multiples of 64. Everything else (fp32, AVX2-only CPUs, fp16, other devices)
keeps SDPA. `PO_CPU_ATTENTION=kernel|sdpa` overrides the choice (`kernel` still needs the CPU
and the build).

Contract (as `po_backend.engine.attention`): q [n, heads, d]; k, v [n, kv_heads, d] (the sequence's own
tokens, causal); a prefix prefix_k/v [p, kv_heads, d] that every query sees; strided views are
read in place (the runner's q/k/v are views of one packed buffer).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Literal

import torch
from torch import Tensor

from po_backend.core.cpu import cpu_flags  # a module global: tests patch it here

log = logging.getLogger(__name__)

CpuAttention = Literal["kernel", "sdpa"]
_ENV = "PO_CPU_ATTENTION"
_SOURCE = Path(__file__).parent / "csrc" / "attention_bf16.cpp"
_STALE_LOCK_S = 600.0  # a build takes ~10 s; a lock this old belongs to a dead process
_EMPTY_I32 = torch.empty(0, dtype=torch.int32)  # no item starts: plain causal
_NO_LSE = torch.empty(0, 0)  # the kernel's log-sum-exp output, when none is wanted


def choose(dtype: torch.dtype, device: torch.device, flags: frozenset[str] | None = None) -> CpuAttention:
    """Which attention the CPU runs for `dtype`: "kernel" (this module, if it builds) or "sdpa".

    The kernel only pays where bf16 dot-product units exist that SDPA leaves unused: bf16 on a CPU
    with AVX512-BF16 and no AMX. PO_CPU_ATTENTION=kernel|sdpa overrides (CPU, bf16 only: the
    kernel has no other dtype)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return "sdpa"
    forced = os.environ.get(_ENV, "auto")
    if forced not in ("auto", "kernel", "sdpa"):
        raise ValueError(f"{_ENV} must be auto, kernel or sdpa, got {forced!r}")
    f = cpu_flags() if flags is None else flags
    if "avx512_bf16" not in f:
        return "sdpa"  # the kernel's instructions do not exist here, whatever the override says
    if forced != "auto":
        return forced  # type: ignore[return-value]
    return "sdpa" if "amx_bf16" in f else "kernel"


def _build_dir() -> Path:
    env = os.environ.get("PREFILLONLY_CACHE")
    root = Path(env) if env else Path.home() / ".cache" / "prefillonly"
    # A library built against one torch must not be loaded by another.
    return root / "ext" / f"torch-{torch.__version__.replace('+', '-')}"


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


@functools.cache
def load_kernel() -> bool:
    """Build (first time) and load the kernel; False, with one warning, if that fails."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        log.warning("no C++ compiler: bf16 CPU attention stays on torch SDPA (slower)")
        return False
    try:
        from torch.utils import cpp_extension

        _ninja_on_path()
        build = _build_dir()
        build.mkdir(parents=True, exist_ok=True)
        # torch waits without a timeout while another process's build holds this lock; a build
        # killed midway leaves it behind, which would hang every later process here.
        lock = build / "lock"
        if lock.exists() and time.time() - lock.stat().st_mtime > _STALE_LOCK_S:
            log.warning("removing a stale build lock %s", lock)
            lock.unlink(missing_ok=True)
        if not (build / "po_attention_bf16.so").is_file():
            log.info("building the bf16 CPU attention kernel once into %s (about 10 s)", build)
        cpp_extension.load(
            name="po_attention_bf16",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-fopenmp", "-DNDEBUG"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build),
            is_python_module=False,
            verbose=False,
        )
    except Exception as e:  # a compiler error, a missing header, ninja absent, a locked dir
        log.warning("building the bf16 CPU attention kernel failed; attention stays on SDPA: %s", e)
        return False
    return hasattr(torch.ops.po_attn, "fwd")


@functools.cache
def _note_head_dim(d: int) -> None:
    log.info("bf16 CPU attention kernel: head dim %d is not a multiple of 64; attention runs on SDPA", d)


def supported(q: torch.Tensor) -> bool:
    """Whether the kernel can take these queries (device, dtype, head dim) and is built; where it
    would run but for the head dim, the reason is logged once."""
    if q.device.type != "cpu" or q.dtype != torch.bfloat16 or choose(q.dtype, q.device) != "kernel":
        return False
    if q.shape[-1] % 64:
        _note_head_dim(q.shape[-1])
        return False
    return load_kernel()


def _empty_kv(like: torch.Tensor) -> torch.Tensor:
    return like.new_empty(0, like.shape[1], like.shape[2])


def attend(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, scale: float, prefix: tuple[Tensor, Tensor] | None = None
) -> None:
    """Causal attention of one sequence after an optional prefix (its K, V), into out [n, heads * d]."""
    n, heads, d = q.shape
    if n == 0:
        return
    pk, pv = prefix if prefix is not None and prefix[0].shape[0] else (_empty_kv(k), _empty_kv(k))
    torch.ops.po_attn.fwd(q, pk, pv, k, v, _EMPTY_I32, out.view(n, heads, d), _NO_LSE, scale, False)


def attend_items(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    scale: float,
    bounds: list[tuple[int, int]],
    prefix: tuple[Tensor, Tensor],
) -> None:
    """Items sharing one cached prefix: item i (rows bounds[i]) attends to the whole prefix and
    causally to its own rows only. One kernel call per run of adjacent items (the runner's items
    are one run): each query's online softmax runs on from the prefix into its own item's keys,
    so there are no partial outputs to merge, and the prefix is packed once per call."""
    n, heads, d = q.shape
    prefix_k, prefix_v = prefix if prefix[0].shape[0] else (_empty_kv(k), _empty_kv(k))
    o3 = out.view(n, heads, d)
    run: list[tuple[int, int]] = []
    for a, b in [*bounds, (-1, -1)]:
        if run and a != run[-1][1]:  # flush a run of adjacent items
            lo, hi = run[0][0], run[-1][1]
            starts = torch.repeat_interleave(
                torch.tensor([x - lo for x, _ in run], dtype=torch.int32),
                torch.tensor([y - x for x, y in run]),
            )
            torch.ops.po_attn.fwd(
                q[lo:hi], prefix_k, prefix_v, k[lo:hi], v[lo:hi], starts, o3[lo:hi], _NO_LSE, scale, False
            )
            run = []
        if a < 0:
            break
        if not 0 <= a < b <= n:
            raise ValueError(f"item bounds must be non-empty ranges of the {n} rows, got {(a, b)}")
        run.append((a, b))


def lse_partial(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A partial attention with its log-sum-exp (`po_backend.engine.attention.LseAttention`): out
    [n, heads, d] fp32 and lse [n, heads] fp32. Causal: k/v are the queries' own tokens."""
    n, heads, d = q.shape
    out = torch.empty(n, heads, d, dtype=torch.float32)
    lse = torch.empty(n, heads, dtype=torch.float32)
    if n == 0:
        return out, lse
    empty = _empty_kv(k)
    if causal:
        torch.ops.po_attn.fwd(q, empty, empty, k, v, _EMPTY_I32, out, lse, scale, True)
    elif k.shape[0] == 0:
        out.zero_()
        lse.fill_(-torch.inf)
    else:
        torch.ops.po_attn.fwd(q, k, v, empty, empty, _EMPTY_I32, out, lse, scale, True)
    return out, lse
