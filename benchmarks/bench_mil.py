"""Maximum input length within a fixed activation-memory budget (paper Table 2), and memory and
speed of one long prefill per configuration (paper Fig. 10: hybrid prefilling on/off), on the
embedded model.

Configurations (each (config, n) runs one cold forward in a fresh subprocess, so allocator state
and the RSS high-water mark never leak between them):

  hf-default   transformers default forward (logits of every position, KV cache of every layer)
  hf-ltk1      transformers, logits_to_keep=1, use_cache=False
  nochunk      ours, no chunking (one chunk = the whole prompt)
  hybrid       ours, hybrid prefilling (token-wise ops in chunks, attention unchunked)
  chunked      ours, Sarathi-style chunked prefill (attention chunked too, all-layer K/V kept)

Peak = kernel RSS high-water mark above the RSS before the forward, or on a GPU (`--device cuda`)
the CUDA allocator's peak above its level before it (po_backend.engine.memory.PeakMemory);
TFLOP/s = useful FLOPs (`prefill_flops`) per second, against the GEMM peak measured at start. MIL
= where a least-squares line peak = c0 + c1*n through the measured points reaches `--budget-mib`
("measured" when measured lengths bracket it, else "extrapolated").

    python -m benchmarks.bench_mil --out benchmarks/results/report/mil.json            # ~10 min
    python -m benchmarks.bench_mil --quick --out /tmp/mil.json                         # ~1 min
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.harness import REPO_ROOT, CpuShare, GiB, MiB, machine_info, save, wait_for_quiet
from po_backend.core.cpu import cpu_class
from po_backend.engine import attention_cpu
from po_backend.engine.config import ModelConfig, parse_dtype
from po_backend.engine.device import describe, resolve_device
from po_backend.engine.memory import PeakMemory
from po_backend.engine.models.loader import read_config, resolve_model_dir

CONFIGS = {
    "hf-default": "transformers default forward (all logits + KV cache)",
    "hf-ltk1": "transformers logits_to_keep=1, use_cache=False",
    "nochunk": "ours, no chunking",
    "hybrid": "ours, hybrid prefilling",
    "chunked": "ours, chunked prefill (Sarathi-style)",
}
LABEL_ID = 10539
WARMUP_TOKENS = 128
RESULT_MARKER = "@@RESULT "  # a child prints exactly one line starting with this, then JSON


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; a CPU op is done on return)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def gemm_peak_gflops(
    dtype: torch.dtype, size: int = 2048, min_seconds: float = 1.0, device: torch.device | None = None
) -> float:
    """Best achieved GFLOP/s of a square GEMM on this machine: the roof the model's GEMMs can reach.
    The layout is nn.Linear's, x @ W.t(): on CPUs without native bf16 a plain `a @ b` in bf16
    takes a ~10x slower path, so the layout matters for the roof. On a GPU 2048^3 is too small to
    fill it, so the size is 8192 there."""
    dev = device or torch.device("cpu")
    size = 8192 if dev.type == "cuda" else size
    gen = torch.Generator().manual_seed(0)
    x, w = (torch.randn(size, size, generator=gen).to(dev, dtype) for _ in range(2))
    out = torch.empty(size, size, dtype=dtype, device=dev)
    torch.matmul(x, w.t(), out=out)  # warm-up: thread pool, oneDNN or cuBLAS kernel selection
    sync(dev)
    best, reps, start = float("inf"), 0, time.perf_counter()
    while reps < 2 or (time.perf_counter() - start < min_seconds and reps < 50):
        t = time.perf_counter()
        torch.matmul(x, w.t(), out=out)
        sync(dev)
        best, reps = min(best, time.perf_counter() - t), reps + 1
    return 2.0 * size**3 / best / 1e9


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """Useful FLOPs of one causal prefill of `n` tokens, the same for every configuration (work a
    configuration wastes, like hf-default's LM head over all n rows, is not credited):
    2 per matmul weight per token (q, k, v, o, gate, up, down of every layer), QK^T and PV on half
    the n x n square (causal), and a 1-row LM head. Elementwise ops (<1% here) are not counted."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    attention = 2.0 * 2.0 * (n * n / 2.0) * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return 2.0 * cfg.num_layers * per_layer * n + attention + 2.0 * cfg.hidden_size * cfg.vocab_size


_ATTENTION_SECONDS = [0.0]


def _time_attention() -> None:
    """Wrap the runner's attention entry points to add their wall time to _ATTENTION_SECONDS
    (a child process measures one configuration, so patching the module is harmless)."""
    from po_backend.engine import runner

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> None:
            dev = args[0].device  # q: on a GPU, time the kernels, not their queueing
            sync(dev)
            t = time.perf_counter()
            fn(*args, **kwargs)
            sync(dev)
            _ATTENTION_SECONDS[0] += time.perf_counter() - t

        return wrapper

    runner.attend = timed(runner.attend)  # type: ignore[assignment]
    runner.attend_items = timed(runner.attend_items)  # type: ignore[assignment]


def child(config: str, n: int, chunk_size: int, dtype: str, device: str = "cpu") -> dict[str, Any]:
    model_dir = resolve_model_dir("embedded")
    cfg = read_config(model_dir)
    dev = resolve_device(device)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    if config.startswith("hf"):
        import transformers

        transformers.utils.logging.disable_progress_bar()
        dt = parse_dtype(None if dtype == "auto" else dtype, dev)  # the engine's choice
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dt).to(dev).eval()
        kwargs = {} if config == "hf-default" else {"logits_to_keep": 1, "use_cache": False}

        def forward(x: torch.Tensor) -> float:
            with torch.inference_mode():
                return model(x[None], **kwargs).logits[0, -1].float().log_softmax(-1)[LABEL_ID].item()

        prompt: Any = ids.to(dev)
    else:
        from po_backend.engine.engine import Engine

        engine = Engine.from_pretrained(
            "embedded",
            device=dev,
            dtype=None if dtype == "auto" else dtype,
            chunk_size=max(n, WARMUP_TOKENS) if config == "nochunk" else chunk_size,
            prefill_mode="chunked" if config == "chunked" else "hybrid",
            max_input_len=max(n, cfg.max_position_embeddings),
            enable_cache=False,  # one cold forward, no pool
            memory_budget=64 * GiB,  # never refuse the configuration being measured
        )

        def forward(x: Any) -> float:
            return engine.score([x], [LABEL_ID])[0].logprobs[0]

        _time_attention()

        prompt = ids.tolist()  # built outside the timed region
    forward(prompt[:WARMUP_TOKENS])  # thread pool, kernels, first touch of the weights
    _ATTENTION_SECONDS[0] = 0.0
    with PeakMemory(dev) as p, CpuShare() as cpu:
        t = time.perf_counter()
        logprob = forward(prompt)
        seconds = time.perf_counter() - t
    return {
        "config": config,
        "n": n,
        "device": str(dev),
        "peak_bytes": p.peak_bytes,
        "peak_method": p.method,
        "time_s": seconds,
        "tok_per_s": n / seconds,
        "tflops": prefill_flops(cfg, n) / seconds / 1e12,
        # Share of the forward spent in attention calls (ours only; None for transformers).
        "attention_share": None if config.startswith("hf") else _ATTENTION_SECONDS[0] / seconds,
        "logprob": logprob,
        "other_cores": cpu.other_cores,
    }


