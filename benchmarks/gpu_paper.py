"""The paper's experiments on one GPU at the paper's model size (Llama-3.1-8B's shape, random weights,
bf16), in one run of a few minutes, with only torch, transformers, safetensors and numpy (+ the
wheels of requirements-gpu-check.txt):

1. Table 2: the maximum input length of one prompt, by bisection up to the device's memory, for
   ours (hybrid prefilling), ours without chunking, chunked prefill of 512 tokens, transformers'
   default forward and transformers with logits_to_keep=1;
2. one 16k-token prefill against the device's measured bf16 GEMM peak;
3. Fig. 6/7: WL1 (users x posts sharing long profiles) and WL2 (long unique histories) with Poisson
   arrivals at multiples of the saturated rate, po against fcfs and chunked prefill (transformers at
   the lowest loads): mean and P99 latency, and the QPS at which each config's P99 stays within
   `--p99-x` times its value at the lowest load. The sweeps run on po_backend.sim (the real
   scheduler on a virtual clock) with step times from JCT models measured on the device for each
   engine; real saturated runs of the hybrid engine check the simulator (makespan) and give the JCT
   model's r on real steps.

    bash scripts/dev.sh gpu-paper                  # on a CUDA machine (its own venv, like gpu-check)
    python -m benchmarks.gpu_paper --device cpu --rehearsal --out-dir /tmp/paper   # CPU rehearsal

Writes gpu_paper_<gpu>.json / .md (+ .png where matplotlib is installed) under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import harness
from benchmarks.workloads import Item, label_ids, wl1, wl2
from po_backend.core.request import ScoreRequest
from po_backend.core.settings import DEFAULT_FAIRNESS_LAMBDA
from po_backend.engine.device import describe, resolve_device
from po_backend.engine.engine import Engine
from po_backend.engine.memory import PeakMemory
from po_backend.engine.models import shapes
from po_backend.engine.models.loader import load_tokenizer, read_config, resolve_model_dir
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import FEATURES, CalibratedJCT, JCTModel, JCTSample
from po_backend.serving.jct_profile import DEFAULT_GRID, ProfileGrid, load_or_profile
from po_backend.sim.cluster import LinearStepModel
from po_backend.sim.simulator import PrefixLRU, simulate

MIL_CONFIGS = {
    "hybrid": "ours, hybrid prefilling",
    "nochunk": "ours, no chunking",
    "chunked512": "ours, chunked prefill of 512 tokens (Sarathi-style)",
    "hf-default": "transformers default forward (all logits + KV cache)",
    "hf-ltk1": "transformers logits_to_keep=1, use_cache=False",
}
SWEEP_CONFIGS = {
    "po": "ours, prefix-aware SRJF + JCT calibration",
    "fcfs": "ours, FCFS + radix prefix cache",
    "chunked": "ours, FCFS + radix cache, chunked prefill of 512 tokens",
    "hf": "transformers logits_to_keep=1, FCFS, no prefix reuse (lowest loads only)",
}
LABEL_ID = 10539  # any id: the weights are random (taken modulo a cut-down vocabulary)
# What the rehearsal shrinks: a 2-layer cut of the shape, short prompts, a small profile grid.
REHEARSAL = {
    "shape": "llama-3.1-8b?num_hidden_layers=2&hidden_size=64&intermediate_size=128"
    "&num_attention_heads=4&num_key_value_heads=2&head_dim=16&vocab_size=512",
    "wl1": "2,3,24",
    "wl1_profile": "160,30,120,200",
    "wl2": "2,200,300",
    "mil_start": 256,
    "mil_max": 1024,
    "mil_cap_mib": 24.0,
    "hf_lengths": "32,64,96,128,192,256",
    "gemm_tokens": 256,
    "dtype": "fp32",
}
SMALL_GRID = ProfileGrid(lengths=(32, 64, 128, 256), batches=((4, 128, 16), (2, 0, 64)), long_points=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="llama-3.1-8b", help=f"of {', '.join(sorted(shapes.SHAPES))}")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--rehearsal", action="store_true", help="a tiny cut of the shape and workloads (CPU)")
    ap.add_argument("--wl1", default="10,50,150", help="WL1 users,posts,post tokens")
    ap.add_argument("--wl1-profile", default="14000,3000,11000,17000", help="profile tokens mean,std,min,max")
    ap.add_argument("--wl2", default="30,40000,60000", help="WL2 users,min,max history tokens")
    ap.add_argument("--mults", default="0.25,0.5,1,2,3,4", help="x the saturated rate")
    ap.add_argument("--hf-mults", default="0.25,0.5", help="the loads transformers runs at")
    ap.add_argument("--p99-x", type=float, default=2.0, help="sustained: P99 <= this x its lowest-load P99")
    ap.add_argument("--cache-profiles", type=float, default=2.0, help="prefix pool in WL1 profiles")
    ap.add_argument("--mil-start", type=int, default=8192)
    ap.add_argument("--mil-max", type=int, default=131072, help="bisection's upper end (the context)")
    ap.add_argument(
        "--mil-cap-mib", type=float, help="a forward's peak above this fails (a CPU has no device OOM)"
    )
    ap.add_argument("--mil-configs", default=",".join(MIL_CONFIGS))
    ap.add_argument("--hf-lengths", default="1024,2048,4096,8192,12288,16384,24576")
    ap.add_argument("--gemm-tokens", type=int, default=16384, help="the prefill timed against GEMM peak")
    ap.add_argument("--real-wl2", type=int, default=6, help="WL2 requests replayed for real (JCT r)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", type=Path, default=harness.RESULTS)
    args = ap.parse_args(argv)
    if args.rehearsal:
        for k, v in REHEARSAL.items():
            setattr(args, k, v)
        args.real_wl2 = 2
    return args


def installed_packages() -> list[str]:
    """`pip list` of this interpreter (flashinfer, vllm, sglang: what baselines the machine has)."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True
    )
    if proc.returncode == 0:
        return proc.stdout.split()
    from importlib import metadata

    return sorted(f"{d.metadata['Name']}=={d.version}" for d in metadata.distributions())


