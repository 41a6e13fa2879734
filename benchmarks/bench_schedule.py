"""Scheduling and the JCT model in process on the embedded model and the server's own loop (no HTTP),
on WL1-style traces (users x posts sharing a per-user profile) and WL2-style ones (long unique
histories); the prefix pool holds `--cache-profiles` WL1 profiles (the paper's cache cannot hold
every user either). Modes:

- sweep (default): harness.sweep per workload and `--configs` (the paper's Fig. 10/11 ablations are
  configs: `po-nodiscard`, `po@LAMBDA`): the QPS each sustains at the P99 SLO, po / fcfs, and the
  JCT model's accuracy on every (held-out) step. QPS are multiples of the isolated throughput: WL1's
  all-at-t=0 rate is so much higher that a sweep anchored there never finds the SLO crossing.
  `--seed 0,1,2`: a sweep per seed, then every seed's requests pooled per load and config.
- `--offline`: items/s of the whole job queued at t=0 per config, and ours one request at a time.
- `--simulate`: the same traces on po_backend.sim.simulator, step times from a measured fit (`--jct`).
- `--held-out`: the held-out shapes of po_backend.sim.heldout (nobody tuned po on them) on the
  simulator, every `--seed` at 0.25-2x the sustainable load, pooled per shape and load: po's mean,
  P95 and P99 against fcfs's, and the worst over shapes below and at/above saturation. With
  `--engine`, the same traces on the embedded model's server loop instead (short: `--held-out-loads`).
- `--llamacpp`: llama.cpp (llama-cpp-python, optional) next to ours on the same GGUF and WL1 items.
- `--startup`: time to /health 200 and the start-up JCT model against the full profile.

    flock /tmp/po-bench.lock python -m benchmarks.bench_schedule      # ~25-35 min; --quick ~2 min
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness, report
from benchmarks import llamacpp as llamacpp_lib
from benchmarks.workloads import build_traces, label_ids
from po_backend.core.cpu import cpu_flags
from po_backend.core.request import ScoreRequest
from po_backend.core.settings import POLICIES
from po_backend.engine.hf_scorer import HFScorer
from po_backend.engine.models import shapes
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import CalibratedJCT, JCTModel
from po_backend.serving.jct_profile import load_or_profile, startup_jct
from po_backend.sim.heldout import ALL_SHAPES, LOADS, SHAPES, pooled, sustainable_qps, sweep, worst
from po_backend.sim.simulator import PrefixLRU, simulate

CONFIGS = {
    "hf": "transformers, FCFS, no prefix reuse (`--backend hf`)",
    "fcfs": "ours, FCFS + radix prefix cache",
    "chunked": "ours, FCFS + radix cache, chunked prefill (`--prefill-mode chunked`)",
    "srjf": "ours, shortest remaining job first",
    "lpm": "ours, longest prefix match",
    "po": "ours, prefix-aware SRJF + JCT calibration (`--schedule-policy po`)",
    "po-nodiscard": "ours, po with suffix discarding off (all but the last token declared as the prefix)",
}
if not set(POLICIES) <= set(CONFIGS):
    raise RuntimeError("bench_schedule and the scheduler disagree on the policies")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__, quick="tiny traces, 2 QPS points")
    mode = ap.add_mutually_exclusive_group()
    harness.flags(mode, offline=(False, "items/s of the whole job at t=0, no sweep"))
    harness.flags(mode, simulate=(False, "the sweep on po_backend.sim.simulator"))
    harness.flags(mode, held_out=(False, "po_backend.sim.heldout's shapes, pooled over --seed"))
    harness.flags(ap, engine=(False, "--held-out: on the embedded model instead of the simulator"))
    harness.flags(
        ap, held_out_loads=(",".join(f"{x:g}" for x in LOADS), "--held-out: x the sustainable load")
    )
    harness.flags(ap, held_out_shapes=(",".join(SHAPES), "--held-out: of po_backend.sim.heldout.ALL_SHAPES"))
    harness.flags(mode, llamacpp=(False, "llama.cpp next to ours on the same GGUF"))
    harness.flags(mode, startup=(False, "start-up time and the start-up JCT model"))
    harness.flags(ap, model=("embedded", "model path (not --llamacpp, --startup): a HF folder or shape:NAME"))
    harness.flags(ap, workers=(1, "--startup: servers booted at once, fresh cache"))
    harness.flags(ap, timeout=(900.0, "--startup: seconds to /health 200"))
    harness.flags(ap, configs=("fcfs,srjf,lpm,po", f"of {','.join(CONFIGS)}, po@LAMBDA"))
    harness.flags(ap, mults=("0.5,0.7,1,1.4,2,4", "QPS as multiples of the anchor QPS"))
    harness.flags(ap, mults_wl2=("0.5,1,2,4", "WL2's (empty: --mults)"))
    harness.flags(ap, baseline_items=(6, "--offline: requests hf runs"))
    harness.flags(ap, reprofile=(False, "re-time the JCT grid even if persisted"))
    harness.flags(ap, sim_mults="0.25,0.35,0.5,0.7,1,1.4,2,2.8,4,5.6,8")
    harness.flags(ap, sim_paper=("20,50", "USERS,POSTS of the paper-shaped WL1 trace"))
    harness.flags(ap, jct=(harness.RESULTS / "schedule.json", "--simulate: a run whose JCT fit times steps"))
    harness.add_sweep_args(ap, quiet_wait=60.0)
    harness.flags(ap, wl1_users=6, wl1_items=(12, "WL1 posts per user"), wl1_item_tokens=50)
    harness.flags(ap, wl1_profile=(500, "mean profile tokens (+-20%%)"), wl2_requests=8)
    harness.flags(ap, wl2_min=(1500, "WL2 shortest history tokens"), wl2_max=(2500, "WL2 longest"))
    args = ap.parse_args(argv)
    if args.quick:
        args.mults, args.mults_wl2, args.baseline_items = "0.5,2", "", 2
        args.wl1_users, args.wl1_items, args.wl1_profile, args.wl1_item_tokens = 2, 3, 300, 40
        args.wl2_requests, args.wl2_min, args.wl2_max = 2, 300, 500
        args.quiet_wait = min(args.quiet_wait, 5.0)
    if bad := [x for x in args.held_out_shapes.split(",") if x not in ALL_SHAPES]:
        ap.error(f"--held-out-shapes {','.join(bad)}: not one of {','.join(ALL_SHAPES)}")
    if args.out is None and args.held_out:
        stem = "schedule_heldout_engine" if args.engine else "schedule_heldout"
        args.out = harness.RESULTS / ("tmp" if args.quick else "") / f"{stem}.json"
    if args.out is None and args.startup:
        args.out = harness.RESULTS / f"startup{'_quick' if args.quick else ''}.json"
    elif args.out is None:
        stem = "llamacpp" if args.llamacpp else "schedule_sim" if args.simulate else "schedule"
        args.out = harness.RESULTS / ("tmp" if args.quick else "") / f"{stem}.json"  # tmp/: git-ignored
    args.out.parent.mkdir(parents=True, exist_ok=True)
    wanted = args.configs.split(",")
    if bad := [c for c in wanted if c not in CONFIGS and not re.fullmatch(r"po@\d+(\.\d+)?", c)]:
        ap.error(f"--configs {','.join(bad)}: not one of {','.join(CONFIGS)}, nor po@LAMBDA (LAMBDA >= 0)")
    # po@LAMBDA: po with that fairness lambda, beside the others on the same anchor and arrivals
    # (a second run would measure its own isolated latency, so its QPS points would differ).
    args.configs = [c for c in CONFIGS if c in wanted] + [c for c in wanted if c.startswith("po@")]
    return args


def policy_of(config: str, default_lambda: float) -> tuple[str, float]:
    """A config's scheduling policy and fairness lambda: `po@LAMBDA` is po with that lambda, every
    other config (hf and chunked run fcfs, po-nodiscard po) its own policy with `default_lambda`."""
    policy, _, lam = config.partition("@")
    policy = {"hf": "fcfs", "chunked": "fcfs", "po-nodiscard": "po"}.get(policy, policy)
    return policy, float(lam) if lam else default_lambda


def floats(csv: str) -> list[float]:
    return [float(x) for x in csv.split(",")]


def sweep_name(trace: str, seed: int, seeds: list[int]) -> str:
    """A sweep's key in the results: its trace, and its seed where the run swept several."""
    return trace if len(seeds) == 1 else f"{trace} seed {seed}"


