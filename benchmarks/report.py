"""The benchmarks' rendering: each bench's results/*.md (markdown tables, prose from
report_template.md) and PNG plots, written beside its JSON at run time. REPORT.md is curated by
hand from those files."""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from matplotlib import ticker
from matplotlib.figure import Figure  # not pyplot: no display, no global state to close

CONTENDED_CORES = 0.5  # other processes busier than this during a run: its numbers are upper bounds
QPS_ORDER = ("hf", "fcfs", "chunked", "srjf", "lpm", "po")
QPS_NAMES = {
    "hf": "transformers (`--backend hf`)",
    "fcfs": "ours fcfs + radix cache",
    "chunked": "ours chunked prefill + cache",
    "po": "ours po",
}
SWEEP_HEADER = "workload | x anchor | QPS | config | mean s | P99 s | hits | P50 s | steps | items/step"
# The router policy that keeps a user on one worker, and its baseline.
AFFINITY, SPREAD = "cache_aware", "round_robin"
MIN_SPAN = 20.0  # a trace shorter than this many P99 bounds is one burst, not a sustained rate
TEMPLATE = Path(__file__).with_name("report_template.md")
Doc = dict[str, Any]


@functools.cache
def _templates() -> dict[str, str]:
    blocks = re.split(r"^<!-- (\w+) -->\n", TEMPLATE.read_text(), flags=re.M)
    return {name: " ".join(body.split()) for name, body in zip(blocks[1::2], blocks[2::2], strict=True)}


def prose(name: str, **fields: Any) -> str:
    """A paragraph of report_template.md with its `{fields}` filled."""
    return _templates()[name].format(**fields)


