"""One long prefill on the embedded model: wall time and peak memory, HF transformers vs ours.

Configurations (each (config, dtype, length) runs in a fresh subprocess, so allocator state, the
oneDNN kernel cache and the RSS high-water mark never leak between them):

  (a) HF transformers, default forward: logits for every position, KV cache of every layer kept
  (b) HF transformers, `logits_to_keep=1, use_cache=False`: the best a plain HF user can do
  (c) ours without chunking: one chunk = the whole prompt (last-layer-only KV, 1-row LM head)
  (d) ours with hybrid prefilling: token-wise ops in chunks of --chunk-size, attention unchunked

Every line reports the ratio to (b) of the same dtype and length from the same run, and the achieved
TFLOP/s (useful FLOPs, see common.prefill_flops) next to this machine's GEMM peak, measured at start.
Then the maximum input length (MIL) that fits an activation budget is predicted for (a), (b), (d)
from a linear fit of the measured peaks, and the issue's targets are checked.

    python benchmarks/bench_prefill.py            # full run, ~25 min on a 2-core AVX2 machine
    python benchmarks/bench_prefill.py --quick    # smoke run, ~2 min: 512 and 1024 tokens, fp32
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import inspect
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `benchmarks.common` and `po_backend` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from benchmarks.common import (
    DTYPES,
    CpuShare,
    GiB,
    MiB,
    PeakRSS,
    emit_result,
    fit_linear,
    gemm_peak_gflops,
    machine_info,
    markdown_table,
    mem_available_bytes,
    prefill_flops,
    rss_bytes,
    run_child,
    text_table,
    wait_for_quiet,
)
from po_backend.config import ModelConfig
from po_backend.models.loader import read_config, resolve_model_dir

CONFIGS = {
    "a": "HF default forward (all logits + KV cache)",
    "b": "HF logits_to_keep=1, use_cache=False",
    "c": "ours, no chunking",
    "d": "ours, hybrid prefilling",
}
LABEL_ID = 10539  # "Yes": the scored label; its log-prob is compared across configurations
WARMUP_TOKENS = 128
REPEAT_MAX_LEN = 4096  # best of 2 runs up to this length ...
REPEAT_MAX_SECONDS = 20.0  # ... unless one run already takes this long (noise is small then)
MEMORY_LIMIT = 18 * GiB  # a child predicted to need more is skipped, not run into the OOM killer
SLOW_BF16_MAX_LEN = 4096  # default cap for bf16 lengths when bf16 is emulated (no AVX512-bf16/AMX)
QUIET_CORES = 0.3  # other processes busier than this during a forward make its time unreliable
RESULTS = Path(__file__).resolve().parent / "results"


# ---- child: one measurement in a fresh process ------------------------------------------------------


def child(config: str, dtype: str, n: int, chunk_size: int) -> dict[str, Any]:
    model_dir = resolve_model_dir("embedded")
    cfg = read_config(model_dir)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (n,), generator=gen)  # same prompt in every child
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    extra: dict[str, Any] = {}
    if config in ("a", "b"):
        import transformers

        transformers.utils.logging.disable_progress_bar()
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype]).eval()
        extra["attn_implementation"] = model.config._attn_implementation
        kwargs = {} if config == "a" else {"logits_to_keep": 1, "use_cache": False}

        def forward(x: torch.Tensor) -> float:
            with torch.inference_mode():
                out = model(x[None], **kwargs)
                return out.logits[0, -1].float().log_softmax(-1)[LABEL_ID].item()

        prompt: Any = ids
    else:
        from po_backend import Engine

        cs = chunk_size if config == "d" else max(n, WARMUP_TOKENS)  # one chunk = no chunking
        opts: dict[str, Any] = {
            "dtype": dtype,
            "chunk_size": cs,
            "max_input_len": max(n, cfg.max_position_embeddings),
            "max_batch_tokens": max(n, cfg.max_position_embeddings),
            # One cold forward: no prefix cache (a repeat would hit it), no pool to allocate,
            # and a budget check that never refuses the configuration being measured.
            "enable_cache": False,
            "memory_budget": 64 * GiB,
        }
        accepted = inspect.signature(Engine.from_pretrained).parameters
        engine = Engine.from_pretrained("embedded", **{k: v for k, v in opts.items() if k in accepted})
        extra["chunk_size"] = cs if config == "d" else 0

        def forward(x: Any) -> float:
            return engine.score([x], [LABEL_ID])[0].logprobs[0]

        prompt = ids.tolist()  # the token list is built outside the timed region
    load_s = time.perf_counter() - t0
    forward(prompt[:WARMUP_TOKENS])  # thread pool, oneDNN kernels, first-touch of the weights
    resident = rss_bytes() - rss0  # weights (+ allocator/runtime state) before the measured forward

    times: list[float] = []
    peaks: list[int] = []
    own_cores: list[float] = []
    other_cores: list[float] = []
    method = ""
    logprob = math.nan
    for _ in range(2):
        gc.collect()
        with PeakRSS() as p, CpuShare() as cpu:
            t = time.perf_counter()
            logprob = forward(prompt)
            times.append(time.perf_counter() - t)
        peaks.append(p.peak_bytes)
        method = p.method
        own_cores.append(cpu.own_cores)
        other_cores.append(cpu.other_cores)
        if n > REPEAT_MAX_LEN or times[0] > REPEAT_MAX_SECONDS:
            break
    return {
        "config": config,
        "dtype": dtype,
        "n": n,
        "time_s": min(times),
        "times_s": times,
        "peak_bytes": max(peaks),
        "peak_method": method,
        "resident_bytes": resident,
        "load_s": load_s,
        "logprob": logprob,
        "threads": torch.get_num_threads(),
        "own_cores": own_cores[times.index(min(times))],  # CPU cores this forward got on average
        "other_cores": other_cores[times.index(min(times))],  # cores other processes used meanwhile
        **extra,
    }


# ---- parent: plan, run, report ----------------------------------------------------------------------


def predict_peak_bytes(config: str, n: int, elem: int, cfg: ModelConfig) -> float:
    """Rough activation memory of one forward, only to skip children that cannot fit (x1.5 margin).

    Common: a few [n, hidden] residual/normed copies, q/k/v, K/V repeated to every query head,
    attention output. (a), (b), (c) hold the MLP intermediate (gate, up, act) for all n tokens;
    (a) also keeps every layer's K/V and materialises [n, vocab] logits."""
    per_token = elem * (6 * cfg.hidden_size + 4 * cfg.q_size + 2 * cfg.kv_size) + 4 * cfg.hidden_size
    if config in ("a", "b", "c"):
        per_token += elem * 3 * cfg.intermediate_size
    if config == "a":
        per_token += elem * (cfg.vocab_size + cfg.num_layers * 2 * cfg.kv_size)
    return 1.5 * (per_token * n + 64 * MiB)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,2048,4096,16384,32768", help="input lengths, comma-separated")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--configs", default="a,b,c,d", help="subset of a,b,c,d")
    p.add_argument("--chunk-size", type=int, default=512, help="chunk of (d)")
    p.add_argument("--budget-mib", type=float, default=256.0, help="activation budget for the MIL")
    p.add_argument(
        "--bf16-max-len",
        type=int,
        default=None,
        help=f"skip longer bf16 lengths (default: none with AVX512-bf16/AMX, else {SLOW_BF16_MAX_LEN})",
    )
    p.add_argument("--timeout", type=float, default=2400.0, help="seconds per child")
    p.add_argument(
        "--retry-max-s", type=float, default=90.0, help="repeat a contended child once if it took less"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=None,
        help="before each child, wait up to this many seconds for other processes to go idle "
        "(default 120, 10 with --quick; 0 = never)",
    )
    p.add_argument("--confirm-max-s", type=float, default=300.0, help="confirm (d)'s MIL if a run is shorter")
    p.add_argument(
        "--json", type=Path, default=None, help=f"default {RESULTS}/prefill.json (none with --quick)"
    )
    p.add_argument("--md", type=Path, default=None, help=f"default {RESULTS}/prefill.md (none with --quick)")
    p.add_argument(
        "--resume",
        type=Path,
        default=None,
        help="a prefill.json of an earlier run: keep its clean results, rerun missing and contended ones",
    )
    p.add_argument("--quick", action="store_true", help="smoke run: 512,1024 tokens, fp32")
    p.add_argument("--child", nargs=3, metavar=("CONFIG", "DTYPE", "N"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.wait_quiet is None:
        args.wait_quiet = 10.0 if args.quick else 120.0
    if args.quick:
        args.lengths, args.dtypes = "512,1024", "fp32"
    else:
        args.json = args.json or RESULTS / "prefill.json"
        args.md = args.md or RESULTS / "prefill.md"
    return args


def fmt_mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MiB:.0f}"


class Report:
    def __init__(self, args: argparse.Namespace, cfg: ModelConfig, peaks: dict[str, float]) -> None:
        self.args = args
        self.cfg = cfg
        self.peaks = peaks  # GFLOP/s per dtype name
        self.rows: list[dict[str, Any]] = []  # every planned configuration, run or not

    def get(self, dtype: str, n: int, config: str) -> dict[str, Any] | None:
        for r in self.rows:
            if (r["dtype"], r["n"], r["config"]) == (dtype, n, config) and r["status"] == "ok":
                return r
        return None

    def derive(self, r: dict[str, Any]) -> None:
        """Fill the ratios to (b) and the FLOP rate once a row has a result."""
        if r["status"] != "ok":
            return
        n = r["n"]
        r["tok_s"] = n / r["time_s"]
        r["tflops"] = prefill_flops(self.cfg, n) / r["time_s"] / 1e12
        r["peak_frac"] = r["tflops"] * 1e3 / self.peaks[r["dtype"]]
        base = self.get(r["dtype"], n, "b")
        if base is not None:
            r["speedup_vs_b"] = base["time_s"] / r["time_s"]
            r["mem_vs_b"] = r["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] else math.nan
            r["logprob_diff_vs_b"] = abs(r["logprob"] - base["logprob"])

    def line(self, r: dict[str, Any]) -> list[str]:
        if r["status"] != "ok":
            return [r["dtype"], str(r["n"]), r["config"], r["status"], *[""] * 7, r.get("note", "")]
        sp = r.get("speedup_vs_b")
        mem = r.get("mem_vs_b")
        return [
            r["dtype"],
            str(r["n"]),
            r["config"],
            f"{r['time_s']:.2f}",
            f"{r['tok_s']:.0f}",
            "-" if sp is None else f"{sp:.2f}x",
            fmt_mib(r["peak_bytes"]),
            "-" if mem is None else f"{mem:.2f}x",
            f"{r['tflops']:.3f}",
            f"{100 * r['peak_frac']:.0f}%",
            f"{r['own_cores']:.1f}",
            f"runs={len(r['times_s'])}" + (f" {r['note']}" if r.get("note") else ""),
        ]

    HEADER = [
        "dtype",
        "n",
        "cfg",
        "time s",
        "tok/s",
        "speed vs b",
        "peak MiB",
        "mem vs b",
        "TFLOP/s",
        "% GEMM peak",
        "cores",
        "notes",
    ]

    def table(self, markdown: bool = False) -> str:
        for r in self.rows:
            self.derive(r)  # (b) may have finished after the others of its group
        rows = [self.line(r) for r in self.rows]
        return markdown_table(self.HEADER, rows) if markdown else text_table(self.HEADER, rows)


def plan(
    args: argparse.Namespace, cfg: ModelConfig, fast_bf16: bool
) -> tuple[list[dict[str, Any]], list[str]]:
    lengths = [int(x) for x in args.lengths.split(",") if x]
    dtypes = [x for x in args.dtypes.split(",") if x]
    configs = [x for x in args.configs.split(",") if x]
    for c in configs:
        assert c in CONFIGS, f"unknown config {c!r}; choose from {sorted(CONFIGS)}"
    for d in dtypes:
        assert d in DTYPES, f"unknown dtype {d!r}; choose from {sorted(DTYPES)}"
    bf16_cap = args.bf16_max_len
    if bf16_cap is None and not fast_bf16:
        bf16_cap = SLOW_BF16_MAX_LEN
    notes: list[str] = []
    limit = min(MEMORY_LIMIT, 0.85 * mem_available_bytes())
    rows: list[dict[str, Any]] = []
    # (b) first in every group, so each finished line can show its ratio to (b) right away.
    order = sorted(configs, key=lambda c: (c != "b", c))
    for dtype in dtypes:
        elem = torch.empty(0, dtype=DTYPES[dtype]).element_size()
        for n in lengths:
            for c in order:
                row: dict[str, Any] = {"config": c, "dtype": dtype, "n": n, "status": "planned"}
                if dtype == "bf16" and bf16_cap is not None and n > bf16_cap:
                    row.update(status="skipped", note=f"bf16 > {bf16_cap} tokens: bf16 is emulated here")
                else:
                    pred = predict_peak_bytes(c, n, elem, cfg)
                    row["predicted_peak_bytes"] = pred
                    if pred > limit:
                        row.update(
                            status="skipped",
                            note=f"predicted {pred / GiB:.1f} GiB > limit {limit / GiB:.1f} GiB",
                        )
                rows.append(row)
    if bf16_cap is not None and "bf16" in dtypes and any(n > bf16_cap for n in lengths):
        why = "this CPU has no AVX512-bf16/AMX, so bf16 GEMMs are emulated and ~7x slower than fp32"
        notes.append(
            f"bf16 lengths above {bf16_cap} skipped: "
            + (why if not fast_bf16 else "--bf16-max-len")
            + " (override with --bf16-max-len)"
        )
    return rows, notes


def run_row(args: argparse.Namespace, row: dict[str, Any]) -> None:
    script = str(Path(__file__).resolve())
    cmd = [
        script,
        "--child",
        row["config"],
        row["dtype"],
        str(row["n"]),
        "--chunk-size",
        str(args.chunk_size),
    ]
    env = {"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    # Another process on the CPU only ever slows a run down: a contended run that is cheap to
    # repeat is repeated once after waiting, and the faster of the two kept.
    had_result = row["status"] == "ok"  # resumed from an earlier run: keep it unless beaten
    for attempt in range(2):
        quiet(args)
        out = run_child(cmd, args.timeout, env)
        if out.status != "ok" or out.result is None:
            if attempt == 0 and not had_result:
                row.update(status=out.status, note=out.detail[:200], wall_s=out.wall_s)
                return
            break  # keep the earlier, contended result
        if row.get("status") != "ok" or out.result["time_s"] < row["time_s"]:
            row.update(out.result, status="ok", wall_s=out.wall_s, attempts=attempt + 1)
        if row["other_cores"] <= QUIET_CORES or out.wall_s > args.retry_max_s:
            break
        print(f"  (retrying: other processes used {row['other_cores']:.1f} cores during the forward)")
    row["attempts"] = row.get("attempts_before", 0) + attempt + 1
    row.pop("rerun", None)
    row.pop("note", None)
    if row["other_cores"] > QUIET_CORES:
        row["note"] = f"shared CPU: others used {row['other_cores']:.1f} cores"


def resume(rows: list[dict[str, Any]], path: Path, info: dict[str, Any], chunk_size: int) -> dict[str, Any]:
    """Reuse the results of an earlier (possibly interrupted) run: its clean rows are kept, its
    contended rows are run again (and the faster result kept)."""
    doc = json.loads(path.read_text())
    if doc["machine"]["cpu"] != info["cpu"] or doc["args"]["chunk_size"] != chunk_size:
        raise SystemExit(f"{path} comes from another machine or chunk size; not resuming from it")
    prev = {(r["dtype"], r["n"], r["config"]): r for r in doc["results"] if r.get("status") == "ok"}
    for row in rows:
        old = prev.get((row["dtype"], row["n"], row["config"]))
        if row["status"] != "planned" or old is None:
            continue
        row.update(old, attempts_before=old.get("attempts", 1))
        row["rerun"] = old.get("other_cores", 0.0) > QUIET_CORES
    return doc


def quiet(args: argparse.Namespace) -> None:
    if args.wait_quiet > 0:
        waited, others = wait_for_quiet(args.wait_quiet, QUIET_CORES)
        if waited > 5:
            print(f"  (waited {waited:.0f} s for other processes to quiet down; {others:.1f} cores busy)")


def measure_peaks(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """GEMM roof per dtype, measured while the machine is as quiet as it gets."""
    quiet(args)
    out = {}
    for name, dt in DTYPES.items():
        with CpuShare() as cpu:
            g = gemm_peak_gflops(dt)
        out[name] = {"gflops": g, "other_cores": cpu.other_cores}
    return out


def mil_section(report: Report, budget: float) -> list[dict[str, Any]]:
    """Predict the max input length whose peak fits `budget` bytes: fit peak = c0 + c1 * n on every
    measured length of a config (all are linear in n: (a)'s logits and KV cache, (b)'s MLP
    intermediates, (d)'s [n, q+k+v] and attention buffers), then solve c0 + c1 * n = budget."""
    out = []
    dtypes = sorted({r["dtype"] for r in report.rows}, key=list(DTYPES).index)
    for dtype in dtypes:
        for c in ("a", "b", "d"):
            pts = [(r["n"], r["peak_bytes"]) for r in report.rows if (r["dtype"], r["config"]) == (dtype, c)]
            pts = [p for p in pts if p[1] is not None and report.get(dtype, p[0], c) is not None]
            if len({n for n, _ in pts}) < 2:
                continue
            c0, c1 = fit_linear([n for n, _ in pts], [b for _, b in pts])
            mil = int((budget - c0) / c1) if c1 > 0 else None
            lo, hi = min(n for n, _ in pts), max(n for n, _ in pts)
            kind = "interpolated" if mil is not None and lo <= mil <= hi else "extrapolated"
            out.append(
                {
                    "dtype": dtype,
                    "config": c,
                    "c0_mib": c0 / MiB,
                    "bytes_per_token": c1,
                    "points": [n for n, _ in pts],
                    "mil_predicted": mil,
                    "kind": kind,
                }
            )
    return out


def confirm_mil(args: argparse.Namespace, report: Report, mils: list[dict[str, Any]], budget: float) -> None:
    """One run of (d) at its predicted MIL where that is short enough, to check the prediction."""
    for m in mils:
        if m["config"] != "d" or not m["mil_predicted"] or m["mil_predicted"] < 1:
            continue
        n = m["mil_predicted"]
        done = [r for r in report.rows if (r["dtype"], r["config"], r["status"]) == (m["dtype"], "d", "ok")]
        if not done:
            continue
        ref = min(done, key=lambda r: abs(r["n"] - n))
        est = ref["time_s"] * prefill_flops(report.cfg, n) / prefill_flops(report.cfg, ref["n"])
        if est > args.confirm_max_s:
            m["confirm"] = f"not run (estimated {est:.0f} s > --confirm-max-s {args.confirm_max_s:.0f})"
            continue
        row = {"config": "d", "dtype": m["dtype"], "n": n, "status": "planned"}
        print(f"confirming (d) {m['dtype']} MIL: one run at n={n} (~{est:.0f} s)", flush=True)
        run_row(args, row)
        if row["status"] == "ok":
            m["confirm_peak_mib"] = row["peak_bytes"] / MiB
            m["confirm_time_s"] = row["time_s"]
            fits = "fits" if row["peak_bytes"] <= budget else "EXCEEDS"
            m["confirm"] = f"measured {row['peak_bytes'] / MiB:.0f} MiB at n={n}: {fits} the budget"
        else:
            m["confirm"] = f"confirm run {row['status']}: {row.get('note', '')}"


def targets(report: Report) -> list[dict[str, Any]]:
    res = []
    dtypes = sorted({r["dtype"] for r in report.rows}, key=list(DTYPES).index)
    for dtype in dtypes:
        a, d = report.get(dtype, 16384, "a"), report.get(dtype, 16384, "d")
        if a and d:
            frac = d["peak_bytes"] / a["peak_bytes"]
            res.append(
                {
                    "target": f"(d) peak at 16k <= 1/10 of (a), {dtype}",
                    "met": frac <= 0.1,
                    "detail": f"(d) {d['peak_bytes'] / MiB:.0f} MiB vs (a) {a['peak_bytes'] / MiB:.0f} MiB"
                    f" = 1/{1 / frac:.1f}",
                }
            )
        else:
            res.append(
                {"target": f"(d) peak at 16k <= 1/10 of (a), {dtype}", "met": None, "detail": "not measured"}
            )
        ratios = []
        for r in report.rows:
            if (r["dtype"], r["config"], r["status"]) == (dtype, "d", "ok") and "speedup_vs_b" in r:
                ratios.append((r["n"], r["speedup_vs_b"]))
        if ratios:
            res.append(
                {
                    "target": f"(d) throughput >= 1.0x (b) at every length, {dtype}",
                    "met": all(s >= 1.0 for _, s in ratios),
                    "detail": ", ".join(f"{n}: {s:.2f}x" for n, s in ratios),
                }
            )
    d2 = report.get("bf16", 2048, "d")
    if d2 is not None and "speedup_vs_b" in d2:
        s = d2["speedup_vs_b"]
        res.append(
            {"target": "(d) throughput >= 1.5x (b) at 2k bf16", "met": s >= 1.5, "detail": f"{s:.2f}x"}
        )
    else:
        res.append({"target": "(d) throughput >= 1.5x (b) at 2k bf16", "met": None, "detail": "not measured"})
    return res


MIL_HEADER = ["dtype", "cfg", "fit on n", "c0 MiB", "KiB/token", "MIL (predicted)", "", "check"]


def mil_rows(mils: list[dict[str, Any]]) -> list[list[str]]:
    return [
        [
            m["dtype"],
            m["config"],
            str(m["points"]),
            f"{m['c0_mib']:.0f}",
            f"{m['bytes_per_token'] / 1024:.1f}",
            "-" if m["mil_predicted"] is None else f"{m['mil_predicted']}",
            m["kind"],
            m.get("confirm", ""),
        ]
        for m in mils
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        config, dtype, n = args.child
        emit_result(child(config, dtype, int(n), args.chunk_size))
        return 0

    t_start = time.perf_counter()
    info = machine_info()
    cfg = read_config(resolve_model_dir("embedded"))
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} ({info['torch_threads']} threads)"
    )
    print("cpu flags: " + " ".join(f"{k}={'y' if v else 'n'}" for k, v in info["flags"].items()))
    peak_runs = [measure_peaks(args)]
    peaks = {k: v["gflops"] for k, v in peak_runs[0].items()}
    print(
        "measured GEMM peak (x @ W.t(), 2048^3): "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in peaks.items())
        + ("" if info["fast_bf16"] else "  [bf16 emulated: no AVX512-bf16/AMX]")
        + f"  (others used {max(v['other_cores'] for v in peak_runs[0].values()):.1f} cores meanwhile)"
    )
    print(
        f"model: embedded SmolLM2-135M, {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_heads}/{cfg.num_kv_heads} heads, vocab {cfg.vocab_size}; chunk (d) = {args.chunk_size}"
    )
    for k, v in CONFIGS.items():
        print(f"  ({k}) {v}")

    report = Report(args, cfg, peaks)
    report.rows, notes = plan(args, cfg, info["fast_bf16"])
    for note in notes:
        print("note: " + note)
    if args.resume:
        old = resume(report.rows, args.resume, info, args.chunk_size)
        peak_runs[:0] = old.get("gemm_peak_runs", [])
        for k in peaks:
            report.peaks[k] = peaks[k] = max(r[k]["gflops"] for r in peak_runs)
        kept = sum(1 for r in report.rows if r["status"] == "ok" and not r.get("rerun"))
        again = sum(1 for r in report.rows if r.get("rerun"))
        notes.append(f"resumed from {args.resume}: {kept} results kept, {again} contended ones run again")
        print("note: " + notes[-1])
    out = Outputs(args, info, cfg, report, notes, peak_runs)
    todo = [r for r in report.rows if r["status"] == "planned" or r.get("rerun")]
    print(f"{len(todo)} runs, each in a fresh subprocess\n", flush=True)
    for i, row in enumerate(todo, 1):
        run_row(args, row)
        report.derive(row)
        print(
            f"[{i}/{len(todo)}] " + " ".join(report.line(row)) + f"  (wall {row['wall_s']:.0f} s)", flush=True
        )
        out.save([], targets(report), time.perf_counter() - t_start, final=False)  # partial results

    # The roof again at the end; the higher of the two is the less disturbed measurement.
    peak_runs.append(measure_peaks(args))
    for k in peaks:
        report.peaks[k] = peaks[k] = max(r[k]["gflops"] for r in peak_runs)
    print(
        "GEMM peak measured again: "
        + ", ".join(f"{k} {v['gflops']:.0f}" for k, v in peak_runs[1].items())
        + " GFLOP/s; using the higher: "
        + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items())
    )
    print("\n" + report.table())
    budget = args.budget_mib * MiB
    mils = mil_section(report, budget)
    if not args.quick:
        confirm_mil(args, report, mils, budget)
    print(
        f"\nmax input length within a {args.budget_mib:.0f} MiB activation budget (predicted from a linear fit):"
    )
    print(text_table(MIL_HEADER, mil_rows(mils)))
    for line in mil_ratios(mils):
        print("  " + line)

    tgts = targets(report)
    print("\ntargets:")
    for t in tgts:
        state = "not measured" if t["met"] is None else ("MET" if t["met"] else "NOT MET")
        print(f"  {t['target']}: {state} ({t['detail']})")
    diffs = [r["logprob_diff_vs_b"] for r in report.rows if "logprob_diff_vs_b" in r]
    if diffs:
        print(f"sanity: log P(label) differs from (b) by at most {max(diffs):.2e} across configs")
    contended = [r for r in report.rows if r.get("other_cores", 0.0) > QUIET_CORES]
    if contended:
        print(
            f"caution: {len(contended)} of the measured forwards shared the CPU with other processes "
            "(see 'cores' and notes); their times are upper bounds"
        )
    total = time.perf_counter() - t_start
    print(f"total {total / 60:.1f} min")
    for path in out.save(mils, tgts, total, final=True):
        print(f"wrote {path}")
    return 0


def mil_ratios(mils: list[dict[str, Any]]) -> list[str]:
    lines = []
    for dtype in sorted({m["dtype"] for m in mils}):
        by = {m["config"]: m["mil_predicted"] for m in mils if m["dtype"] == dtype}
        if by.get("d") and by.get("a") and by["a"] > 0:
            extra = f", (d)/(b) = {by['d'] / by['b']:.1f}x" if by.get("b") else ""
            lines.append(
                f"{dtype}: MIL (d)/(a) = {by['d'] / by['a']:.1f}x{extra} (paper: +7.9x over vLLM chunked prefill)"
            )
    return lines


class Outputs:
    """prefill.json and prefill.md, rewritten after every child so an interrupted run keeps data."""

    def __init__(
        self,
        args: argparse.Namespace,
        info: dict[str, Any],
        cfg: ModelConfig,
        report: Report,
        notes: list[str],
        peak_runs: list[dict[str, dict[str, float]]],
    ) -> None:
        self.args, self.info, self.cfg, self.report = args, info, cfg, report
        self.notes, self.peak_runs = notes, peak_runs

    def save(
        self, mils: list[dict[str, Any]], tgts: list[dict[str, Any]], total: float, final: bool
    ) -> list[Path]:
        args, written = self.args, []
        if args.json:
            doc = {
                "complete": final,
                "machine": self.info,
                "gemm_peak_gflops": self.report.peaks,
                "gemm_peak_runs": self.peak_runs,
                "model": {"name": "embedded SmolLM2-135M-Instruct", "config": dataclasses.asdict(self.cfg)},
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                "configs": CONFIGS,
                "notes": self.notes,
                "results": self.report.rows,
                "mil": mils,
                "targets": tgts,
                "total_s": total,
            }
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(doc, indent=2, default=str) + "\n")
            written.append(args.json)
        if args.md:
            args.md.parent.mkdir(parents=True, exist_ok=True)
            args.md.write_text(self.markdown(mils, tgts, total, final))
            written.append(args.md)
        return written

    def markdown(
        self, mils: list[dict[str, Any]], tgts: list[dict[str, Any]], total: float, final: bool
    ) -> str:
        info, args, report = self.info, self.args, self.report
        flags = ", ".join(k for k, v in info["flags"].items() if v) or "none"
        contended = sum(1 for r in report.rows if r.get("other_cores", 0.0) > QUIET_CORES)
        lines = [
            "# Prefill benchmark (`benchmarks/bench_prefill.py`)",
            "",
            *([] if final else ["**Partial results: the run was still in progress.**", ""]),
            f"Machine: {info['cpu']}, {info['cores']} cores ({flags}), {info['mem_total_gib']} GiB, "
            f"torch {info['torch']}, transformers {info['transformers']}. Measured GEMM peak "
            "(x @ W.t(), 2048^3, best of a run at start and one at the end): "
            + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in report.peaks.items())
            + f". Total run time {total / 60:.0f} min.",
            "",
            "Configurations: "
            + "; ".join(f"({k}) {v}" for k, v in CONFIGS.items())
            + f" (chunk {args.chunk_size}).",
            "",
            "Each (config, dtype, n) runs in a fresh subprocess: load, warm up on 128 tokens, then one "
            f"forward at n (best of 2 when n <= {REPEAT_MAX_LEN} and a run takes < {REPEAT_MAX_SECONDS:.0f} s). "
            "Peak = kernel RSS high-water mark (VmHWM after clear_refs) above the RSS before the forward, "
            "so weights are excluded. TFLOP/s count useful FLOPs only (`benchmarks/common.py: "
            "prefill_flops`); '% GEMM peak' is against the measured roof of the same dtype. 'cores' is "
            "the CPU the forward got on average; a note marks forwards during which other processes "
            "used the CPU (the machine is shared), whose times are upper bounds. Ratios are to (b) of "
            "the same dtype and length from the same run: speed = t(b)/t(x), mem = peak(x)/peak(b).",
            "",
            *[f"Note: {n}." for n in self.notes],
            *([f"Note: {contended} forwards shared the CPU with other processes."] if contended else []),
            "",
            report.table(markdown=True),
            "",
        ]
        if mils:
            lines += [
                f"## Max input length within a {args.budget_mib:.0f} MiB activation budget (predicted)",
                "",
                "Linear fit peak = c0 + c1*n over the measured lengths of each configuration, solved for "
                "the budget; 'extrapolated' = outside the measured range.",
                "",
                markdown_table(MIL_HEADER, mil_rows(mils)),
                "",
                *[f"- {line}" for line in mil_ratios(mils)],
                "",
            ]
        lines += [
            "## Targets",
            "",
            *[
                f"- {t['target']}: **{'not measured' if t['met'] is None else ('met' if t['met'] else 'not met')}** "
                f"({t['detail']})"
                for t in tgts
            ],
            "",
        ]
        return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