def pool_seeds(doc: dict[str, Any], traces: dict[str, Any], seeds: list[int]) -> None:
    """With several seeds, each trace's sweeps pooled (`harness.pooled`) into doc["pooled"]."""
    if len(seeds) > 1:
        doc["pooled"] = {
            t: harness.pooled([doc["workloads"][sweep_name(t, s, seeds)]["runs"] for s in seeds])
            for t in traces
        }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if args.startup:
        return startup(args)
    if args.held_out:
        return held_out(args)
    tok = harness.tokenizer(args.model)
    traces = build_traces(args, tok, ("WL1",) if args.llamacpp else tuple(args.workloads.split(",")))
    if args.llamacpp:
        return llamacpp(args, traces["WL1"], label_ids(tok))
    # --cache-profiles 0: the engine's default pool.
    pool = harness.pool_tokens(traces["WL1"], args.cache_profiles) if "WL1" in traces else 0
    pool = pool if args.cache_profiles else 0
    if args.simulate:
        return simulate_main(args, traces, tok, pool)
    info = harness.machine_info()
    print(f"machine: {info['cpu']} | {info['cores']} cores | torch threads {info['torch_threads']}")
    harness.wait_for_quiet(args.quiet_wait)
    engine = harness.load_engine(pool or None, model=args.model)
    print(f"dtype {engine.config.dtype}, max_batch_tokens {engine.config.max_batch_tokens}, pool {pool}")

    def profile() -> tuple[JCTModel, float]:
        t = time.perf_counter()
        return load_or_profile(engine, refresh=args.reprofile), time.perf_counter() - t

    # Timed again if other processes used the CPU meanwhile: a profile timed on a busy CPU prices
    # steps wrongly for the whole run.
    jct, profile_s = harness.quietly(profile, "profiling", args.quiet_wait)[0]
    q = jct.quality
    print(f"JCT profile ({profile_s:.1f} s): held-out r={q.pearson_r if q else '?'}, coef {jct.coef}")
    doc: dict[str, Any] = {
        "machine": info,
        "args": vars(args),
        "dtype": str(engine.config.dtype),
        "model": args.model,
        "weights": shapes.weights_note(args.model) or "real",
        "jct_fit": {"profile_seconds": profile_s, "coef": jct.coef, **(asdict(q) if q else {})},
        "pool_tokens": pool,
        "workloads": {},
        "configs": {},
    }
    setups: dict[str, harness.Setup] = {}
    for c in args.configs:
        if c == "hf":
            scorer: Any = HFScorer.from_pretrained(args.model, max_input_len=harness.MAX_INPUT_LEN)
        elif c == "chunked":  # it shares the hybrid engine's JCT model: under FCFS it only logs
            scorer = harness.load_engine(pool or None, "chunked", args.model)
        else:
            scorer = engine
        setups[c] = setup = harness.Setup(scorer, *policy_of(c, args.fairness_lambda), c == "po-nodiscard")
        doc["configs"][c] = CONFIGS.get(c, f"{CONFIGS['po']}, fairness lambda {setup.lam:g}")
    cal = CalibratedJCT(jct)  # one calibration for the whole benchmark, as one long-lived server
    partial = args.out.with_suffix(".partial.json")

    def keep(name: str, runs: list[dict[str, Any]]) -> None:  # a long run that gets killed keeps its data
        partial.write_text(json.dumps({"report": doc, "running": {name: runs}}, default=str))

    def point(reqs: list[ScoreRequest], config: str, arrivals: list[float]) -> dict[str, Any]:
        harness.wait_for_quiet(args.quiet_wait)
        s = setups[config]
        return harness.run_trace(s.scorer, cal, s.policy, s.lam, s.requests(reqs), arrivals)

    all_runs: list[dict[str, Any]] = []  # everything with a step log, in the order it ran
    seeds = harness.seeds(args.seed)
    for (trace, items), seed in itertools.product(traces.items(), seeds):
        name = sweep_name(trace, seed, seeds)
        reqs, unit = harness.requests_and_arrivals(items, label_ids(tok), seed)
        tokens = sum(len(r.input_ids) for r in reqs)
        print(f"\n{name}: {len(reqs)} requests, {tokens} tokens, mean {tokens / len(reqs):.0f} per request")
        if args.offline:
            doc["workloads"][name] = {"offline": offline(setups, engine, cal, reqs, args.baseline_items)}
            continue
        harness.wait_for_quiet(args.quiet_wait)
        iso = harness.isolated(engine, cal, reqs)
        harness.wait_for_quiet(args.quiet_wait)
        sat = harness.run_trace(engine, cal, "po", args.fairness_lambda, reqs, None)
        print(
            f"  isolated mean {iso['mean_s']:.2f} s (P99 SLO {args.slo_x * iso['mean_s']:.2f} s); saturated "
            f"po {len(reqs) / sat['makespan_s']:.3f} req/s, hits {sat['hit_rate']:.0%}"
        )
        mults = floats(args.mults_wl2 if trace == "WL2" and args.mults_wl2 else args.mults)
        run, kept = functools.partial(point, reqs), functools.partial(keep, name)
        w = harness.sweep(run, args.configs, reqs, unit, mults, iso, args, sat, kept)
        all_runs += [w["isolated"], w["saturated"], *w["runs"]]
        at_slo = w["at_slo"][f"{args.slo_x:g}"]
        doc["workloads"][name] = {**w, **{k: at_slo[k] for k in ("sustained_qps", "po_vs_fcfs")}}
        doc["workloads"][name]["jct"] = harness.jct_quality(w["runs"])
    if args.offline:
        return harness.save(args.out, doc)
    doc["jct_online"] = harness.jct_quality(all_runs)
    pool_seeds(doc, traces, seeds)
    harness.save(args.out, doc, report.schedule_markdown(doc, args.configs))
    report.plot_sweeps(doc["workloads"], args.out.with_suffix(".png"), report.QPS_NAMES)
    partial.unlink(missing_ok=True)


