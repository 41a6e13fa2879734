"""The CPU's own multiply-add ceilings, fp32 against the int8 instruction sequences, in one run.

Loops of independent accumulators in registers (inline assembly in `csrc/int8_ceiling.cpp`, no
memory traffic), each timed on 1 and 2 threads at once, in turns (`--rounds` rounds, best kept):

- `fp32 FMA`: vfmadd231ps ymm (8 multiply-adds each);
- `int8 sign (AVX2, ours)`: vpsignb + vpmaddubsw + vpmaddwd(ones) + vpaddd (32 each), the
  sequence of our AVX2 tile and of llama.cpp's Q8_0;
- `int8 no sign`: the same without vpsignb (32 each: an operand already unsigned);
- `int16 vpmaddwd`: vpmaddwd + vpaddd on int16 operands (16 each);
- `clock`: a dependent chain of 1-cycle vpaddd, whose rate is the core's clock (GHz), so every
  rate above also reads in multiply-adds per cycle.

Rates are counted in each thread's own CPU time (a thread the scheduler takes off its core does
not read slow on a shared machine), and in wall time for all threads together (the best round:
near the CPU-time figure only when the threads ran at once on their own cores).

The int8 rows over the fp32 row are the best int8 / fp32 ratio an int8 GEMM can reach on this
CPU (before loads, broadcasts, block scales and the activations' quantization).

    python -m benchmarks.bench_int8_ceiling --out /tmp/ceiling.json
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import flags
from po_backend.engine import kernels

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "int8_ceiling.cpp"
_NAME = "po_int8_ceiling"
_CFLAGS = ("-O2",)
# name: the kernel's index in int8_ceiling.cpp
KERNELS = {"fp32 FMA": 0, "int8 sign (AVX2, ours)": 1, "int8 no sign": 2, "int16 vpmaddwd": 3, "clock": 4}


@functools.cache
def load() -> bool:
    key = kernels.build_key((_SOURCE,), _CFLAGS, ())
    return kernels.load(
        _NAME,
        (_SOURCE,),
        _CFLAGS,
        (),
        kernels.build_dir(_NAME, key),
        registered=lambda: hasattr(torch.ops.po_int8_ceiling, "run"),
        what="the int8 ceiling microbenchmark",
        fallback="nothing to measure",
        log=log,
    )


def rate(kernel: str, iters: int, threads: int) -> tuple[float, float]:
    """Multiply-adds (clock: cycles) per second per thread in the slowest thread's CPU time, and
    in wall time for all threads together."""
    cpu, wall, work = torch.ops.po_int8_ceiling.run(KERNELS[kernel], iters, threads)
    return work / cpu, work * threads / wall


def measure(threads: list[int], rounds: int, iters: int) -> list[dict[str, Any]]:
    best: dict[tuple[str, int], float] = {}
    best_wall: dict[tuple[str, int], float] = {}
    for _ in range(rounds):
        for t in threads:
            for name in KERNELS:
                r, w = rate(name, iters, t)
                best[name, t] = max(best.get((name, t), 0.0), r)
                best_wall[name, t] = max(best_wall.get((name, t), 0.0), w)
    rows = []
    for t in threads:
        clock = best["clock", t]
        fp32 = best["fp32 FMA", t]
        for name in KERNELS:
            if name == "clock":
                continue
            r = best[name, t]
            rows.append(
                {"op": name, "threads": t, "gmac_s_per_thread": r / 1e9, "gmac_s_total": r * t / 1e9,
                 "gmac_s_wall": best_wall[name, t] / 1e9, "mac_per_cycle": r / clock,
                 "vs_fp32_fma": r / fp32, "clock_ghz": clock / 1e9}
            )  # fmt: skip
            print(
                f"t={t} {name:24s} {r * t / 1e9:7.1f} GMAC/s CPU time, {best_wall[name, t] / 1e9:7.1f} wall"
                f" ({r / clock:5.1f} MAC/cycle/thread at {clock / 1e9:.2f} GHz)  x{r / fp32:.2f} fp32 FMA",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, None, "one round")
    flags(ap, rounds=(5, "rounds of all kernels in turns"), iters=(20_000_000, "loop iterations per call"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out is required")
    if not load():
        ap.error("the microbenchmark did not build here (see the warning)")
    rows = measure(args.threads, 1 if args.quick else args.rounds, args.iters)
    harness.save(args.out, {"machine": harness.machine_info(), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
