"""Load sensitivity of a CPU prefill: ours against transformers (`logits_to_keep=1`) on a cut of a
real shape (random weights, real shape), with 0, 1 or 2 busy-looping processes beside it, per torch
thread count and OpenMP wait policy. Each configuration runs in a fresh process (OpenMP reads its
environment once, before torch starts its threads); the figures are same-run ratios.

    python -m benchmarks.bench_load --shape qwen3-0.6b --layers 4 --tokens 1024
    python -m benchmarks.bench_load --job label --tokens 512    # items over cached profiles
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import REPO_ROOT

OUT = REPO_ROOT / "benchmarks" / "results" / "load_cpu.json"
SPIN = "while True: pass"


def one(args: argparse.Namespace) -> dict[str, Any]:
    """This process's configuration: interleaved prefills of ours and transformers."""
    import torch
    import transformers

    from benchmarks import harness
    from benchmarks.bench_mil import LABEL_ID
    from po_backend.engine.engine import Engine
    from po_backend.engine.models.loader import read_config, resolve_model_dir

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(args.threads)
    # A shape's name may carry its own overrides (`NAME?field=value&...`): the layer count joins them.
    model = f"shape:{args.shape}{'&' if '?' in args.shape else '?'}num_hidden_layers={args.layers}"
    if args.job == "label":
        return {"threads": args.threads, **label_job(model, args)}
    cfg = read_config(resolve_model_dir(model))
    ids = torch.randint(
        3, cfg.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0)
    ).tolist()
    engine = Engine.from_pretrained(
        model, dtype="float32", enable_cache=False, max_input_len=args.tokens, memory_budget=64 << 30
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        resolve_model_dir(model), dtype=torch.float32
    ).eval()
    x = torch.tensor([ids])

    def theirs() -> None:
        with torch.inference_mode():
            hf(x, logits_to_keep=1, use_cache=False)

    fns = {"ours": lambda: engine.score([ids], [LABEL_ID]), "transformers": theirs}
    for f in fns.values():
        f()
    ts: dict[str, list[float]] = {k: [] for k in fns}
    with harness.CpuShare() as cpu:
        for r in range(args.repeats):
            for k in list(fns)[:: 1 if r % 2 == 0 else -1]:
                t = time.perf_counter()
                fns[k]()
                ts[k].append(time.perf_counter() - t)
    return {
        "threads": args.threads,
        "other_cores": cpu.other_cores,
        "seconds": ts,
        "median_s": {k: statistics.median(v) for k, v in ts.items()},
    }


def label_job(model: str, args: argparse.Namespace) -> dict[str, Any]:
    """The WL1-style labeling job of `bench_real_shapes` (items over each user's cached profile:
    the items path), ours against transformers' batched loop, once each."""
    import torch

    from benchmarks import bench_real_shapes

    ns = argparse.Namespace(
        label_users=args.label_users,
        label_items=args.label_items,
        label_profile=args.tokens,
        hf_batch=args.label_items,
        llama=False,
    )
    with contextlib.redirect_stdout(sys.stderr):
        job = bench_real_shapes.labeling(model, ns, torch.float32)
    secs = {k: v["seconds"] for k, v in job["systems"].items()}
    return {
        "other_cores": max(v["other_cores"] for v in job["systems"].values()),
        "seconds": {k: [v] for k, v in secs.items()},
        "median_s": secs,
        "max_abs_p_yes_vs_transformers": job["max_abs_p_yes_vs_transformers"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--job", choices=("prefill", "label"), default="prefill", help="one prefill, or the labeling job"
    )
    ap.add_argument("--label-users", type=int, default=2)
    ap.add_argument("--label-items", type=int, default=4, help="posts per user (--tokens: the profile)")
    ap.add_argument("--threads-list", default="1,2")
    ap.add_argument(
        "--envs",
        default=",OMP_WAIT_POLICY=PASSIVE",
        help="environments to compare, comma-separated, each VAR=VALUE[+VAR=VALUE...] ('' = as is)",
    )
    ap.add_argument("--spinners", default="0,1,2", help="busy-looping processes beside the run")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(args)))
        return 0
    # A terminated run still stops its busy loops (the `finally` below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows = []
    for spinners in (int(s) for s in args.spinners.split(",")):
        procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(spinners)]
        try:
            for extra in args.envs.split(","):
                for threads in (int(t) for t in args.threads_list.split(",")):
                    env = dict(os.environ)
                    env.update(kv.split("=", 1) for kv in filter(None, extra.split("+")))
                    cmd = [sys.executable, "-m", "benchmarks.bench_load", "--one", "--threads", str(threads)]
                    cmd += ["--shape", args.shape, "--layers", str(args.layers), "--tokens", str(args.tokens)]
                    cmd += ["--repeats", str(args.repeats), "--job", args.job]
                    cmd += ["--label-users", str(args.label_users), "--label-items", str(args.label_items)]
                    res = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                    row = {
                        "spinners": spinners,
                        "env": extra,
                        **json.loads(res.stdout.strip().splitlines()[-1]),
                    }
                    rows.append(row)
                    m = row["median_s"]
                    print(
                        f"spinners {spinners} env {extra or 'as is':24s} threads {threads}: ours {m['ours']:.2f} s, "
                        f"transformers {m['transformers']:.2f} s, ours/transformers speed "
                        f"{m['transformers'] / m['ours']:.2f}x (other cores {row['other_cores']:.2f})",
                        flush=True,
                    )
        finally:
            for p in procs:
                p.kill()
                p.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