def offline(
    setups: dict[str, harness.Setup], ours: Any, jct: CalibratedJCT, reqs: list[ScoreRequest], hf_items: int
) -> dict[str, Any]:
    """Items/s of the job queued at t=0 per setup, and of ours one request at a time. hf reuses
    nothing, so every item costs it the same: it runs the first `hf_items` requests only."""
    iso = harness.isolated(ours, jct, reqs)
    out = {"ours, one at a time": {"items": len(reqs), "items_per_s": len(reqs) / sum(iso["latencies"])}}
    for name, s in setups.items():
        part = s.requests(reqs[:hf_items] if name == "hf" else reqs)
        r = harness.run_trace(s.scorer, jct, s.policy, s.lam, part, None)
        counts = {k: r[k] for k in ("hit_rate", "mean_batch", "inserted_tokens", "evicted_tokens") if k in r}
        out[name] = {"items": len(part), "items_per_s": len(part) / r["makespan_s"], **counts}
    base = out.get("hf", {}).get("items_per_s")
    for name, o in out.items():
        vs = f" ({o['items_per_s'] / base:.1f}x hf)" if base else ""
        print(f"  {name:20s} {o['items']:4d} items: {o['items_per_s']:.3f} items/s{vs}")
    return out


def simulate_main(args: argparse.Namespace, traces: dict[str, list[Any]], tok: Any, pool: int) -> None:
    """The sweep on the simulator: isolated latency (each request alone, in trace order, the cache
    carried over), then every (multiple of the isolated rate, policy)."""
    engine = harness.load_engine(
        pool or None, model=args.model
    )  # its batching limit and, without a measured run, its profile
    model, source = harness.sim_step_model(args.jct, engine)
    print(f"step times: JCT model from {source}: coef {model.coef}")
    if "WL1" in traces:
        users, posts = (int(x) for x in args.sim_paper.split(","))
        paper = argparse.Namespace(**{**vars(args), "wl1_users": users, "wl1_items": posts})
        traces[f"WL1 {users}x{posts}"] = build_traces(paper, tok, ("WL1",))["WL1"]
    policies = [c for c in args.configs if c.partition("@")[0] in POLICIES]

    def run(reqs: list[ScoreRequest], config: str, arrivals: list[float]) -> dict[str, Any]:
        cache = PrefixLRU(pool, engine.config.max_batch_tokens)
        sched = SchedulerConfig(*policy_of(config, args.fairness_lambda))
        out = simulate(sched, model, list(zip(arrivals, reqs, strict=True)), cache)
        steps = max(r.step for r in out) + 1
        lat = [r.end - r.arrival for r in out]
        return {
            "policy": sched.policy,
            **harness.latency_summary(lat),
            "latencies": lat,
            "hit_rate": sum(r.cached for r in out) / sum(len(r.input_ids) for r in reqs),
            "steps": steps,
            "mean_batch": len(out) / steps,
            "other_cores": 0.0,
        }

    doc: dict[str, Any] = {"args": vars(args), "jct_source": source, "coef": model.coef, "pool_tokens": pool}
    doc["workloads"] = {}
    seeds = harness.seeds(args.seed)
    for (trace, items), seed in itertools.product(traces.items(), seeds):
        name = sweep_name(trace, seed, seeds)
        reqs, unit = harness.requests_and_arrivals(items, label_ids(tok), seed)
        t = time.perf_counter()
        iso = run(reqs, "fcfs", [1e6 * i for i in range(len(reqs))])  # 1e6 s apart: none ever waits
        w = harness.sweep(
            functools.partial(run, reqs), policies, reqs, unit, floats(args.sim_mults), iso, args
        )
        doc["workloads"][name] = w
        ratios = ", ".join(f"{x}x: {a['po_vs_fcfs']}" for x, a in w["at_slo"].items())
        print(
            f"{name}: {len(reqs)} requests simulated in {time.perf_counter() - t:.1f} s; po / fcfs {ratios}"
        )
    pool_seeds(doc, traces, seeds)
    harness.save(args.out, doc, report.schedule_sim_markdown(doc, policies))
    report.plot_sweeps(doc["workloads"], args.out.with_suffix(".png"))