def _ints(csv: str) -> list[int]:
    return [int(x) for x in csv.split(",")]


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError | MemoryError) or "out of memory" in str(e).lower()


# ---- Table 2: maximum input length ------------------------------------------------------------------


def bisect_max(fits: Callable[[int], bool], start: int, cap: int, step: int) -> dict[str, Any]:
    """The longest n (a multiple of `step`, <= cap) with fits(n): doubling from `start`, then
    bisection to within 2%. `fits` is assumed monotone (a longer prompt never needs less)."""
    probes: list[tuple[int, bool]] = []

    def probe(n: int) -> bool:
        ok = fits(n)
        probes.append((n, ok))
        print(f"    {n:7d} tokens: {'fits' if ok else 'out of memory'}", flush=True)
        return ok

    lo, hi, n = 0, None, min(start, cap)
    while hi is None:
        if probe(n):
            lo = n
            if n >= cap:
                break
            n = min(2 * n, cap)
        else:
            hi = n
    while hi is not None and hi - lo > max(step, hi // 50):
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        lo, hi = (mid, hi) if probe(mid) else (lo, mid)
    return {"mil": lo, "first_failure": hi, "capped": hi is None, "probes": probes}


def mil_ours(args: argparse.Namespace, config: str, dev: torch.device) -> dict[str, Any]:
    chunk = {"hybrid": None, "nochunk": args.mil_max, "chunked512": 512}[config]
    engine = Engine.from_pretrained(
        args.model,
        device=dev,
        dtype=args.dtype,
        chunk_size=chunk,
        prefill_mode="chunked" if config == "chunked512" else "hybrid",
        max_input_len=args.mil_max,
        max_batch_tokens=args.mil_max,
        enable_cache=False,
        profile_full=False,  # a full-length profile run would be the first out-of-memory probe
        memory_budget=1 << 50,  # the device's memory decides, not the engine's estimate
    )
    ids = torch.randint(3, engine.vocab_size, (args.mil_max,), generator=torch.Generator().manual_seed(0))

    def fits(n: int) -> bool:
        prompt = ids[:n].tolist()
        try:
            with PeakMemory(dev) as pm:
                engine.score([prompt], [LABEL_ID % engine.vocab_size])
        except (RuntimeError, MemoryError) as e:
            if not is_oom(e):
                raise
            free(dev)
            return False
        free(dev)
        return args.mil_cap_mib is None or pm.peak_bytes <= args.mil_cap_mib * harness.MiB

    # the engine goes with this frame; the caller frees the device's cache
    return {"chunk_size": engine.config.chunk_size, **bisect_max(fits, args.mil_start, args.mil_max, 256)}


def hf_model(args: argparse.Namespace, dev: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model of the shape: on a GPU built on the device (its own random init, nothing
    read), elsewhere loaded from the shape's checkpoint."""
    import transformers

    if shapes.needs_weights(dev):
        return transformers.AutoModelForCausalLM.from_pretrained(
            resolve_model_dir(args.model), dtype=dtype
        ).eval()
    name, overrides = shapes.parse(args.model) or ("", {})
    with torch.device(dev):  # initialised where it lives; .to is a no-op then
        model = transformers.AutoModelForCausalLM.from_config(shapes.hf_config(name, overrides), dtype=dtype)
    return model.to(dev).eval()


def hf_forward(model: Any, config: str, ids: torch.Tensor) -> None:
    kwargs = {} if config == "hf-default" else {"logits_to_keep": 1, "use_cache": False}
    with torch.inference_mode():
        out = model(ids[None], **kwargs)
        logits = out.logits[0, -1].float()
        logits.log_softmax(-1)[LABEL_ID % logits.shape[-1]].item()
    del out


def mil_hf(args: argparse.Namespace, config: str, model: Any, dev: torch.device) -> dict[str, Any]:
    ids = torch.randint(
        3, model.config.vocab_size, (args.mil_max,), generator=torch.Generator().manual_seed(0)
    )
    ids = ids.to(dev)

    def fits(n: int) -> bool:
        try:
            with PeakMemory(dev) as pm:
                hf_forward(model, config, ids[:n])
        except (RuntimeError, MemoryError) as e:
            if not is_oom(e):
                raise
            free(dev)
            return False
        free(dev)
        return args.mil_cap_mib is None or pm.peak_bytes <= args.mil_cap_mib * harness.MiB

    return bisect_max(fits, min(args.mil_start, 4096), args.mil_max, 256)


# ---- throughput: one long prefill against the GEMM peak ---------------------------------------------


def prefill_share(args: argparse.Namespace, engine: Engine, dev: torch.device) -> dict[str, Any]:
    from benchmarks.bench_mil import GemmPeak, prefill_flops, timed

    n = args.gemm_tokens
    roof = GemmPeak.of(engine.config.dtype, dev)
    roof.sample("before")
    ids = torch.randint(3, engine.vocab_size, (n,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.flush_cache()
    engine.score([ids], [LABEL_ID % engine.vocab_size])  # warm-up at the shape
    times = []
    for _ in range(3):
        engine.flush_cache()
        times.append(timed(lambda: engine.score([ids], [LABEL_ID % engine.vocab_size]), dev)[0])
    seconds = sorted(times)[1]
    roof.sample("after")
    gflops = prefill_flops(engine.model_config, n) / seconds / 1e9
    return {"tokens": n, "seconds": seconds, "tok_per_s": n / seconds, "gflops": gflops} | {
        "gemm_peak_gflops": roof.best,
        "gemm_peak": roof.record(),
        "gemm_peak_frac": roof.share(gflops),
    }


# ---- Fig. 6/7: the workloads on the simulator, step times measured on the device ---------------------


def traces(args: argparse.Namespace, tok: Any) -> dict[str, list[Item]]:
    users, posts, post_tokens = _ints(args.wl1)
    mean, std, lo, hi = _ints(args.wl1_profile)
    wl2_users, h_lo, h_hi = _ints(args.wl2)
    return {
        "WL1": wl1(tok, users, posts, mean, std, (lo, hi), post_tokens, seed=args.seed),
        "WL2": wl2(tok, wl2_users, (h_lo, h_hi), seed=args.seed + 1),
    }


def sweep_engine(args: argparse.Namespace, dev: torch.device, mode: str, pool: int, longest: int) -> Engine:
    return Engine.from_pretrained(
        args.model,
        device=dev,
        dtype=args.dtype,
        cache_policy="declared",  # the paper's suffix discarding: only profiles enter the cache
        prefill_mode=mode,
        chunk_size=512 if mode == "chunked" else None,
        max_input_len=longest,
        prefix_pool_tokens=pool,
    )


def sim_run(
    step: JCTModel, pool: int, max_batch: int, policy: str, reqs: list[ScoreRequest], arrivals: list[float]
) -> dict[str, Any]:
    """One simulated replay, in the fields harness.sweep and report.plot_sweeps read."""
    out = simulate(
        SchedulerConfig(policy, DEFAULT_FAIRNESS_LAMBDA),
        step,
        list(zip(arrivals, reqs, strict=True)),
        PrefixLRU(pool, max_batch),
    )
    steps = max(r.step for r in out) + 1
    lat = [r.end - r.arrival for r in out]
    return {
        "policy": policy,
        **harness.latency_summary(lat),
        "latencies": lat,
        "makespan_s": max(r.end for r in out) - min(arrivals),
        "hit_rate": sum(r.cached for r in out) / sum(len(r.input_ids) for r in reqs),
        "steps": steps,
        "mean_batch": len(out) / steps,
        "other_cores": 0.0,
    }


def hf_step_model(args: argparse.Namespace, model: Any, dev: torch.device) -> tuple[JCTModel, list[float]]:
    """transformers' step times (logits_to_keep=1, one prompt per forward) at --hf-lengths, fitted
    with the JCT model's features (no prefix is ever cached)."""
    from benchmarks.bench_mil import timed

    ids = torch.randint(3, model.config.vocab_size, (max(_ints(args.hf_lengths)),)).to(dev)
    samples, seconds = [], []
    for n in _ints(args.hf_lengths):
        try:
            hf_forward(model, "hf-ltk1", ids[:n])  # warm-up at the shape
            s = min(timed(lambda n=n: hf_forward(model, "hf-ltk1", ids[:n]), dev)[0] for _ in range(2))
        except (RuntimeError, MemoryError) as e:
            if not is_oom(e):
                raise
            free(dev)
            break
        samples.append(JCTSample(((n, 0),), s))
        seconds.append(s)
    if not samples:
        raise RuntimeError(f"transformers ran out of memory at {args.hf_lengths.split(',')[0]} tokens")
    if len(samples) <= len(FEATURES):  # too few lengths ran to fit every feature: tokens alone
        n, s = samples[-1].items[0][0], samples[-1].seconds
        return JCTModel.proxy(seconds_per_ktok=s / (n / 1e3)), seconds
    return JCTModel.fit(samples, source="proxy"), seconds


def sustained(runs: list[dict[str, Any]], config: str, x: float) -> dict[str, Any]:
    """The QPS at which `config`'s P99 stays within x times its P99 at the lowest load."""
    pts = sorted((r["qps"], r["p99_s"]) for r in runs if r["config"] == config)
    if not pts:
        return {"qps": None, "mark": "not run"}
    bound = x * pts[0][1]
    qps, mark = harness.sustained_qps(pts, bound)
    return {"qps": qps, "mark": mark, "p99_bound_s": bound}


def workload_sweep(
    args: argparse.Namespace,
    name: str,
    items: list[Item],
    labels: tuple[int, int],
    steps: dict[str, JCTModel],
    pool: int,
) -> dict[str, Any]:
    reqs, unit = harness.requests_and_arrivals(items, labels, args.seed)
    max_batch = max(len(r.input_ids) for r in reqs)
    pools = {"po": pool, "fcfs": pool, "chunked": pool, "hf": 0}
    policy = {"po": "po", "fcfs": "fcfs", "chunked": "fcfs", "hf": "fcfs"}

    def run(config: str, arrivals: list[float]) -> dict[str, Any]:
        return sim_run(steps[config], pools[config], max_batch, policy[config], reqs, arrivals)

    sat = run("po", [0.0] * len(reqs))
    iso = run("fcfs", [1e6 * i for i in range(len(reqs))])  # 1e6 s apart: none ever waits
    ns = argparse.Namespace(anchor="saturated", slo_x=8.0, slo_extra="")
    ours = [c for c in ("po", "fcfs", "chunked") if c in steps]
    mults = [float(m) for m in args.mults.split(",")]
    w = harness.sweep(run, ours, reqs, unit, mults, iso, ns, sat)
    if "hf" in steps:
        base = w["anchor_qps"]
        for m in (float(x) for x in args.hf_mults.split(",")):
            r = run("hf", [u / (m * base) for u in unit])
            w["runs"].append({**r, "config": "hf", "mult": m, "qps": m * base})
    configs = list(dict.fromkeys(r["config"] for r in w["runs"]))
    w["sustained"] = {c: sustained(w["runs"], c, args.p99_x) for c in configs}
    s = w["sustained"]
    w["ratios"] = {
        f"po_vs_{c}": s["po"]["qps"] / s[c]["qps"]
        for c in configs
        if c != "po" and s[c]["qps"] and s["po"]["qps"]
    }
    print(f"  {name}: sustained QPS " + ", ".join(f"{c} {v['mark']}{v['qps']:.3f}" for c, v in s.items()))
    return w


def real_check(
    engine: Engine,
    jct: JCTModel,
    items: dict[str, list[Item]],
    labels: tuple[int, int],
    pool: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The hybrid engine for real, every request at t=0 (po): makespan against the simulator's, and
    the JCT model's r on the real steps."""
    out: dict[str, Any] = {}
    runs = []
    for name, its in items.items():
        its = its if name == "WL1" else its[: args.real_wl2]
        reqs, _ = harness.requests_and_arrivals(its, labels, args.seed)
        t = time.perf_counter()
        r = harness.run_trace(engine, CalibratedJCT(jct), "po", DEFAULT_FAIRNESS_LAMBDA, reqs, None)
        sim = sim_run(
            LinearStepModel(jct.coef), pool, engine.config.max_batch_tokens, "po", reqs, [0.0] * len(reqs)
        )
        runs.append(r)
        out[name] = {
            "requests": len(reqs),
            "makespan_s": r["makespan_s"],
            "sim_makespan_s": sim["makespan_s"],
            "sim_vs_real": sim["makespan_s"] / r["makespan_s"],
            "hit_rate": r["hit_rate"],
            "wall_s": time.perf_counter() - t,
        }
        print(
            f"  real {name}: {len(reqs)} requests, makespan {r['makespan_s']:.2f} s (simulated {sim['makespan_s']:.2f} s)"
        )
    out["jct"] = harness.jct_quality(runs)
    return out


# ---- the run ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    t0 = time.perf_counter()
    packages = installed_packages()
    print("installed packages:\n  " + "\n  ".join(packages))
    dev = resolve_device(args.device)
    args.model = shapes.PREFIX + args.shape
    folder = resolve_model_dir(args.model, weights=shapes.needs_weights(dev))
    mcfg = read_config(folder)
    gpu = describe(dev)
    print(f"device {gpu}; model {args.model} ({shapes.WEIGHTS_NOTE}), dtype {args.dtype}")
    doc: dict[str, Any] = {
        "device": gpu,
        "model": args.model,
        "weights": shapes.WEIGHTS_NOTE,
        "dtype": args.dtype,
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": harness.machine_info(),
        "packages": packages,
        "torch": torch.__version__,
        "model_config": repr(mcfg),
    }

    print("\nTable 2: maximum input length" + f" [{time.perf_counter() - t0:.0f} s]")
    mil: dict[str, Any] = {}
    wanted = args.mil_configs.split(",")
    for c in (c for c in MIL_CONFIGS if c in wanted and not c.startswith("hf")):
        print(f"  {c}: {MIL_CONFIGS[c]}")
        mil[c] = mil_ours(args, c, dev)
        free(dev)
    doc["mil"] = mil

    tok = load_tokenizer(folder)
    labels = label_ids(tok)
    work = traces(args, tok)
    longest = max(len(it.ids) for its in work.values() for it in its)
    pool = harness.pool_tokens(work["WL1"], args.cache_profiles)
    grid = SMALL_GRID if args.rehearsal else DEFAULT_GRID
    steps: dict[str, JCTModel] = {}
    print(
        f"\n[{time.perf_counter() - t0:.0f} s] JCT profiles (longest request {longest} tokens, prefix pool {pool} tokens)"
    )
    for config, mode in (("chunked", "chunked"), ("po", "hybrid")):
        engine = sweep_engine(args, dev, mode, pool, longest)
        t = time.perf_counter()
        jct = load_or_profile(engine, grid)
        steps[config] = LinearStepModel(jct.coef)
        print(f"  {mode}: coef {jct.coef} ({time.perf_counter() - t:.0f} s)")
        if config == "po":
            steps["fcfs"] = steps["po"]
            print("  one long prefill against the GEMM peak")
            doc["prefill"] = prefill_share(args, engine, dev)
            print(f"    {doc['prefill']}")
            print("  real saturated runs")
            doc["real"] = real_check(engine, jct, work, labels, pool, args)
            doc["jct_fit"] = {"coef": jct.coef, "quality": str(jct.quality)}
        del engine
        free(dev)

    print("\ntransformers" + f" [{time.perf_counter() - t0:.0f} s]")
    model = hf_model(args, dev, mcfg_dtype(args.dtype, dev))
    for c in (c for c in MIL_CONFIGS if c in wanted and c.startswith("hf")):
        print(f"  {c}: {MIL_CONFIGS[c]}")
        mil[c] = mil_hf(args, c, model, dev)
    hf_jct, hf_seconds = hf_step_model(args, model, dev)
    steps["hf"] = LinearStepModel(hf_jct.coef)
    doc["hf_step_seconds"] = dict(zip(_ints(args.hf_lengths), hf_seconds, strict=False))
    del model
    free(dev)
    doc["mil_ratios"] = mil_ratios(mil)

    print("\nFig. 6/7 on the simulator" + f" [{time.perf_counter() - t0:.0f} s]")
    doc["workloads"] = {n: workload_sweep(args, n, its, labels, steps, pool) for n, its in work.items()}
    doc["sweep_configs"] = SWEEP_CONFIGS
    doc["wall_s"] = time.perf_counter() - t0
    write(args, doc, gpu)
    return 0


def mcfg_dtype(name: str, dev: torch.device) -> torch.dtype:
    from po_backend.engine.config import parse_dtype

    return parse_dtype(name, dev)


def mil_ratios(mil: dict[str, Any]) -> dict[str, float]:
    ours = mil.get("hybrid", {}).get("mil")
    return {f"hybrid_vs_{c}": ours / m["mil"] for c, m in mil.items() if c != "hybrid" and ours and m["mil"]}


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def write(args: argparse.Namespace, doc: dict[str, Any], gpu: str) -> None:
    out = args.out_dir / f"gpu_paper_{slug(gpu)}"
    harness.save(out.with_suffix(".json"), doc, markdown(doc))
    try:
        from benchmarks import report
    except ImportError:  # matplotlib is not among the GPU machine's wheels
        print("no plot: matplotlib is not installed (report.plot_sweeps draws it from the JSON)")
        return
    report.plot_sweeps(doc["workloads"], out.with_suffix(".png"))


def markdown(doc: dict[str, Any]) -> str:
    def q(v: dict[str, Any]) -> str:
        return "n/a" if v["qps"] is None else f"{v['mark']}{v['qps']:.3f}"

    lines = [
        f"## The paper on one GPU: {doc['device']}",
        "",
        f"{doc['model']} ({doc['weights']}), {doc['dtype']}, torch {doc['torch']}; {doc['wall_s']:.0f} s.",
        "",
        "**Table 2, maximum input length** (bisection to 2%; >= where every probe fit):",
        "",
        "| config | tokens | first failure |",
        "|---|---:|---:|",
    ]
    for c, m in doc["mil"].items():
        lines.append(
            f"| {c}: {MIL_CONFIGS[c]} | {'>= ' if m['capped'] else ''}{m['mil']} | {m['first_failure']} |"
        )
    lines += ["", ", ".join(f"{k} {v:.2f}x" for k, v in doc["mil_ratios"].items()), ""]
    p = doc["prefill"]
    lines += [
        f"**One {p['tokens']}-token prefill**: {p['tok_per_s']:.0f} tok/s, {p['gflops'] / 1e3:.1f} TFLOP/s = "
        f"{p['gemm_peak_frac']:.0%} of the measured GEMM peak ({p['gemm_peak_gflops'] / 1e3:.1f} TFLOP/s, the "
        "higher of its readings before and after the prefill).",
        "",
        f"**JCT model on real steps**: r = {doc['real']['jct']['r_raw']:.3f} (raw), "
        f"{doc['real']['jct']['r_calibrated']:.3f} (calibrated), {doc['real']['jct']['steps']:.0f} steps. "
        + "; ".join(
            f"{n} real makespan {r['makespan_s']:.2f} s, simulated {r['sim_makespan_s']:.2f} s"
            for n, r in doc["real"].items()
            if n != "jct"
        ),
        "",
    ]
    for name, w in doc["workloads"].items():
        lines += [
            f"**{name}** ({w['requests']} requests, {w['tokens']} tokens; saturated {w['anchor_qps']:.3f} req/s; "
            "simulated with step times measured on the device):",
            "",
            "| load | config | QPS | mean s | P99 s |",
            "|---:|---|---:|---:|---:|",
        ]
        for r in sorted(w["runs"], key=lambda r: (r["mult"], r["config"])):
            lines.append(
                f"| {r['mult']:g}x | {r['config']} | {r['qps']:.3f} | {r['mean_s']:.2f} | {r['p99_s']:.2f} |"
            )
        lines += [
            "",
            "Sustained QPS (P99 within 2x its lowest-load value): "
            + ", ".join(f"{c} {q(v)}" for c, v in w["sustained"].items())
            + "; "
            + ", ".join(f"{k} {v:.2f}x" for k, v in w["ratios"].items()),
            "",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