def run_child(args: list[str], timeout: float) -> dict[str, Any]:
    """`python -m benchmarks.bench_mil --child ...` in a fresh interpreter: its result, or a row
    saying why there is none (a SIGKILL with no traceback is what the OOM killer leaves)."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    cmd = [sys.executable, "-m", "benchmarks.bench_mil", *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT)
    except subprocess.TimeoutExpired:
        return {"status": "timeout", "detail": f"no result within {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return {"status": "ok", **json.loads(line[len(RESULT_MARKER) :])}
    tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
    oom = proc.returncode in (-9, 137) or "MemoryError" in proc.stderr
    return {"status": "oom" if oom else "failed", "detail": f"exit {proc.returncode}: {tail}"}


def fit_mil(points: list[tuple[int, int]], budget: float) -> dict[str, Any]:
    """MIL from (n, peak bytes) points: the line's crossing of `budget`, and whether measured
    points bracket it."""
    c1, c0 = np.polyfit([n for n, _ in points], [b for _, b in points], 1)
    fits = [n for n, b in points if b <= budget]
    over = [n for n, b in points if b > budget]
    return {
        "c0_mib": c0 / MiB,
        "kib_per_token": c1 / 1024,
        "mil": int((budget - c0) / c1) if c1 > 0 else None,
        "kind": "measured" if fits and over and max(fits) < min(over) else "extrapolated",
        "largest_measured_fit": max(fits) if fits else None,
        "points": [n for n, _ in points],
    }


def speed_summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (dtype, n) where both ran: ours (hybrid) vs transformers logits_to_keep=1, tok/s, the
    ratio, ours' achieved GFLOP/s and its share of the GEMM peak, attention's share of ours."""
    by = {(r["dtype"], r["config"], r["n"]): r for r in rows if r.get("status") == "ok"}
    pairs = [(dt, n, o, by.get((dt, "hf-ltk1", n))) for (dt, c, n), o in by.items() if c == "hybrid"]
    return [
        {"dtype": dt, "n": n, "ours_tok_per_s": o["tok_per_s"], "hf_tok_per_s": hf["tok_per_s"]}
        | {"ratio": o["tok_per_s"] / hf["tok_per_s"], "ours_gflops": o["tflops"] * 1e3}
        | {"ours_gemm_peak_frac": o["gemm_peak_frac"], "attention_share": o["attention_share"]}
        for dt, n, o, hf in pairs
        if hf is not None
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--chunk-size", type=int, default=512)
    ap.add_argument(
        "--dtype",
        default="auto",
        help="auto (the engine's default for this CPU) | fp32 | bf16, or a comma list (e.g. bf16,fp32): "
        "every config at every length per dtype; the MIL fit uses the first",
    )
    ap.add_argument(
        "--device", default="cpu", help="cpu | cuda | cuda:N (the same for ours and transformers)"
    )
    ap.add_argument("--budget-mib", type=float, default=256.0)
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--quiet-wait", type=float, default=30.0)
    ap.add_argument("--quick", action="store_true", help="lengths 256,512")
    ap.add_argument("--out", type=Path, default=None, help="result JSON (required unless --child)")
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        result = child(args.child[0], int(args.child[1]), args.chunk_size, args.dtype, args.device)
        print(RESULT_MARKER + json.dumps(result), flush=True)
        return 0
    if args.out is None:
        ap.error("--out is required")
    if args.quick:
        args.lengths, args.quiet_wait = "256,512", min(args.quiet_wait, 5.0)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    names = args.dtype.split(",")
    dev = resolve_device(args.device)
    dtypes = {name: parse_dtype(None if name == "auto" else name, dev) for name in names}
    dtype = dtypes[names[0]]
    print(f"device: {describe(dev)}")
    if dev.type == "cpu":  # what --dtype auto and the attention choice are on this CPU class
        head_dim = read_config(resolve_model_dir("embedded")).head_dim
        for name, dt in dtypes.items():
            c = attention_cpu.decide(dt, dev, head_dim)
            print(f"CPU class {cpu_class()}: --dtype {name} -> {dt}; attention {c.attention} ({c.reason})")
    # fp32 and bf16 whatever runs: the CPU decides which one the engine uses (bf16 only where it
    # is native); a GPU's fp16 default (compute capability < 8) is added when it runs.
    roofs = {
        str(dt): gemm_peak_gflops(dt, device=dev) for dt in {torch.float32, torch.bfloat16, *dtypes.values()}
    }
    print("GEMM peak (x @ W.t()): " + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in roofs.items()))
    rows: list[dict[str, Any]] = []
    for name, dt in dtypes.items():
        for n in [int(x) for x in args.lengths.split(",")]:
            for c in configs:
                wait_for_quiet(args.quiet_wait)
                cmd = ["--child", c, str(n), "--chunk-size", str(args.chunk_size), "--dtype", name]
                cmd += ["--device", str(dev)]
                row = {"config": c, "n": n, "dtype": str(dt), **run_child(cmd, args.timeout)}
                rows.append(row)
                if row["status"] != "ok":
                    print(f"  {c:10s} n={n:6d} {dt}: {row['status']} {row['detail']}")
                    continue
                row["gemm_peak_frac"] = row["tflops"] * 1e3 / roofs[str(dt)]
                share = row.get("attention_share")
                print(
                    f"  {c:10s} n={n:6d} {dt}: peak {row['peak_bytes'] / MiB:7.1f} MiB, "
                    f"{row['tok_per_s']:6.0f} tok/s, {row['tflops']:.3f} TFLOP/s "
                    f"({row['gemm_peak_frac']:.0%} of GEMM peak)"
                    + (f", attention {share:.0%}" if share is not None else "")
                    + f"  (other cores {row['other_cores']:.2f})"
                )
    speed = speed_summary(rows)
    for r in speed:
        print(
            f"  {r['dtype']:>14s} n={r['n']:5d}: ours {r['ours_tok_per_s']:6.0f} tok/s vs transformers "
            f"logits_to_keep=1 {r['hf_tok_per_s']:6.0f}: {r['ratio']:.2f}x, {r['ours_gflops']:.0f} GFLOP/s "
            f"({r['ours_gemm_peak_frac']:.0%} of GEMM peak), attention {r['attention_share']:.0%}"
        )
    budget = args.budget_mib * MiB
    mil = {}
    for c in configs:
        pts = [
            (r["n"], r["peak_bytes"])
            for r in rows
            if r["config"] == c and r["status"] == "ok" and r["dtype"] == str(dtype)
        ]
        if len({n for n, _ in pts}) >= 2:
            mil[c] = fit_mil(pts, budget)
            print(
                f"  MIL {c:10s}: {mil[c]['mil']} tokens ({mil[c]['kind']}), {mil[c]['kib_per_token']:.1f} KiB/token"
            )
    doc = {
        "machine": machine_info(),
        "device": describe(dev),
        "args": vars(args),  # harness.save writes paths as strings
        "dtype": str(dtype),
        "gemm_peak_gflops": roofs,
        "configs": {c: CONFIGS[c] for c in configs},
        "budget_mib": args.budget_mib,
        "model_context": read_config(resolve_model_dir("embedded")).max_position_embeddings,
        "rows": rows,
        "speed": speed,
        "mil": mil,
    }
    save(args.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