# ---- --held-out: traces nobody tuned po on -----------------------------------------------------------


def held_out(args: argparse.Namespace) -> None:
    """po against fcfs on po_backend.sim.heldout's shapes, every seed and load pooled per (shape,
    load); on the simulator (step times from `--jct`'s fit) or, with `--engine`, on the embedded
    model's loop at the rates the simulator finds sustainable."""
    model, source = harness.sim_step_model(args.jct)
    configs = {c: SchedulerConfig(*policy_of(c, args.fairness_lambda)) for c in args.configs if c != "hf"}
    configs = {"fcfs": SchedulerConfig("fcfs"), **configs}
    shapes = [ALL_SHAPES[x] for x in args.held_out_shapes.split(",")]
    seeds, loads = harness.seeds(args.seed), floats(args.held_out_loads)
    t = time.perf_counter()
    doc: dict[str, Any] = {"args": vars(args), "jct_source": source, "coef": model.coef}
    if args.engine:
        doc["machine"] = info = harness.machine_info()
        print(f"machine: {info['cpu']} | {info['cores']} cores | step times of the load: {source}")
        rows = held_out_engine(configs, model, shapes, seeds, loads, args)
    else:
        rows = sweep(configs, model, shapes, seeds, loads)
    doc["table"] = table = pooled(rows)
    doc["worst"] = {
        c: {"below": worst(table, c, True), "above": worst(table, c, False)} for c in configs if c != "fcfs"
    }
    doc["seconds"] = time.perf_counter() - t
    for c, w in doc["worst"].items():
        for where, stats in w.items():
            cells = ", ".join(
                f"{k} {v['ratio']:.2f}x ({v['shape']} {v['load']:g}x)" for k, v in stats.items()
            )
            print(f"{c} / fcfs, worst {where} saturation: {cells}")
    harness.save(args.out, doc, held_out_markdown(doc))


