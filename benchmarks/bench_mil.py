"""Maximum input length within a fixed activation-memory budget (paper Table 2), and hybrid
prefilling on/off (paper Fig. 10: memory and speed of the same forward), on the embedded model.

Configurations (each (config, n) runs one cold forward in a fresh subprocess, so allocator state
and the RSS high-water mark never leak between them):

  hf-default   transformers default forward (logits of every position, KV cache of every layer)
  hf-ltk1      transformers, logits_to_keep=1, use_cache=False
  nochunk      ours, no chunking (one chunk = the whole prompt)
  hybrid       ours, hybrid prefilling (token-wise ops in chunks, attention unchunked)
  chunked      ours, Sarathi-style chunked prefill (attention chunked too, all-layer K/V kept)

Peak = kernel RSS high-water mark above the RSS before the forward (po_backend.memory.PeakMemory).
The MIL of a configuration is where a least-squares line peak = c0 + c1*n through its measured
points reaches `--budget-mib`: "measured" when a measured length fits the budget and a longer
measured one does not (the MIL is bracketed by measurements), "extrapolated" otherwise.

    flock /tmp/po-bench.lock python benchmarks/bench_mil.py --out results/report/mil.json  # ~10 min
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` and `po_backend` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    CpuShare,
    GiB,
    MiB,
    PeakRSS,
    emit_result,
    fit_linear,
    machine_info,
    run_child,
    wait_for_quiet,
)
from po_backend.config import parse_dtype
from po_backend.models.loader import read_config, resolve_model_dir

CONFIGS = {
    "hf-default": "transformers default forward (all logits + KV cache)",
    "hf-ltk1": "transformers logits_to_keep=1, use_cache=False",
    "nochunk": "ours, no chunking",
    "hybrid": "ours, hybrid prefilling",
    "chunked": "ours, chunked prefill (Sarathi-style)",
}
LABEL_ID = 10539
WARMUP_TOKENS = 128


def child(config: str, n: int, chunk_size: int, dtype: str) -> dict[str, Any]:
    model_dir = resolve_model_dir("embedded")
    cfg = read_config(model_dir)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    if config.startswith("hf"):
        import transformers

        transformers.utils.logging.disable_progress_bar()
        dt = parse_dtype(None if dtype == "auto" else dtype, torch.device("cpu"))  # the engine's choice
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).eval()
        kwargs = {} if config == "hf-default" else {"logits_to_keep": 1, "use_cache": False}

        def forward(x: torch.Tensor) -> float:
            with torch.inference_mode():
                return model(x[None], **kwargs).logits[0, -1].float().log_softmax(-1)[LABEL_ID].item()

        prompt: Any = ids
    else:
        from po_backend import Engine

        engine = Engine.from_pretrained(
            "embedded",
            dtype=None if dtype == "auto" else dtype,
            chunk_size=max(n, WARMUP_TOKENS) if config == "nochunk" else chunk_size,
            prefill_mode="chunked" if config == "chunked" else "hybrid",
            max_input_len=max(n, cfg.max_position_embeddings),
            enable_cache=False,  # one cold forward, no pool
            memory_budget=64 * GiB,  # never refuse the configuration being measured
        )

        def forward(x: Any) -> float:
            return engine.score([x], [LABEL_ID])[0].logprobs[0]

        prompt = ids.tolist()
    forward(prompt[:WARMUP_TOKENS])  # thread pool, kernels, first touch of the weights
    with PeakRSS() as p, CpuShare() as cpu:
        t = time.perf_counter()
        logprob = forward(prompt)
        seconds = time.perf_counter() - t
    return {
        "config": config,
        "n": n,
        "peak_bytes": p.peak_bytes,
        "peak_method": p.method,
        "time_s": seconds,
        "tok_per_s": n / seconds,
        "logprob": logprob,
        "other_cores": cpu.other_cores,
    }


def fit_mil(points: list[tuple[int, int]], budget: float) -> dict[str, Any]:
    """MIL from (n, peak bytes) points: the line's crossing of `budget`, and whether measured
    points bracket it."""
    ns = [n for n, _ in points]
    c0, c1 = fit_linear(ns, [b for _, b in points])
    mil = int((budget - c0) / c1) if c1 > 0 else None
    fits = [n for n, b in points if b <= budget]
    over = [n for n, b in points if b > budget]
    bracketed = bool(fits) and bool(over) and max(fits) < min(over)
    return {
        "c0_mib": c0 / MiB,
        "kib_per_token": c1 / 1024,
        "mil": mil,
        "kind": "measured" if bracketed else "extrapolated",
        "largest_measured_fit": max(fits) if fits else None,
        "points": ns,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument("--dtype", default="auto", help="auto (the engine's default for this CPU) | fp32 | bf16")
    ap.add_argument("--budget-mib", type=float, default=256.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quiet-wait", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="lengths 256,512")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        emit_result(child(args.child[0], int(args.child[1]), args.chunk_size, args.dtype))
        return 0
    assert args.out is not None, "--out is required"
    if args.quick:
        args.lengths, args.quiet_wait = "256,512", min(args.quiet_wait, 5.0)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    rows: list[dict[str, Any]] = []
    for n in lengths:
        for c in configs:
            wait_for_quiet(args.quiet_wait)
            res = run_child(
                [str(Path(__file__).resolve()), "--child", c, str(n), "--chunk-size", str(args.chunk_size)]
                + ["--dtype", args.dtype],
                timeout=args.timeout,
            )
            row = res.result or {"config": c, "n": n, "status": res.status, "detail": res.detail}
            row.setdefault("status", res.status)
            rows.append(row)
            if res.result:
                print(
                    f"  {c:10s} n={n:6d}: peak {row['peak_bytes'] / MiB:7.1f} MiB, {row['tok_per_s']:6.0f} tok/s"
                    f"  (other cores {row['other_cores']:.2f})"
                )
            else:
                print(f"  {c:10s} n={n:6d}: {res.status} {res.detail}")
    budget = args.budget_mib * MiB
    mil = {}
    for c in configs:
        pts = [(r["n"], r["peak_bytes"]) for r in rows if r["config"] == c and r["status"] == "ok"]
        if len({n for n, _ in pts}) >= 2:
            mil[c] = fit_mil(pts, budget)
    for c, m in mil.items():
        print(f"  MIL {c:10s}: {m['mil']} tokens ({m['kind']}), {m['kib_per_token']:.1f} KiB/token")
    ctx = read_config(resolve_model_dir("embedded")).max_position_embeddings
    doc = {
        "machine": machine_info(),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "configs": {c: CONFIGS[c] for c in configs},
        "budget_mib": args.budget_mib,
        "model_context": ctx,
        "rows": rows,
        "mil": mil,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
