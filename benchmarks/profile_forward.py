"""Where one CPU prefill's time goes, at a real shape (random weights, real shape): one forward of
ours and one of transformers (`logits_to_keep=1`) under torch.profiler, CPU time per op type
(each GEMM with its exact M, N, K, attention, norms, RoPE, activation, copies), and every GEMM
shape's achieved GFLOP/s against a bare torch.mm of the same shape and the 2048^3 peak (the highest
of its readings before and after each forward: `bench_mil.GemmPeak`), all measured in this process.

    python -m benchmarks.profile_forward --shape qwen3-0.6b --layers 4 --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import harness
from benchmarks.bench_mil import LABEL_ID, GemmPeak, timed
from po_backend.engine.config import parse_dtype
from po_backend.engine.models import shapes
from po_backend.engine.models.loader import read_config, resolve_model_dir

GEMMS = ("aten::mm", "aten::addmm", "aten::matmul", "aten::bmm")
# The namespaces of the ops counted (torch's and this engine's kernels).
OPS = ("aten::", "po_attn::", "po_fused::")
# Top-level op names -> the category they are reported under (everything else: "other").
CATEGORIES = {
    "aten::mm": "gemm",
    "aten::addmm": "gemm",
    "aten::matmul": "gemm",
    "aten::linear": "gemm",
    "aten::scaled_dot_product_attention": "attention",
    "aten::bmm": "gemm",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
    "po_attn::fwd": "attention",
    "po_fused::attention": "attention",
    "po_fused::rms_norm": "elementwise (norm, rope, act)",
    "po_fused::add_rms_norm": "elementwise (norm, rope, act)",
    "po_fused::norm_rope": "elementwise (norm, rope, act)",
    "po_fused::silu_mul": "elementwise (norm, rope, act)",
    "aten::mul": "elementwise (norm, rope, act)",
    "aten::mul_": "elementwise (norm, rope, act)",
    "aten::add_": "elementwise (norm, rope, act)",
    "aten::sub_": "elementwise (norm, rope, act)",
    "aten::add": "elementwise (norm, rope, act)",
    "aten::pow": "elementwise (norm, rope, act)",
    "aten::mean": "elementwise (norm, rope, act)",
    "aten::rsqrt": "elementwise (norm, rope, act)",
    "aten::silu_": "elementwise (norm, rope, act)",
    "aten::silu": "elementwise (norm, rope, act)",
    "aten::neg": "elementwise (norm, rope, act)",
    "aten::cos": "elementwise (norm, rope, act)",
    "aten::sin": "elementwise (norm, rope, act)",
    "aten::copy_": "copy",
    "aten::contiguous": "copy",
    "aten::clone": "copy",
    "aten::cat": "copy",
    "aten::to": "copy",
    "aten::_to_copy": "copy",
    "aten::index_select": "embedding",
    "aten::embedding": "embedding",
}


def _gemm_mnk(name: str, shapes_: list[list[int]]) -> tuple[int, int, int] | None:
    """(M, N, K) of a profiled GEMM from its input shapes, None where they do not say."""
    if name == "aten::mm" and len(shapes_) >= 2 and len(shapes_[0]) == 2 and len(shapes_[1]) == 2:
        (m, k), (_, n) = shapes_[0], shapes_[1]
        return m, n, k
    if name == "aten::addmm" and len(shapes_) >= 3 and len(shapes_[1]) == 2 and len(shapes_[2]) == 2:
        (m, k), (_, n) = shapes_[1], shapes_[2]
        return m, n, k
    return None


def _flat_ops(prof: Any) -> list[Any]:
    """The profiled ops that are not inside another aten op (their children are counted inside)."""
    events = prof.events()
    out = []
    for e in events:
        parent = e.cpu_parent
        inside = False
        while parent is not None:
            if parent.name.startswith(OPS):
                inside = True
                break
            parent = parent.cpu_parent
        if not inside and e.name.startswith(OPS):
            out.append(e)
    return out


def breakdown(prof: Any, wall_s: float) -> dict[str, Any]:
    """CPU time per category and per GEMM shape (top-level ops only, so nothing is counted twice)."""
    cats: dict[str, float] = defaultdict(float)
    gemms: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    names: dict[str, float] = defaultdict(float)
    by_shape: dict[str, float] = defaultdict(float)
    for e in _flat_ops(prof):
        us = e.cpu_time_total
        cats[CATEGORIES.get(e.name, "other")] += us
        names[e.name] += us
        by_shape[f"{e.name} {e.input_shapes}"] += us
    # The GEMMs themselves, wherever they sit (under matmul/linear; they never nest in each other).
    for e in prof.events():
        mnk = _gemm_mnk(e.name, e.input_shapes) if e.name in GEMMS else None
        if mnk is not None:
            gemms[mnk].append(e.cpu_time_total)
    total_us = sum(cats.values())
    return {
        "wall_s": wall_s,
        "ops_s": total_us / 1e6,
        "categories_s": {k: v / 1e6 for k, v in sorted(cats.items(), key=lambda kv: -kv[1])},
        "top_ops_s": {k: v / 1e6 for k, v in sorted(names.items(), key=lambda kv: -kv[1])[:15]},
        "top_ops_by_shape_s": {k: v / 1e6 for k, v in sorted(by_shape.items(), key=lambda kv: -kv[1])[:25]},
        "gemms": [
            {
                "m": m,
                "n": n,
                "k": k,
                "calls": len(ts),
                "s": sum(ts) / 1e6,
                "gflops": 2 * m * n * k * len(ts) / (sum(ts) / 1e6) / 1e9,
            }
            for (m, n, k), ts in sorted(gemms.items(), key=lambda kv: -sum(kv[1]))
        ],
    }


def bare_mm_gflops(m: int, n: int, k: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """A bare x @ W.t() of one shape (out= given, as the engine calls it): best GFLOP/s."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g).to(dtype), torch.randn(n, k, generator=g).to(dtype)
    out = torch.empty(m, n, dtype=dtype)
    times = [timed(lambda: torch.matmul(x, w.t(), out=out))[0] for _ in range(repeats + 1)][1:]
    return 2 * m * n * k / min(times) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the real shape kept")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--chunk-size", type=int, default=None)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    import transformers

    from po_backend.engine.engine import Engine

    # A shape's name may carry its own overrides (`NAME?field=value&...`): the layer count joins them.
    model = f"shape:{args.shape}{'&' if '?' in args.shape else '?'}num_hidden_layers={args.layers}"
    dt = parse_dtype(args.dtype, torch.device("cpu"))
    cfg = read_config(resolve_model_dir(model))
    ids = torch.randint(
        3, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    engine = Engine.from_pretrained(
        model,
        dtype=str(dt).removeprefix("torch."),
        enable_cache=False,
        max_input_len=args.tokens,
        memory_budget=64 << 30,
        **({"chunk_size": args.chunk_size} if args.chunk_size is not None else {}),
    )
    peak = GemmPeak.of(dt, torch.device("cpu"))
    peak.sample("start")
    systems: dict[str, Any] = {"ours": lambda: engine.score([ids], [LABEL_ID])}
    if not args.skip_hf:
        hf = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_dir(model), dtype=dt).eval()
        x = torch.tensor([ids])

        def run_hf() -> None:
            with torch.inference_mode():
                hf(x, logits_to_keep=1, use_cache=False)

        systems["transformers"] = run_hf
    doc: dict[str, Any] = {
        "model": model,
        "weights": shapes.WEIGHTS_NOTE,
        "dtype": str(dt),
        "tokens": args.tokens,
        "threads": torch.get_num_threads(),
        "machine": harness.machine_info(),
        "systems": {},
    }
    for name, fn in systems.items():
        fn()  # warm-up
        with (
            harness.CpuShare() as cpu,
            profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
        ):
            wall, _ = timed(fn)
        b = breakdown(prof, wall)
        b["other_cores"] = cpu.other_cores
        doc["systems"][name] = b
        peak.sample(f"after {name}")
    mm: dict[str, float] = {}
    for b in doc["systems"].values():
        for g in b["gemms"]:
            key = f"{g['m']}x{g['n']}x{g['k']}"
            if key not in mm:
                mm[key] = bare_mm_gflops(g["m"], g["n"], g["k"], dt)
            g["bare_mm_gflops"] = mm[key]
            g["of_bare"] = g["gflops"] / mm[key]
    peak.sample("end")
    doc["gemm_peak_gflops"], doc["gemm_peak"] = peak.best, peak.record()
    for b in doc["systems"].values():
        for g in b["gemms"]:
            g["of_peak"] = peak.share(g["gflops"])
    for name, b in doc["systems"].items():
        print(
            f"{name}: wall {b['wall_s']:.2f} s, ops {b['ops_s']:.2f} s (other cores {b['other_cores']:.2f})"
        )
        for k, v in b["categories_s"].items():
            print(f"  {k:32s} {v:7.3f} s {v / b['ops_s']:6.1%}")
        for g in b["gemms"]:
            print(
                f"  gemm M={g['m']:5d} N={g['n']:6d} K={g['k']:5d} x{g['calls']:3d}: {g['s']:6.3f} s "
                f"{g['gflops']:6.1f} GFLOP/s = {g['of_bare']:.0%} of bare mm ({g['bare_mm_gflops']:.1f}), {g['of_peak']:.0%} of peak"
            )
        print("  top ops:", {k: round(v, 3) for k, v in list(b["top_ops_s"].items())[:10]})
        for k, v in list(b["top_ops_by_shape_s"].items())[:18]:
            print(f"    {v:7.3f} s  {k}")
    print(f"2048^3 {peak.summary()}: every '% of peak' above is of the highest")
    if args.out is not None:
        args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