def held_out_engine(
    configs: dict[str, SchedulerConfig],
    model: Any,
    shapes: list[Any],
    seeds: list[int],
    loads: list[float],
    args: argparse.Namespace,
) -> list[dict[str, Any]]:
    """`sweep`'s rows measured on the embedded model: each trace replayed through the server's
    loop on a cold cache (the engine's default pool), at the simulator's sustainable rate, with
    the JCT model a server starts with (`startup_jct`)."""
    engine = harness.load_engine()
    jct = startup_jct(engine, "po")
    rows = []
    for shape, seed in itertools.product(shapes, seeds):
        reqs, unit = shape.trace(seed, vocab=engine.vocab_size)
        qps = sustainable_qps(
            reqs, model, sum(len(r.input_ids) for r in reqs), engine.config.max_batch_tokens
        )
        for load, (name, cfg) in itertools.product(loads, configs.items()):
            harness.wait_for_quiet(args.quiet_wait)
            arrivals = [u / (load * qps) for u in unit]
            r = harness.run_trace(engine, jct, cfg.policy, cfg.fairness_lambda, reqs, arrivals)
            print(
                f"  {shape.name} seed {seed} {load:g}x {name}: mean {r['mean_s']:.2f} s, P99 {r['p99_s']:.2f} s"
            )
            row = {"shape": shape.name, "seed": seed, "load": load, "config": name}
            rows.append({**row, "latencies": r["latencies"], "other_cores": r["other_cores"]})
    return rows


