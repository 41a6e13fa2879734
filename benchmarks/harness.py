"""What the benchmarks share: machine facts and CPU contention, spawning our servers, engines with a
bounded prefix pool, trace replay through the serving loop (Poisson arrivals), the isolated /
saturated / swept measurements and the sustained-QPS analysis. Rendering lives in report.py."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import platform
import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import psutil
import torch

from benchmarks.workloads import Item
from po_backend.core.cpu import cpu_class, cpu_flags, cpu_has_fast_bf16, cpu_model
from po_backend.core.request import ScoreRequest
from po_backend.core.settings import DEFAULT_FAIRNESS_LAMBDA
from po_backend.engine.engine import Engine
from po_backend.engine.models.loader import load_tokenizer, resolve_model_dir
from po_backend.entrypoints.launch_cluster import worker_command
from po_backend.entrypoints.spawn import ServerProcess, free_port
from po_backend.sched.jct import CalibratedJCT, JCTModel, prediction_quality
from po_backend.serving.jct_profile import load_or_profile
from po_backend.serving.loop import EngineLoop
from po_backend.sim.cluster import LinearStepModel, p99, poisson_arrivals

MiB = 1 << 20
GiB = 1 << 30
RESULTS = Path(__file__).resolve().parent / "results"
REPO_ROOT = RESULTS.parent.parent
MAX_INPUT_LEN = 4096
T = TypeVar("T")


@dataclass(frozen=True)
class Setup:
    """One config of a sweep: a scorer EngineLoop can drive, its policy and fairness lambda.
    `keep_suffix`: each request declares all but its last token as its cache prefix, so suffixes
    enter the pool too (the paper's suffix-discarding ablation)."""

    scorer: Any
    policy: str
    lam: float
    keep_suffix: bool = False

    def requests(self, reqs: list[ScoreRequest]) -> list[ScoreRequest]:
        return [replace(r, cache_prefix_len=len(r.input_ids) - 1) for r in reqs] if self.keep_suffix else reqs


def parser(doc: str | None, out: Path | None = None, quick: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring's first line, `--out` and, given its help, `--quick`."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    ap.add_argument("--out", type=Path, default=out, help="result JSON (.md and any plot beside it)")
    if quick:
        ap.add_argument("--quick", action="store_true", help=quick)
    return ap


def flags(ap: argparse.ArgumentParser | Any, **spec: Any) -> None:
    """One `--name` flag (underscores become dashes) per keyword; its value: the default, or
    (default, help). The default decides the flag: False a switch, a list a choice of its items (the
    first by default), None a string, else a value of the default's type."""
    for name, value in spec.items():
        default, text = value if isinstance(value, tuple) else (value, None)
        kw: dict[str, Any] = {"help": text}
        if default is False:
            kw["action"] = "store_true"
        elif isinstance(default, list):
            kw.update(choices=default, default=default[0])
        else:
            kw.update(default=default, type=str if default is None else type(default))
        ap.add_argument("--" + name.replace("_", "-"), **kw)


def save(out: Path, doc: dict[str, Any], md: str | None = None) -> None:
    """A benchmark's result: `out` (JSON) and, given `md`, the markdown beside it (.md), printed too."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1, default=str))
    if md is not None:
        print("\n" + md)
        out.with_suffix(".md").write_text(md)
    print(f"wrote {out}" + ("" if md is None else f" and {out.with_suffix('.md').name}"))


def our_server(
    flags: Sequence[str] = (),
    model_path: str = "embedded",
    cwd: str | os.PathLike[str] | None = REPO_ROOT,
    env: dict[str, str] | None = None,
    log_level: str = "warning",
) -> ServerProcess:
    """Our server as launch_cluster starts a worker, on a free port; not started."""
    port = free_port()
    cmd = worker_command(model_path, port, ["--log-level", log_level, *flags])
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", cwd=cwd, env=env)


@contextlib.contextmanager
def servers_up(servers: Sequence[ServerProcess], timeout: float = 600.0) -> Iterator[list[float]]:
    """Start `servers` side by side; yields each one's seconds from launch to ready; stops them all."""
    t0, ready = time.monotonic(), []
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready(timeout)
            ready.append(round(time.monotonic() - t0, 1))
        yield ready
    finally:
        for s in servers:
            s.stop()


def machine_info() -> dict[str, Any]:
    import transformers  # only for its version string

    flags = cpu_flags()
    isa = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    return {
        "cpu": cpu_model(),
        "cpu_class": cpu_class(),
        "arch": platform.machine(),
        "flags": {f: f in flags for f in isa},
        "fast_bf16": cpu_has_fast_bf16(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "mem_total_gib": round(psutil.virtual_memory().total / GiB, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }


def _process_seconds(pid: int | None) -> float:
    """CPU seconds of this process (None) or of process `pid` (0 once it is gone)."""
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system


class CpuShare:
    """Cores used during a `with` block by process `pid` if given (a server this benchmark launched:
    `pid_cores`) and by everything but it and this process (`other_cores`): on a shared machine a
    run that had other work beside it is slower than the code is."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid

    def _now(self) -> np.ndarray:
        """The clock; CPU seconds all cores spent busy since boot, this process's and `pid`'s. `nice`
        time counts as idle: niced background work (tests, builds) yields the cores to a benchmark,
        so it neither slows it much nor should stall it."""
        t = psutil.cpu_times()
        busy = sum(getattr(t, k, 0.0) for k in ("user", "system", "irq", "softirq", "steal"))
        pid = _process_seconds(self.pid) if self.pid is not None else 0.0
        return np.array([time.perf_counter(), busy, _process_seconds(None), pid])

    def __enter__(self) -> CpuShare:
        self._start = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        wall, busy, own, pid = self._now() - self._start
        self.pid_cores = pid / max(wall, 1e-9)
        self.other_cores = max(0.0, busy - own - pid) / max(wall, 1e-9)


def quietly(run: Callable[[], T], what: str, quiet_wait: float = 60.0, tries: int = 3) -> tuple[T, CpuShare]:
    """`run()`, again (`tries` times at most) while other processes used over half a core during it:
    a measurement later ones are scaled by (a JCT profile, the isolated latency) must not carry
    another process's load into a whole run. One under a second is kept: too short to tell."""
    for attempt in range(1, tries + 1):
        t = time.perf_counter()
        with CpuShare() as cpu:
            out = run()
        if cpu.other_cores < 0.5 or time.perf_counter() - t < 1.0 or attempt == tries:
            break
        print(f"other processes used {cpu.other_cores:.2f} cores while {what}: waiting, then again")
        wait_for_quiet(quiet_wait)
    return out, cpu


def wait_for_quiet(max_wait: float, threshold: float = 0.3, probe: float = 2.0) -> None:
    """Wait until other processes use fewer than `threshold` cores (or `max_wait` seconds pass)."""
    deadline = time.perf_counter() + max_wait
    while True:
        with CpuShare() as cpu:
            time.sleep(probe)
        if cpu.other_cores < threshold or time.perf_counter() >= deadline:
            return


def tokenizer(path: str = "embedded") -> Any:
    """A model's tokenizer without loading the model (the traces decide the pool size)."""
    return load_tokenizer(resolve_model_dir(path))


def pool_tokens(items: Sequence[Item], profiles: float) -> int:
    """A prefix pool of `profiles` times the longest declared prefix (+ slack for a split node): as
    in the paper, where 20 users' profiles do not fit next to the model, the cache cannot hold
    every user (the engine's default pool would hold all of our scaled-down workloads)."""
    return int(profiles * max(len(it.prefix) for it in items)) + 64


def load_engine(
    prefix_pool_tokens: int | None = None, prefill_mode: str = "hybrid", model: str = "embedded"
) -> Engine:
    # "declared": only the prefix a request declares (the user profile) enters the cache: the
    # paper's suffix discarding (Setup.keep_suffix turns it off per request).
    return Engine.from_pretrained(
        model,
        cache_policy="declared",
        max_input_len=MAX_INPUT_LEN,
        prefill_mode=prefill_mode,
        prefix_pool_tokens=prefix_pool_tokens,
    )


def requests_and_arrivals(
    items: Iterable[Item], labels: tuple[int, int], seed: int
) -> tuple[list[ScoreRequest], list[float]]:
    """Shuffled requests (users interleave, as independent clients would) and unit-rate Poisson
    arrival times: a point at QPS q uses arrivals / q, so every point has the same pattern."""
    rng = random.Random(seed)
    items = list(items)
    rng.shuffle(items)
    reqs = [ScoreRequest(it.ids, labels, cache_prefix_len=len(it.prefix)) for it in items]
    return reqs, poisson_arrivals(len(reqs), rng)


def sim_step_model(
    path: Path = RESULTS / "schedule.json", engine: Engine | None = None
) -> tuple[LinearStepModel, str]:
    """The simulators' step times: the JCT fit of the last measured bench_schedule run (`path`),
    else this machine's persisted profile of `engine` (the embedded model's when None)."""
    if path.is_file():
        return LinearStepModel(json.loads(path.read_text())["jct_fit"]["coef"]), f"the fit in {path.name}"
    model = load_or_profile(engine or load_engine())
    return LinearStepModel(model.coef), "this machine's persisted JCT profile"


def latency_summary(lat: Sequence[float]) -> dict[str, float]:
    a = np.asarray(lat, dtype=float) if len(lat) else np.array([math.nan])
    median, tail = np.percentile(a, [50, 99])
    return {"mean_s": float(a.mean()), "p50_s": float(median), "p99_s": float(tail)}


def replay(loop: EngineLoop, reqs: list[ScoreRequest], arrivals: list[float] | None) -> dict[str, Any]:
    """Submit `reqs` at `arrivals` (seconds from start, ascending; None: all at t=0), wait for every
    one, drain the loop. Latency = completion - submission, per request. `loop` must be built with
    start=False: the requests of the first instant are all queued before the worker starts, so the
    first pick sees them together (submitted one by one, the first would get the engine alone)."""
    n = len(reqs)
    at = arrivals if arrivals is not None else [0.0] * n
    first = next((i for i, a in enumerate(at) if a > at[0]), n)
    submitted, finished = [math.nan] * n, [math.nan] * n

    def track(i: int, f: Future) -> Future:
        f.add_done_callback(lambda _: finished.__setitem__(i, time.perf_counter()))
        return f

    with CpuShare() as cpu:
        t0 = time.perf_counter()
        futs = [track(i, f) for i, f in enumerate(loop.submit_many(reqs[:first]))]
        submitted[:first] = [t0] * first
        loop.start()
        for i in range(first, n):
            time.sleep(max(0.0, t0 + at[i] - time.perf_counter()))
            submitted[i] = time.perf_counter()
            futs.append(track(i, loop.submit(reqs[i])))
        for f in futs:
            f.result()  # a failed request fails the benchmark
        loop.shutdown(drain=True)
    lat = np.array(finished) - np.array(submitted)
    if not np.isfinite(lat).all():
        raise RuntimeError("a request has no completion time")
    return {
        "latencies": lat.tolist(),
        "cached_tokens": [f.result().cached_tokens for f in futs],
        **latency_summary(lat),
        "makespan_s": float(max(finished) - t0),
        "other_cores": cpu.other_cores,
    }


def run_trace(
    scorer: Any,
    jct: JCTModel | CalibratedJCT,
    policy: str,
    lam: float,
    reqs: list[ScoreRequest],
    arrivals: list[float] | None,
) -> dict[str, Any]:
    """Replay `reqs` through a fresh EngineLoop on a cold cache, with its step log and stats. A
    CalibratedJCT carries its online calibration from run to run, as one long-lived server would."""
    scorer.flush_cache()
    before = scorer.stats()
    loop = EngineLoop(scorer, policy=policy, fairness_lambda=lam, jct=jct, max_queue=1 << 20, start=False)
    r = replay(loop, reqs, arrivals)
    after, st = scorer.stats(), loop.stats()
    prompt = after.prompt_tokens - before.prompt_tokens
    out = {
        "policy": policy,
        **r,
        "hit_rate": (after.cached_tokens - before.cached_tokens) / prompt if prompt else 0.0,
        "steps": st.steps,
        "mean_batch": st.mean_batch_items,
        "calibration": st.jct_calibration,
        "step_log": step_rows(loop),
    }
    if before.cache and after.cache:  # the transformers baseline has no cache
        out["inserted_tokens"] = after.cache.inserted_tokens_total - before.cache.inserted_tokens_total
        out["evicted_tokens"] = after.cache.evicted_tokens_total - before.cache.evicted_tokens_total
    return out


def step_rows(loop: EngineLoop) -> list[list[Any]]:
    """[raw prediction, calibrated prediction, measured s, items, [[n_input, n_cached], ...]] per step."""
    return [
        [s.predicted_raw, s.predicted, s.seconds, len(s.items), [list(i) for i in s.items]]
        for s in loop.step_log()
    ]


def isolated(engine: Engine, jct: JCTModel | CalibratedJCT, reqs: list[ScoreRequest]) -> dict[str, Any]:
    """Each request alone, in trace order, on a cache that starts cold: latency without queueing.
    It anchors every load multiple of a sweep, so it is timed again if the machine was shared."""

    def run() -> tuple[list[float], EngineLoop]:
        engine.flush_cache()
        lat = []
        with EngineLoop(engine, policy="fcfs", jct=jct) as loop:
            for r in reqs:
                t = time.perf_counter()
                loop.submit(r).result()
                lat.append(time.perf_counter() - t)
        return lat, loop

    (lat, loop), cpu = quietly(run, "timing the isolated latency")
    return {
        "latencies": lat,
        **latency_summary(lat),
        "other_cores": cpu.other_cores,
        "step_log": step_rows(loop),
    }


def add_sweep_args(ap: argparse.ArgumentParser, quiet_wait: float) -> None:
    """The flags of `sweep` (and of the benchmarks' prefix pool and arrivals)."""
    flags(ap, workloads="WL1,WL2", anchor=(["isolated", "saturated"], "what --mults multiply"))
    flags(ap, fairness_lambda=DEFAULT_FAIRNESS_LAMBDA, slo_x=(8.0, "P99 SLO = this x mean isolated latency"))
    flags(ap, slo_extra=("4,16", "further SLO multiples to report"))
    flags(ap, cache_profiles=(2.0, "prefix pool in WL1 profiles"))
    flags(ap, seed=("0", "arrivals and request order; several (0,1,2 or 0-2): a sweep each, pooled"))
    flags(ap, quiet_wait=(quiet_wait, "max seconds to wait for an idle CPU"))


def sweep(
    run: Callable[[str, list[float]], dict[str, Any]],
    configs: Sequence[str],
    reqs: list[ScoreRequest],
    unit: list[float],
    mults: Sequence[float],
    iso: dict[str, Any],
    args: argparse.Namespace,
    sat: dict[str, Any] | None = None,
    after_run: Callable[[list[dict[str, Any]]], None] | None = None,
) -> dict[str, Any]:
    """One workload: `run(config, arrivals)` for every config at `mults` x the anchor QPS (1 / the
    mean isolated latency of `iso`, or the all-at-t=0 rate of `sat` with `--anchor saturated`),
    interleaved, on the arrival pattern `unit`; then each config's sustained QPS at the P99 SLOs
    (`--slo-x` and `--slo-extra` x the isolated mean). `args`: the flags of `add_sweep_args`."""
    sat_qps = len(reqs) / sat["makespan_s"] if sat else None
    anchor = args.anchor if sat_qps else "isolated"
    base = sat_qps if sat_qps and anchor == "saturated" else 1.0 / iso["mean_s"]
    runs: list[dict[str, Any]] = []
    for m in mults:
        for c in configs:
            r = {**run(c, [u / (m * base) for u in unit]), "config": c, "mult": m, "qps": m * base}
            runs.append(r)
            print(
                f"  {m:5.2f}x {m * base:6.3f} qps {c:8s} mean {r['mean_s']:6.2f} s  P99 {r['p99_s']:6.2f} s  "
                f"hits {r['hit_rate']:4.0%}  steps {r['steps']:3d}  other cores {r['other_cores']:.2f}"
            )
            if after_run is not None:
                after_run(runs)
    slo_xs = [args.slo_x] + [float(x) for x in args.slo_extra.split(",") if x]
    return {
        "requests": len(reqs),
        "tokens": sum(len(r.input_ids) for r in reqs),
        "isolated": iso,
        "isolated_mean_s": iso["mean_s"],
        "slo_p99_s": args.slo_x * iso["mean_s"],
        **({"saturated": sat, "saturated_qps": sat_qps} if sat else {}),
        "anchor": anchor,
        "anchor_qps": base,
        "runs": runs,
        "at_slo": slo_table(runs, iso["mean_s"], slo_xs),
    }


def sustained_qps(points: list[tuple[float, float]], slo: float) -> tuple[float, str]:
    """Highest QPS with P99 <= slo from (qps, p99) points: interpolated (log-log) between the last
    passing and the first failing point. The mark is "" (interpolated), ">=" (every point passes:
    a lower bound) or "<" (even the lowest fails: an upper bound)."""
    pts = sorted(points)
    if pts[0][1] > slo:
        return pts[0][0], "<"
    for (q0, p0), (q1, p1) in zip(pts, pts[1:], strict=False):
        if p1 > slo:
            if p1 <= p0:
                return q0, ""
            return q0 * (q1 / q0) ** (math.log(slo / p0) / math.log(p1 / p0)), ""
    return pts[-1][0], ">="


def ratio_cell(a: tuple[float, str], b: tuple[float, str]) -> tuple[str, float | None]:
    """a / b of two sustained QPS values with their marks: the text and the value (None when both
    are bounds in the same direction: no ratio can be stated)."""
    (qa, ma), (qb, mb) = a, b
    if ma and ma == mb:
        return "n/a (both bounds)", None
    r = qa / qb
    if ma == "<" or mb == ">=":
        return f"<= {r:.2f}x", r
    return f"{'>= ' if ma == '>=' or mb == '<' else ''}{r:.2f}x", r


def slo_table(runs: list[dict[str, Any]], iso_mean: float, slo_xs: list[float]) -> dict[str, Any]:
    """Per P99 SLO (x the mean isolated latency): each config's sustained QPS and po / fcfs."""
    configs = list(dict.fromkeys(r["config"] for r in runs))
    out = {}
    for x in slo_xs:
        sus = {
            c: sustained_qps([(r["qps"], r["p99_s"]) for r in runs if r["config"] == c], x * iso_mean)
            for c in configs
        }
        out[f"{x:g}"] = {
            "slo_p99_s": x * iso_mean,
            "sustained_qps": {c: {"qps": v, "mark": mk} for c, (v, mk) in sus.items()},
            "po_vs_fcfs": ratio_cell(sus["po"], sus["fcfs"])[0] if {"po", "fcfs"} <= set(sus) else "n/a",
        }
    return out


def seeds(arg: str) -> list[int]:
    """`--seed`'s values: comma-separated seeds and inclusive ranges (`0`, `0,1,2`, `100-139`)."""
    out: list[int] = []
    for part in arg.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def pooled(sweeps: Sequence[Sequence[dict[str, Any]]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Several seeds' sweeps (each its runs) of one workload: per load multiple and config, mean and
    P99 over every seed's requests together, the pooled ratios to fcfs and each seed's P99 ratio.
    With few requests a seed's P99 is its slowest request or two: pooling makes a tail comparison
    mean something."""
    lat: dict[str, dict[str, list[list[float]]]] = defaultdict(lambda: defaultdict(list))
    for r in itertools.chain.from_iterable(sweeps):
        lat[f"{r['mult']:g}"][r["config"]].append(list(r["latencies"]))
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for mult, by_config in lat.items():
        base = by_config.get("fcfs")
        out[mult] = {}
        for config, per_seed in by_config.items():
            a = np.concatenate(per_seed)
            row: dict[str, Any] = {"seeds": len(per_seed), "requests": int(a.size), **latency_summary(a)}
            if base is not None and len(base) == len(per_seed):
                b = np.concatenate(base)
                row["mean_vs_fcfs"] = float(a.mean() / b.mean())
                row["p99_vs_fcfs"] = row["p99_s"] / latency_summary(b)["p99_s"]
                row["p99_vs_fcfs_per_seed"] = [p99(x) / p99(y) for x, y in zip(per_seed, base, strict=True)]
            out[mult][config] = row
    return out


def jct_quality(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Predicted vs measured step time over the step logs of `runs` (none was used to fit)."""
    rows = [s for r in runs for s in r["step_log"]]
    out: dict[str, float] = {"steps": len(rows)}
    for k, name in enumerate(("raw", "calibrated")):  # step_rows' first two columns
        q = prediction_quality([s[k] for s in rows], [s[2] for s in rows])
        out |= {f"r_{name}": q.pearson_r, f"median_rel_error_{name}": q.median_rel_error}
    return out
