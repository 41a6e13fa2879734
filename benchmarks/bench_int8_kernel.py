"""The blocked int8 GEMM (po_backend.engine.int8_kernel) against fp32 and the int8 libraries, in one run.

Per shape and thread count, timed in turns (one call of each op per round, `--rounds` rounds,
best-of kept and the per-round ratio to fp32's call of the same round): fp32 `torch.mm`, our
kernel on pre-quantized activations and pre-packed weights, our kernel with the activations'
quantization (`quantize_blocks`) included, torch.ao's dynamic int8 linear (fbgemm, activation
quantization included, one scale per tensor) and `torch._int_mm` (one scale per row; without
VNNI/AMX a scalar loop, so timed on `--int-mm-rows` rows only and marked so). Shapes: 2048^3 and
Qwen2.5-1.5B's projections (hidden 1536, intermediate 8960, 12 heads x 128, 2 kv heads) for
`--tokens` rows (random values, real shape). Also the activations' quantization alone: torch's
reference against the fused C++ pass.

    python -m benchmarks.bench_int8_kernel --out /tmp/int8_kernel.json
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import flags
from po_backend.engine import int8_kernel as ik

BLOCK = 32


def shapes(tokens: int) -> dict[str, tuple[int, int, int]]:
    """name: (m, k, n) of `x [m, k] @ w[n, k]^T`."""
    h, i, q, kv = 1536, 8960, 12 * 128, 2 * 128
    return {
        "2048^3": (2048, 2048, 2048),
        "1.5B qkv": (tokens, h, q + 2 * kv),
        "1.5B o_proj": (tokens, q, h),
        "1.5B gate_up": (tokens, h, 2 * i),
        "1.5B down": (tokens, i, h),
    }


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _ops(m: int, k: int, n: int, int_mm_rows: int) -> dict[str, tuple[int, Callable[[], Any]]]:
    """op: (rows it multiplies, the call)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) * 0.05
    out = torch.empty(m, n)
    xq, xs = ik.quantize_blocks(x, BLOCK)
    packed = ik.pack_weights(*ik.quantize_blocks(w, BLOCK), BLOCK)
    dyn = torch.ao.nn.quantized.dynamic.Linear(k, n, bias_=False, dtype=torch.qint8)
    dyn.set_weight_bias(
        torch.quantize_per_channel(
            w, w.abs().amax(1) / 127, torch.zeros(n, dtype=torch.long), 0, torch.qint8
        ),
        None,
    )
    r = min(m, int_mm_rows)
    xr = torch.randint(-127, 128, (max(r, 17), k), dtype=torch.int8)  # _int_mm wants > 16 rows
    wt = torch.randint(-127, 128, (k, n), dtype=torch.int8)
    return {
        "fp32 torch.mm": (m, lambda: torch.mm(x, w.t(), out=out)),
        "ours (int8 x int8, blocks of 32)": (m, lambda: ik.blocked_matmul(xq, xs, packed, out=out)),
        "ours + quantize_blocks(x)": (
            m,
            lambda: ik.blocked_matmul(*ik.quantize_blocks(x, BLOCK), packed, out=out),
        ),
        "torch.ao dynamic linear (fbgemm)": (m, lambda: dyn(x)),
        "torch._int_mm": (xr.shape[0], lambda: torch._int_mm(xr, wt)),
    }


def gemm_rows(
    tokens: int, names: list[str], threads: list[int], rounds: int, int_mm_rows: int
) -> list[dict[str, Any]]:
    rows = []
    for name, (m, k, n) in shapes(tokens).items():
        if name not in names:
            continue
        ops = _ops(m, k, n, int_mm_rows)
        for t in threads:
            torch.set_num_threads(t)
            for _, fn in ops.values():
                fn()  # warm-up: packing caches, thread pools
            times: dict[str, list[float]] = {op: [] for op in ops}
            for _ in range(rounds):
                for op, (_, fn) in ops.items():
                    times[op].append(_timed(fn))
            base = times["fp32 torch.mm"]
            for op, (rows_used, _) in ops.items():
                gops = 2 * rows_used * k * n / min(times[op]) / 1e9
                ratio = statistics.median(
                    b / (s * m / rows_used) for b, s in zip(base, times[op], strict=True)
                )  # per-row cost against fp32's call of the same round
                rows.append(
                    {"shape": name, "m": m, "k": k, "n": n, "threads": t, "op": op, "rows_timed": rows_used,
                     "gops": gops, "median_ratio_vs_fp32": ratio, "seconds": times[op]}
                )  # fmt: skip
                note = f" ({rows_used} rows)" if rows_used != m else ""
                print(f"{name:13s} t={t} {op:34s} {gops:7.1f} GOP/s  x{ratio:.2f} fp32{note}", flush=True)
    return rows


def quantize_rows(tokens: int, threads: list[int], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for k in (1536, 8960):
        x = torch.randn(tokens, k)
        for t in threads:
            torch.set_num_threads(t)
            for name, fn in (("torch reference", ik.reference_quantize_blocks), ("C++", ik.quantize_blocks)):
                fn(x, BLOCK)
                s = min(_timed(functools.partial(fn, x, BLOCK)) for _ in range(rounds))
                rows.append({"m": tokens, "k": k, "threads": t, "op": name, "ms": s * 1e3})
                print(f"quantize_blocks [{tokens}, {k}] t={t} {name:16s} {s * 1e3:7.2f} ms", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, None, "one round, the 2048^3 shape only")
    flags(ap, tokens=(2048, "rows of the 1.5B projections"), rounds=(3, "rounds of calls in turns"))
    flags(ap, int_mm_rows=(64, "rows for torch._int_mm without VNNI/AMX (a scalar loop there)"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--shapes", nargs="+", default=list(shapes(0)), choices=list(shapes(0)))
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out is required")
    if not ik.kernel_available():
        ap.error("the int8 kernel is unavailable here (see the warning): nothing to measure")
    flags_now = ik.cpu_flags()
    int_mm_rows = 1 << 30 if {"avx512_vnni", "avx_vnni", "amx_int8"} & flags_now else args.int_mm_rows
    rounds = 1 if args.quick else args.rounds
    doc: dict[str, Any] = {"isa": ik.isa(), "block": BLOCK, "rounds": rounds}
    doc["quantize"] = quantize_rows(args.tokens, args.threads, rounds)
    names = ["2048^3"] if args.quick else args.shapes
    doc["gemm"] = gemm_rows(args.tokens, names, args.threads, rounds, int_mm_rows)
    harness.save(args.out, {"machine": harness.machine_info(), **doc})
    return 0


if __name__ == "__main__":
    sys.exit(main())