def markdown_table(header: str | Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """The one table renderer. header: the cells, or one string of them separated by "|"."""
    header = [c.strip() for c in header.split("|")] if isinstance(header, str) else header
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def cells(r: Doc, spec: str) -> list[str]:
    """A result row's table cells: r[key] formatted for each space-separated `key[:format][*]` of
    `spec` (`*`: a `*` appended when other processes were busy during the run)."""
    out = []
    for token in spec.split():
        key, _, fmt = token.rstrip("*").partition(":")
        busy = token.endswith("*") and (r.get("other_cores") or 0) > CONTENDED_CORES  # NaN: not busy
        out.append(format(r[key], fmt) + ("*" if busy else ""))
    return out


def doc_md(title: str, *parts: str) -> str:
    """A results/*.md file: a title, then paragraphs (tables, figures), a blank line after each."""
    return "\n".join([f"# {title}", ""] + [line for p in parts for line in (p, "")])


def _bullets(lines: Sequence[str]) -> str:
    return "\n".join(f"- {line}" for line in lines)


def _and(words: Sequence[str]) -> str:
    """ "a", "a and b", "a, b and c"."""
    return " and ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else list(words))


def _order(r: Doc) -> tuple[float, int]:
    return r["qps"], QPS_ORDER.index(r["config"]) if r["config"] in QPS_ORDER else len(QPS_ORDER)


# ---- bench_schedule and bench_serving ---------------------------------------------------------------


def sweep_rows(workloads: Doc, extra: bool = True) -> list[list[Any]]:
    """Every point of harness.sweep results (`*` = contended); `extra`: P50, steps, items/step too."""
    spec = "mult:g qps:.3f config* mean_s:.2f p99_s:.2f hit_rate:.0%"
    if extra:
        spec += " p50_s:.2f steps mean_batch:.1f"
    return [[name, *cells(r, spec)] for name, w in workloads.items() for r in sorted(w["runs"], key=_order)]


def sweep_intro(doc: Doc) -> str:
    """What a bench_schedule sweep ran: arrivals, the SLO, the traces it ran, the prefix pool."""
    a = doc["args"]
    traces = " ".join(prose(f"trace_{w}", a=a) for w in a.get("workloads", "WL1,WL2").split(","))
    anchor, pool = a.get("anchor", "saturated"), doc.get("pool_tokens", "?")
    return prose("sweep_intro", a=a, anchor=anchor, pool=pool, traces=traces)


def slo_md(doc: Doc, policies: list[str]) -> str:
    """The sustained-QPS table: per workload and policy, the QPS at each P99 SLO, and po / fcfs."""
    first = next(iter(doc["workloads"].values()))
    header = ["workload", "policy"] + [f"QPS at P99 <= {x}x isolated" for x in first["at_slo"]]

    def cell(sl: Doc, p: str, anchor: float) -> str:
        if p == "po / fcfs":
            return sl["po_vs_fcfs"]
        q = sl["sustained_qps"][p]
        return f"{q['mark']}{q['qps']:.3f} ({q['qps'] / anchor:.2f}x)"

    rows = [
        [name, p, *(cell(sl, p, w["anchor_qps"]) for sl in w["at_slo"].values())]
        for name, w in doc["workloads"].items()
        for p in [*policies, "po / fcfs"]
    ]
    return markdown_table(header, rows)


def pooled_md(doc: Doc) -> list[str]:
    """The seeds pooled (`harness.pooled`), when a sweep ran several: a table per trace."""
    header = "x anchor | config | seeds | requests | mean s | P99 s | mean / fcfs | P99 / fcfs | P99 / fcfs per seed"
    tables = []
    for trace, by_mult in doc.get("pooled", {}).items():
        rows = [
            [f"{m}x", c, r["seeds"], r["requests"], f"{r['mean_s']:.2f}", f"{r['p99_s']:.2f}"]
            + [f"{r[k]:.2f}x" if k in r else "" for k in ("mean_vs_fcfs", "p99_vs_fcfs")]
            + [", ".join(f"{x:.2f}" for x in r.get("p99_vs_fcfs_per_seed", []))]
            for m, by_config in by_mult.items()
            for c, r in by_config.items()
        ]
        tables.append(f"{trace}, every seed's requests pooled:\n\n" + markdown_table(header, rows))
    return tables


def schedule_markdown(doc: Doc, policies: list[str]) -> str:
    """results/schedule.md from bench_schedule's measured run."""
    nan = {"pearson_r": math.nan, "median_abs_error_s": math.nan, "median_rel_error": math.nan}
    f, o, a, m = nan | doc["jct_fit"], doc["jct_online"], doc["args"], doc["machine"]
    notes = [prose("jct_fit", f=f, ms=1e3 * f["median_abs_error_s"]), prose("jct_online", o=o)]
    notes += [prose("schedule_workload", trace=trace, w=w) for trace, w in doc["workloads"].items()]
    intro = prose("schedule", m=m, a=a, sweep=sweep_intro(doc))
    sweep = markdown_table(SWEEP_HEADER, sweep_rows(doc["workloads"]))
    title = "bench_schedule: scheduling policies under Poisson load (embedded SmolLM2-135M, CPU)"
    return doc_md(title, intro, sweep, slo_md(doc, policies), _bullets(notes), *pooled_md(doc))


def schedule_sim_markdown(doc: Doc, policies: list[str]) -> str:
    """results/schedule_sim.md from bench_schedule --simulate."""
    intro = prose("schedule_sim", a=doc["args"], pool=doc["pool_tokens"], jct=doc["jct_source"])
    title = "bench_schedule --simulate: the same policies on the simulator (no machine noise)"
    sweep = markdown_table(SWEEP_HEADER, sweep_rows(doc["workloads"]))
    return doc_md(title, intro, slo_md(doc, policies), sweep, *pooled_md(doc))


def serving_rows(rows: list[Doc]) -> tuple[str, str, list[list[str]]]:
    """Per config and offered rate, with ratios to the baseline (`hf` when it ran, else the first
    config) at the same rate: (the baseline, the header, the rows)."""
    configs = [r["config"] for r in rows]
    base = "hf" if "hf" in configs else configs[0]
    by = {(r["config"], r["qps"]): r for r in rows}
    table = []
    for r in rows:
        b = by.get((base, r["qps"]))
        row = [*cells(r, "config qps:g"), f"{r['ok']}/{r['calls']}"]
        row += cells(r, "items_per_s:.2f mean_s:.2f p50_s:.2f p99_s:.2f")
        row.append(f"{r['cache_hit_rate']:.0%}" if "cache_hit_rate" in r else "-")
        row.append(f"{r['items_per_s'] / b['items_per_s']:.2f}x" if b and b["items_per_s"] else "n/a")
        row.append(f"{b['mean_s'] / r['mean_s']:.2f}x" if b and r["mean_s"] else "n/a")
        row.append("-" if r.get("server_cores") is None else f"{r['server_cores']:.1f}")
        table.append([*row, f"{r['other_cores']:.1f}"])
    header = f"config | qps | ok | items/s | mean s | p50 s | p99 s | cache hits | items/s vs {base} | "
    return base, header + f"mean lat. {base}/this | server cores | other cores", table


def serving_markdown(doc: Doc) -> str:
    """results/serving.md from bench_serving."""
    args, m = doc["args"], doc["machine"]
    base, head, table = serving_rows(doc["results"])
    api = "generate" if args["api"] == "generate" else f"v1/{args['api']}"
    workload = json.dumps(doc["workload"])
    intro = prose("serving", cpu=m.get("cpu"), cores=m.get("cores"), workload=workload, base=base)
    return doc_md(f"bench_serving: {args['workload']} over /{api}", intro, markdown_table(head, table))


# ---- bench_cluster (measured) -------------------------------------------------------------------------


def _point(run: Doc) -> str:
    """A run's traffic shape and offered load, e.g. "generate @ 4 posts/s"."""
    return f"{run['shape']} @ {run['rate']:g} posts/s"


def _ratio(x: float, y: float) -> float:
    return x / y if y else math.nan


def _cpu_per_item(run: Doc) -> float:
    """CPU seconds the workers and the router spent per completed item: at a load both routers
    keep up with, items/s are equal and this is where the recomputed profiles show."""
    return run["cluster_cores"] * run["seconds"] / run["items"] if run["items"] else math.nan


def cluster_ratios(doc: Doc) -> dict[str, dict[str, float]]:
    """Per traffic shape and offered load, cache_aware against round_robin in the same run: items/s
    and hit rate as cache_aware / round_robin; latency, prompt tokens computed (not read from a
    cache) and CPU per item as round_robin / cache_aware (how many times lower)."""
    runs = [
        {**r, "computed_tokens": r["prompt_tokens"] - r["cached_tokens"], "cpu_per_item": _cpu_per_item(r)}
        for r in doc["runs"]
    ]
    by = {(_point(r), r["policy"]): r for r in runs}
    out = {}
    for point in dict.fromkeys(_point(r) for r in runs):
        a, b = by.get((point, AFFINITY)), by.get((point, SPREAD))
        if a is not None and b is not None:
            higher = {k: _ratio(a[k], b[k]) for k in ("items_per_s", "hit_rate")}
            lower = {k: _ratio(b[k], a[k]) for k in ("p50_s", "p99_s", "computed_tokens", "cpu_per_item")}
            out[point] = higher | lower
    return out


def cluster_rows(doc: Doc) -> list[list[str]]:
    """Per (shape, router) run of bench_cluster: throughput, latency, hit rate overall and per
    worker, the load split and the affinity (`*` = contended run)."""
    rows = []
    for r in doc["runs"]:
        row = [*cells(r, "shape rate:g policy*"), f"{r['ok']}/{r['calls']}"]
        row += cells(r, "items_per_s:.2f p50_s:.2f p99_s:.2f")
        row += [f"{1e3 * _cpu_per_item(r):.0f}", f"{r['hit_rate']:.0%}"]
        row.append(" / ".join(f"{w['share']:.0%}" for w in r["workers"]))
        row.append(" / ".join(str(w["items"]) for w in r["workers"]))
        n = list(r["workers_per_user"].values())  # distinct workers each user reached
        if n:
            row += [f"{sum(n) / len(n):.2f} / {max(n)}", f"{sum(k == 1 for k in n) / len(n):.0%}"]
        rows.append(row if n else [*row, "-", "-"])  # no call reached a worker
    return rows


def cluster_markdown(doc: Doc) -> str:
    """results/cluster.md from bench_cluster: the runs, and the same-run ratios per point."""
    a, w, m = doc["args"], doc["workload"], doc["machine"]
    # cache_aware's load rule as the runs' router command set it (the router's default when not given)
    cmd: list[str] = next((r["router_cmd"] for r in doc["runs"] if "router_cmd" in r), [])
    flag = "--balance-abs-threshold"
    balance = cmd[cmd.index(flag) + 1] if flag in cmd[:-1] else "64 (the router's default)"
    intro = prose(
        "cluster", a=a, w=w, m=m, threads=doc["threads_per_worker"], balance=balance, contended=CONTENDED_CORES,
        dtype=doc.get("worker_settings", {}).get("dtype", "?"), rates=_and([f"{x:g}" for x in a["items_per_s"]]),
        prompt="input_ids" if a["generate_as"] == "ids" else "text",
    )  # fmt: skip
    ratios = [
        prose("cluster_ratios", point=point, x=x, affinity=AFFINITY, spread=SPREAD)
        for point, x in cluster_ratios(doc).items()
    ]
    header = (
        "shape | posts/s offered | router | calls ok | items/s | P50 s | P99 s | CPU ms / item | hit rate | "
        "cached share per worker | items per worker | workers per user (mean / max) | users on one worker"
    )
    title = "bench_cluster: prefix affinity through the SGLang router (measured)"
    return doc_md(title, intro, markdown_table(header, cluster_rows(doc)), _bullets(ratios))


# ---- bench_cluster --simulate ----------------------------------------------------------------------


def cluster_sim_rows(doc: Doc) -> list[list[str]]:
    """Per (router, N): sustained QPS, per worker, scaling efficiency (QPS / (N x the same router's
    1-worker QPS)), ratio to round robin at the same N, hit rate, imbalance, P99 and mean at that rate."""
    by = {(r["router"], r["workers"]): r for r in doc["rows"]}
    out = []
    for r in doc["rows"]:
        one, rr, q = by.get((r["router"], 1)), by.get((SPREAD, r["workers"])), r["sustained_qps"]
        row = [r["router"], str(r["workers"]), f"{q:.3f}", f"{q / r['workers']:.3f}"]
        row.append(f"{q / (r['workers'] * one['sustained_qps']):.2f}" if one else "-")
        row.append(f"{q / rr['sustained_qps']:.2f}x" if rr else "-")
        row += cells(r, "hit_rate:.1% imbalance:.3f p99_s:.1f mean_s:.2f mean_batch:.2f")
        out.append(row + [f"{r['span_over_bound']:.0f}" + ("" if r["span_over_bound"] >= MIN_SPAN else " †")])
    return out


def cluster_sim_markdown(doc: Doc) -> str:
    """results/cluster_sim.md from bench_cluster --simulate: what ran, and per (router, N) the table."""
    a, d, profile, pool = doc["args"], doc["router_settings"], doc["mean_profile_tokens"], doc["pool_tokens"]
    warmup = prose("warmup_dropped", a=a) if a.get("warmup") else prose("warmup_kept")
    intro = prose(
        "cluster_sim", a=a, d=d, requests=doc["requests"], profile=profile, pool=pool, profiles=pool / profile,
        kv=doc["kv_bytes_per_token"], dtype=doc["dtype"], jct=doc["jct_source"], slo=doc["slo_p99_s"],
        iso=doc["isolated_mean_s"], min_span=MIN_SPAN, warmup=warmup,
    )  # fmt: skip
    header = (
        "router | workers | QPS at P99 bound | per worker | efficiency | vs round robin | hit rate | "
        "imbalance (max/mean items) | P99 s | mean s | items/step | trace / bound"
    )
    table = markdown_table(header, cluster_sim_rows(doc))
    return doc_md("bench_cluster --simulate: N workers behind the router, simulated", intro, table)


# ---- plots ----------------------------------------------------------------------------------------


def _lines(
    ax: Any, rows: list[Doc], group: str, x: str, y: str, name: Callable[[str], str] = str, **style: Any
) -> None:
    """One line per value of `group` (first seen first), its points (x, y) sorted by x."""
    for g in dict.fromkeys(r[group] for r in rows):
        pts = sorted((r[x], r[y]) for r in rows if r[group] == g)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name(g), **style)


