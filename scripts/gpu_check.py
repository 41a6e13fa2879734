"""The GPU check: everything that verifies the CUDA path, in one run, written to one markdown file
to paste into benchmarks/results/REPORT.md with the GPU's name.

1. the engine against transformers on the device (tests/engine/test_cuda.py: tiny random configs; cold,
   cache hits and multi-item batches; the auto dtype; the memory budget measured with the CUDA
   allocator) plus the device checks that need no GPU (tests/engine/test_device.py,
   tests/engine/test_attention_items.py);
2. `bench_mil --device DEVICE`: ours vs transformers on the device (speed, peak memory, share of
   the device's GEMM peak).

    scripts/dev.sh gpu-check                       # on a CUDA machine: the whole check
    python -m scripts.gpu_check --device cpu --quick --out /tmp/check.md   # a rehearsal on a CPU

Exit status 0 only when every test passed and every benchmark row ran; without the device asked
for it stops at once (status 2) and says why.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch
import transformers

from benchmarks.harness import REPO_ROOT, MiB
from po_backend.core.errors import DeviceUnavailableError
from po_backend.engine.device import describe, resolve_device

TEST_FILES = (
    "tests/engine/test_cuda.py",
    "tests/engine/test_device.py",
    "tests/engine/test_attention_items.py",
)
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results" / "gpu-check.md"


def run_tests(device: torch.device) -> dict[str, Any]:
    """pytest over TEST_FILES; on a GPU the `gpu` cases must run (a skip there is a failure of
    the check: the point is that they ran)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}"]
        cmd += list(TEST_FILES)
        t = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - t
        print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n")
        cases = ET.parse(junit).getroot().iter("testcase") if junit.exists() else iter(())
        rows = []
        for c in cases:
            outcome = "passed"
            for tag in ("failure", "error", "skipped"):
                node = c.find(tag)
                if node is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    rows.append((c.get("classname", ""), c.get("name", ""), outcome, node.get("message", "")))
                    break
            else:
                rows.append((c.get("classname", ""), c.get("name", ""), outcome, ""))
    counts = {k: sum(1 for r in rows if r[2] == k) for k in ("passed", "failed", "error", "skipped")}
    on_device = [r for r in rows if f"[{device.type}" in r[1] or f"-{device.type}]" in r[1]]
    device_skips = [r for r in on_device if r[2] == "skipped"]
    ok = proc.returncode == 0 and counts["failed"] == counts["error"] == 0 and bool(on_device)
    ok = ok and not (device.type == "cuda" and device_skips)
    return {
        "ok": ok,
        "returncode": proc.returncode,
        "seconds": seconds,
        "counts": counts,
        "device_cases": len(on_device),
        "device_passed": sum(1 for r in on_device if r[2] == "passed"),
        "not_passed": [r for r in rows if r[2] != "passed"],
    }


def run_bench(device: torch.device, quick: bool, out: Path, extra: list[str]) -> dict[str, Any]:
    """bench_mil on the device in its own process (each configuration in a fresh child)."""
    cmd = [sys.executable, "-m", "benchmarks.bench_mil", "--device", str(device), "--out", str(out)]
    cmd += ["--quiet-wait", "0"] + (["--quick"] if quick else []) + extra
    proc = subprocess.run(cmd, cwd=REPO_ROOT, text=True)
    if proc.returncode != 0 or not out.exists():
        return {"ok": False, "detail": f"bench_mil exited {proc.returncode}"}
    doc = json.loads(out.read_text())
    failed = [r for r in doc["rows"] if r.get("status") != "ok"]
    return {"ok": not failed, "doc": doc, "failed": failed}


def render(device: torch.device, tests: dict[str, Any], bench: dict[str, Any], commit: str) -> str:
    c = tests["counts"]
    lines = [
        f"## GPU check: {describe(device)}",
        "",
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
        f"commit {commit}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        "",
        f"**Tests** ({', '.join(TEST_FILES)}): {c['passed']} passed, {c['failed']} failed, {c['error']} errors, "
        f"{c['skipped']} skipped in {tests['seconds']:.0f} s; on {device.type}: {tests['device_passed']} of "
        f"{tests['device_cases']} cases passed. {'PASS' if tests['ok'] else 'FAIL'}",
    ]
    for cls, name, outcome, msg in tests["not_passed"]:
        lines.append(f"- {outcome}: `{cls}::{name}` {msg[:200]}")
    lines += ["", f"**bench_mil --device {device}**: {'PASS' if bench['ok'] else 'FAIL'}"]
    doc = bench.get("doc")
    if doc is None:
        lines.append(f"- {bench.get('detail', 'no result')}")
        return "\n".join(lines) + "\n"
    roofs = ", ".join(
        f"{k} {v / 1e3:.1f} TFLOP/s" if v >= 1e3 else f"{k} {v:.0f} GFLOP/s"
        for k, v in doc["gemm_peak_gflops"].items()
    )
    lines += [
        "",
        f"GEMM peak on the device (x @ W.t()): {roofs}. Embedded SmolLM2-135M; each row is the median of "
        f"{doc['rows'][0].get('timed_runs', 1)} forward(s) after an untimed one.",
        "",
        "| dtype | config | tokens | tok/s | peak MiB | share of GEMM peak | attention share |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in doc["rows"]:
        if r.get("status") != "ok":
            lines.append(
                f"| {r['dtype']} | {r['config']} | {r['n']} | {r['status']}: {r.get('detail', '')[:80]} | | | |"
            )
            continue
        share = r.get("attention_share")
        lines.append(
            f"| {r['dtype']} | {r['config']} | {r['n']} | {r['tok_per_s']:.0f} | {r['peak_bytes'] / MiB:.1f} | "
            f"{r['gemm_peak_frac']:.1%} | {'' if share is None else f'{share:.0%}'} |"
        )
    lines += ["", "Ours (hybrid) vs transformers `logits_to_keep=1`, same run, same device:", ""]
    lines += [f"- {s['dtype']} n={s['n']}: {s['ratio']:.2f}x" for s in doc["speed"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N (cpu: a rehearsal of the check itself)")
    ap.add_argument("--quick", action="store_true", help="bench_mil at 256 and 512 tokens only")
    ap.add_argument(
        "--bench-args", default="", help="more bench_mil flags, e.g. '--lengths 1024,16384 --dtype bf16,fp32'"
    )
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the markdown to paste into REPORT.md")
    args = ap.parse_args(argv)
    try:
        device = resolve_device(args.device)
    except DeviceUnavailableError as e:
        print(f"gpu-check: {e}", file=sys.stderr)
        return 2
    print(f"gpu-check on {describe(device)}", flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True
    ).stdout.strip()
    tests = run_tests(device)
    bench = run_bench(device, args.quick, args.out.with_suffix(".json"), shlex.split(args.bench_args))
    md = render(device, tests, bench, commit or "unknown")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    print(md)
    print(f"wrote {args.out} (paste it into benchmarks/results/REPORT.md)")
    return 0 if tests["ok"] and bench["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