def held_out_markdown(doc: dict[str, Any]) -> str:
    a = doc["args"]
    where = "the embedded model's loop" if a["engine"] else f"the simulator (step times: {doc['jct_source']})"
    intro = (
        f"`bench_schedule --held-out{' --engine' if a['engine'] else ''} --seed {a['seed']}` on {where}: "
        f"shapes {a['held_out_shapes']}, loads {a['held_out_loads']} x the sustainable load (fcfs's rate "
        "with the whole trace queued at once), every seed's requests pooled per shape and load."
    )
    head = "config | shape | load | requests | mean / fcfs | P95 / fcfs | P99 / fcfs"
    spec = "config shape load:g requests mean_vs_fcfs:.2f p95_vs_fcfs:.2f p99_vs_fcfs:.2f"
    rows = [report.cells(r, spec) for r in doc["table"] if r["config"] != "fcfs"]
    worst_rows = [
        [c, where, *(f"{v['ratio']:.2f}x ({v['shape']} {v['load']:g}x)" for v in stats.values())]
        for c, w in doc["worst"].items()
        for where, stats in w.items()
        if stats
    ]
    worst_md = report.markdown_table("config | saturation | mean | P95 | P99", worst_rows)
    return "\n\n".join((intro, worst_md, report.markdown_table(head, rows)))


# ---- --llamacpp: llama.cpp next to ours -------------------------------------------------------------

# An sdist (~9 min of both cores to compile): built once into a cached wheel, AMX off (the default
# build crashed in its AMX matmul on a Xeon) and AVX512 only where the CPU has it (AVX2-only CPUs fault).
INSTALL = (
    'CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512={} -DGGML_AVX512_BF16={} -DGGML_AVX512_VNNI={} '
    '-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" .venv/bin/pip wheel --no-deps -w {w} '
    "llama-cpp-python && .venv/bin/pip install {w}/llama_cpp_python-*.whl"
)