def _axes(ax: Any, xlabel: str, ylabel: str, title: str, base: int = 10, logy: bool = True) -> None:
    """Labels, grid, legend, and log axes with plain numbers (1, 2, 5, 10 ... not 2^0 or 3x10^-1)."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title, yscale="log" if logy else "linear")
    ax.set_xscale("log", base=base)
    for axis in [ax.xaxis, ax.yaxis] if logy else [ax.xaxis]:
        if base == 10:
            axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.set_minor_formatter(ticker.NullFormatter())
        axis.set_major_formatter(ticker.FormatStrFormatter("%g"))
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def plot_sweeps(workloads: Doc, path: Path, names: dict[str, str] | None = None) -> None:
    """Mean and P99 latency against offered QPS (log-log), one row per workload, one line per
    config; the P99 SLO as a dashed line where the workload has one."""
    fig = Figure(figsize=(11, 4 * len(workloads)), layout="tight")
    axes = fig.subplots(len(workloads), 2, squeeze=False)
    for row, (name, w) in zip(axes, workloads.items(), strict=True):
        anchor = f" (anchor {w['anchor_qps']:.2f} req/s)" if "anchor_qps" in w else ""
        for ax, key in zip(row, ("mean_s", "p99_s"), strict=True):
            label = "mean latency (s)" if key == "mean_s" else "P99 latency (s)"
            _lines(ax, sorted(w["runs"], key=_order), "config", "qps", key, lambda c: (names or {}).get(c, c))
            if key == "p99_s" and "slo_p99_s" in w:
                ax.axhline(w["slo_p99_s"], color="grey", linestyle="--", label="P99 SLO")
            _axes(ax, "offered QPS (Poisson)", label, f"{name}: {label}{anchor}")
    fig.savefig(path, dpi=100)


def plot_cluster_sim(doc: Doc, path: Path) -> None:
    """Sustained QPS vs workers (log-log, with linear scaling from one worker), and hit rate and
    imbalance vs workers, one line per router (the same colour in both plots)."""
    rows = [{**r, "imbalance_1": r["imbalance"] - 1} for r in doc["rows"]]
    fig = Figure(figsize=(11, 4.2), layout="tight")
    ax, ax2 = fig.subplots(1, 2)
    _lines(ax, rows, "router", "workers", "sustained_qps")
    one, ns = min(rows, key=lambda r: r["workers"]), sorted({r["workers"] for r in rows})
    if one["workers"] == 1:  # one worker is the same run for every router
        ax.plot(
            ns, [one["sustained_qps"] * n for n in ns], ls=":", color="grey", label="linear: N x 1 worker"
        )
    _lines(ax2, rows, "router", "workers", "hit_rate", lambda g: f"{g} hit rate")
    ax2.set_prop_cycle(None)  # each router's colour again
    _lines(ax2, rows, "router", "workers", "imbalance_1", lambda g: f"{g} imbalance - 1", ls="--")
    slo = f"QPS at P99 <= {doc['slo_p99_s']:.1f} s"
    _axes(ax, "workers", slo, "sustained QPS vs workers (simulated)", base=2)
    _axes(ax2, "workers", "fraction", "hit rate; imbalance (max/mean items) - 1", base=2, logy=False)
    fig.savefig(path, dpi=100)