def llamacpp(args: argparse.Namespace, items: list[Any], labels: tuple[int, int]) -> None:
    """P(Yes) of every item, one at a time in user order: ours through the radix prefix cache,
    llama.cpp keeping its KV state and evaluating only the tokens after the longest common prefix
    with the previous prompt (its prompt-cache behaviour). llama.cpp computes on the GGUF's
    quantised weights, ours on them dequantised once: agreement = same argmax of (Yes, No)."""
    doc: dict[str, Any] = {
        "machine": harness.machine_info(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if not llamacpp_lib.available():
        on = ["ON" if f in cpu_flags() else "OFF" for f in ("avx512f", "avx512_bf16", "avx512_vnni")]
        doc["status"] = "not run: llama-cpp-python not installed"
        doc["install"] = INSTALL.format(*on, w=Path("~/.cache/prefillonly/wheels").expanduser())
        print(doc["status"] + "\n  install: " + doc["install"])
        return harness.save(args.out, doc)
    from po_backend.engine.models.loader import embedded_model_file

    def p_yes(logit_yes: float, logit_no: float) -> float:  # a log-softmax's normaliser cancels here
        return 1.0 / (1.0 + math.exp(min(logit_no - logit_yes, 700.0)))  # no overflow

    def timed(score: Callable[[Any], float]) -> dict[str, Any]:
        lat, probs = [], []
        for it in items:
            t = time.perf_counter()
            probs.append(score(it))
            lat.append(time.perf_counter() - t)
        return {"items_per_s": len(items) / sum(lat), "mean_s": float(np.mean(lat)), "p_yes": probs}

    engine, gguf = harness.load_engine(), embedded_model_file()

    def score_ours(it: Any) -> float:
        return p_yes(*engine.score([list(it.ids)], labels, cache_prefix_len=len(it.prefix))[0].logprobs)

    ours = timed(score_ours)
    llm = llamacpp_lib.load(gguf, n_ctx=max(len(it.ids) for it in items) + 16)

    def score_llamacpp(it: Any) -> float:
        ids = list(it.ids)
        logprobs = llamacpp_lib.last_logprobs(llm, ids, keep=llamacpp_lib.shared_prefix(llm, ids))
        return p_yes(float(logprobs[labels[0]]), float(logprobs[labels[1]]))

    lc = timed(score_llamacpp)
    pairs = list(zip(ours["p_yes"], lc["p_yes"], strict=True))
    doc |= {
        "status": "ok",
        "gguf": gguf.name,
        "items": len(items),
        "ours": ours,
        "llamacpp": lc,
        "agreement": sum((a >= 0.5) == (b >= 0.5) for a, b in pairs) / len(pairs),
        "max_abs_dp_yes": max(abs(a - b) for a, b in pairs),
        "ours_vs_llamacpp": ours["items_per_s"] / lc["items_per_s"],
    }
    print(
        f"ours {ours['items_per_s']:.2f} items/s vs llama.cpp {lc['items_per_s']:.2f} ({doc['ours_vs_llamacpp']:.2f}x)"
    )
    harness.save(args.out, doc)


# ---- --startup: start-up time and the start-up JCT model ----------------------------------------------


def time_starts(workers: int, timeout: float) -> dict[str, Any]:
    """Seconds from launch to /health 200: fresh cache (all workers at once), then a later start."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="po-start-") as cache:
        env = {**os.environ, "PREFILLONLY_CACHE": cache}
        for phase, n in (("first", workers), ("later", 1)):
            # The default log level: the counts below read its INFO lines.
            servers = [harness.our_server(env=env, log_level="info") for _ in range(n)]
            with harness.servers_up(servers, timeout) as ready:
                logs = [s.log_text(200_000) for s in servers]
            out[phase] = {
                "workers": n,
                "health_200_s": ready,
                "converted": sum("converted SmolLM2" in t for t in logs),
                "jct_measured": sum("JCT profile (quick):" in t for t in logs),
                "log_lines": [len(t.splitlines()) for t in logs],
                "log": logs[0].splitlines()[-40:],
            }
            print(phase, ready, flush=True)
    return out


def jct_accuracy(max_input_len: int, warmup: int, held: int) -> dict[str, Any]:
    """Today's model (the full ProfileGrid profile, with the running calibration) and the start-up
    one (QUICK_GRID's estimate, calibrated and refined online) predict every real step of traffic
    like a scoring server's (1-4 items of log-uniform length, half sharing a user prefix) before it
    runs; after `warmup` steps, Pearson r and median relative error on the held-out steps."""
    from po_backend.engine.engine import Engine
    from po_backend.sched.jct import prediction_quality
    from po_backend.serving import jct_profile as jp

    engine = Engine.from_pretrained("embedded", max_input_len=max_input_len)
    t0 = time.perf_counter()
    grid, _ = jp.measure(engine, jp.DEFAULT_GRID, "grid")
    t1 = time.perf_counter()
    quick, anchors = jp.measure(engine, jp.QUICK_GRID, "quick", retry=False)
    out: dict[str, Any] = {
        "max_input_len": max_input_len,
        "warmup_steps": warmup,
        "held_out_steps": held,
        "grid_profile_s": round(t1 - t0, 1),
        "quick_profile_s": round(time.perf_counter() - t1, 1),
        "grid_fit_loo": grid.quality.__dict__ if grid.quality else None,
        "quick_fit_loo": quick.quality.__dict__ if quick.quality else None,
        "grid_coef": grid.coef,
        "quick_coef": quick.coef,
    }
    models = {
        "today_grid_calibrated": CalibratedJCT(grid),
        "today_grid_raw": CalibratedJCT(grid, alpha=1e-9),
        "quick_calibrated_no_refit": CalibratedJCT(quick),
        "new_quick_refined": CalibratedJCT(quick, refine_every=jp.REFINE_EVERY, anchors=anchors),
    }
    preds: dict[str, list[float]] = {k: [] for k in models}
    measured: list[float] = []
    rng, vocab = random.Random(1), engine.vocab_size
    users = [
        tuple(rng.randrange(vocab) for _ in range(rng.randint(64, max_input_len // 2))) for _ in range(6)
    ]
    engine.flush_cache()
    for i in range(warmup + held):
        k, reqs = rng.choice([1, 1, 2, 4]), []
        for _ in range(k):
            total = int(math.exp(rng.uniform(math.log(64), math.log(max_input_len // k))))
            prefix = rng.choice(users)[: total // 2] if rng.random() < 0.5 else ()
            ids = prefix + tuple(rng.randrange(vocab) for _ in range(total - len(prefix)))
            reqs.append(ScoreRequest(ids, (0,), cache_prefix_len=len(prefix)))
        t = time.perf_counter()
        steps = [(r.prompt_tokens, r.cached_tokens) for r in engine.step(reqs)]
        measured.append(time.perf_counter() - t)
        for name, m in models.items():
            preds[name].append(m.predict_items(steps))  # before it sees this step
            m.observe(steps, measured[-1])
        if (i + 1) % 16 == 0:
            print(f"step {i + 1}/{warmup + held}", flush=True)
    refined = models["new_quick_refined"]
    out["refined_coef"], out["refits"] = refined.model.coef, refined.refits
    for name in models:
        q = prediction_quality(preds[name][warmup:], measured[warmup:])
        out[name] = {"pearson_r": round(q.pearson_r, 4), "median_rel_error": round(q.median_rel_error, 4)}
        print(name, out[name], flush=True)
    return out


def startup(args: argparse.Namespace) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per /health poll otherwise
    m = harness.machine_info()
    doc = {k: m[k] for k in ("cpu", "cores", "torch_threads")} | {"load_avg_at_start": os.getloadavg()}
    doc["starts"] = time_starts(args.workers, args.timeout)
    doc["accuracy"] = jct_accuracy(*((2048, 48, 48) if args.quick else (8192, 96, 96)))
    doc["load_avg_at_end"] = os.getloadavg()
    harness.save(args.out, doc)


if __name__ == "__main__":
    main()
