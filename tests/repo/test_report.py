"""benchmarks/report.py on small fake results and on the committed ones: the tables, ratios and
plots the benchmarks write, and the harness's sustained-QPS analysis (no benchmark runs here)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import RESULTS, poisson_arrivals, ratio_cell, slo_table, sustained_qps
from benchmarks.report import (
    cluster_markdown,
    cluster_ratios,
    cluster_rows,
    cluster_sim_markdown,
    cluster_sim_rows,
    plot_cluster_sim,
    plot_sweeps,
    schedule_sim_markdown,
    serving_markdown,
    sweep_intro,
    sweep_rows,
)

MACHINE = {
    "cpu": "Fake CPU 9000",
    "cores": 2,
    "torch_threads": 2,
    "mem_total_gib": 8.0,
    "flags": {"avx2": True, "avx512f": False},
    "python": "3.11",
    "torch": "2.x",
    "transformers": "5.x",
}


def _run(config: str, qps: float, p99: float, steps: list[list[float]] | None = None) -> dict[str, Any]:
    return {
        "config": config,
        "policy": config,
        "mult": qps,
        "qps": qps,
        "mean_s": p99 / 2,
        "p99_s": p99,
        "hit_rate": 0.5,
        "other_cores": 0.9 if (config, qps) == ("fcfs", 8.0) else 0.0,
        "step_log": steps or [],
    }


def test_report_headline_qps_ratios_from_the_committed_sweep() -> None:
    """REPORT.md's headline (QPS at equal P99 SLO, po against each baseline) follows from the
    committed sweep's points: log-log interpolation where P99 crosses the SLO, bounds kept."""
    qps = json.loads((RESULTS / "report" / "qps.json").read_text())
    report = (RESULTS / "REPORT.md").read_text()
    names = {"fcfs": "ours fcfs + radix cache", "chunked": "ours chunked prefill + cache"}
    names["hf"] = "transformers (`--backend hf`)"
    for name, w in qps["workloads"].items():
        sus = {
            c: sustained_qps([(r["qps"], r["p99_s"]) for r in w["runs"] if r["config"] == c], w["slo_p99_s"])
            for c in ("po", *names)
        }
        for base, label in names.items():
            ratio = ratio_cell(sus["po"], sus[base])[0]
            assert f"| {name}: po vs {label} | QPS at equal P99 SLO | {ratio} |" in report
    # Its "All sweep points" table is the sweep's rows (a `*` marks a point run while other
    # processes were busy).
    for row in sweep_rows(qps["workloads"], extra=False):
        assert "| " + " | ".join(map(str, row)) + " |" in report


def test_ratio_cell_bounds() -> None:
    assert ratio_cell((4.0, ""), (2.0, "")) == ("2.00x", 2.0)
    assert ratio_cell((4.0, ">="), (2.0, ""))[0] == ">= 2.00x"  # po passed every point: lower bound
    assert ratio_cell((4.0, "<"), (2.0, ""))[0] == "<= 2.00x"
    assert ratio_cell((4.0, ">="), (2.0, ">="))[1] is None


def _sweep(p99: dict[str, list[float]]) -> dict[str, Any]:
    """A workload of harness.sweep's shape: configs x QPS 1, 2, 4, 8 with the given P99s."""
    runs = [
        {**_run(c, q, v), "p50_s": v / 3, "steps": 4, "mean_batch": 1.5}
        for c, vs in p99.items()
        for q, v in zip([1.0, 2.0, 4.0, 8.0], vs, strict=True)
    ]
    return {"requests": 6, "isolated_mean_s": 1.25, "slo_p99_s": 10.0, "anchor_qps": 2.0, "runs": runs}


def test_sustained_qps_interpolates_and_bounds() -> None:
    # P99 5 s at 4 QPS, 20 s at 8: the 10 s SLO is halfway in log -> 4 * sqrt(2).
    assert sustained_qps([(8.0, 20.0), (4.0, 5.0), (2.0, 2.0)], 10.0) == (pytest.approx(4 * 2**0.5), "")
    assert sustained_qps([(1.0, 1.0), (2.0, 2.0)], 10.0) == (2.0, ">=")  # every point passes
    assert sustained_qps([(1.0, 11.0), (2.0, 20.0)], 10.0) == (1.0, "<")  # none does


def test_slo_table_and_sim_markdown(tmp_path: Path) -> None:
    w = _sweep({"fcfs": [5, 20, 40, 80], "po": [1, 2, 5, 20]})
    # SLO 8 x 1.25 s = 10 s: po crosses between 4 and 8 QPS, fcfs between 1 and 2.
    at = slo_table(w["runs"], w["isolated_mean_s"], [8.0, 64.0])
    assert at["8"]["sustained_qps"]["po"]["qps"] == pytest.approx(4 * 2**0.5)
    assert at["8"]["po_vs_fcfs"] == "4.00x"
    assert at["64"]["po_vs_fcfs"] == "n/a (both bounds)"  # 80 s: both pass every point
    w["at_slo"] = at
    args = {"cache_profiles": 2.0, "fairness_lambda": 0.2}
    doc = {"args": args, "pool_tokens": 700, "jct_source": "a fake fit", "workloads": {"WL1": w}}
    md = schedule_sim_markdown(doc, ["fcfs", "po"])
    assert "| WL1 | po | 5.657 (2.83x) | >=8.000 (4.00x) |" in md
    assert "| WL1 | po / fcfs | 4.00x | n/a (both bounds) |" in md
    assert "| WL1 | 8 | 8.000 | fcfs* | 40.00 | 80.00 | 50% | 26.67 | 4 | 1.5 |" in md
    plot_sweeps(doc["workloads"], tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 1000


def test_sweep_intro_describes_the_traces_that_ran() -> None:
    a = {"mults": "0.5,2", "slo_x": 8.0, "anchor": "isolated", "cache_profiles": 2.0}
    a |= {"wl1_users": 4, "wl1_items": 6, "wl1_profile": 600, "wl1_item_tokens": 80}
    a |= {"wl2_requests": 8, "wl2_min": 1500, "wl2_max": 2500}
    both = sweep_intro({"args": {**a, "workloads": "WL1,WL2"}, "pool_tokens": 1540})
    assert "WL1: 4 users x 6 posts, profiles ~600 tokens" in both
    assert "WL2: 8 histories of 1500-2500 tokens" in both and "Prefix pool: 1540 tokens" in both
    wl1 = sweep_intro({"args": {**a, "workloads": "WL1"}, "pool_tokens": 1540})
    assert "WL1: 4 users" in wl1 and "WL2" not in wl1


def test_serving_markdown_ratios_to_hf() -> None:
    def row(config: str, qps: float, items_per_s: float, mean: float) -> dict[str, Any]:
        r = {"config": config, "qps": qps, "ok": 4, "calls": 4, "items_per_s": items_per_s, "mean_s": mean}
        return {**r, "p50_s": mean, "p99_s": 2 * mean, "server_cores": 1.0, "other_cores": 0.0}

    rows = [row("po", 1.0, 1.5, 2.0), row("hf", 1.0, 0.5, 8.0), row("po", 2.0, 2.0, 3.0)]
    doc = {
        "machine": {"cpu": "Fake CPU", "cores": 2},
        "args": {"workload": "wl1", "api": "score"},
        "workload": {"calls": 4},
        "results": rows,
    }
    md = serving_markdown(doc)
    assert "# bench_serving: wl1 over /v1/score" in md
    assert "| po | 1 | 4/4 | 1.50 | 2.00 | 2.00 | 4.00 | - | 3.00x | 4.00x | 1.0 | 0.0 |" in md
    assert "| po | 2 | 4/4 | 2.00 | 3.00 | 3.00 | 6.00 | - | n/a | n/a | 1.0 | 0.0 |" in md  # no hf at 2


def test_poisson_arrivals_scale_with_rate() -> None:
    unit = poisson_arrivals(200, random.Random(0))
    fast = poisson_arrivals(200, random.Random(0), rate=4.0)
    assert unit[0] == 0.0 and all(b > a for a, b in zip(unit, unit[1:], strict=False))
    assert fast[-1] == pytest.approx(unit[-1] / 4, rel=0.01)  # same draws, a quarter of the gaps
    assert 150 < unit[-1] < 250  # mean gap 1 s


# ---- scaling out: bench_cluster, measured and --simulate ---------------------------------------------


def _cluster_run(
    policy: str, items_per_s: float, hit: float, p50: float, users: dict[str, int]
) -> dict[str, Any]:
    """One bench_cluster run: 20 posts in 10 calls over two workers of 1,000 prompt tokens each."""
    workers = [
        {"prompt_tokens": 1000, "cached_tokens": 1000 * hit, "share": hit, "calls": 5, "items": n, "users": 2}
        for n in (8, 12)
    ]
    return {
        "shape": "generate",
        "rate": 4.0,
        "policy": policy,
        "calls": 10,
        "ok": 10,
        "errors": {},
        "first_error": "",
        "items": 20,
        "seconds": 10.0,
        "cluster_cores": 1.0 if policy == "cache_aware" else 1.5,  # CPU per post: 500 / 750 ms
        "items_per_s": items_per_s,
        "mean_s": p50,
        "p50_s": p50,
        "p99_s": 4 * p50,
        "other_cores": 0.9 if policy == "round_robin" else 0.0,
        "workers": workers,
        "prompt_tokens": 2000,
        "cached_tokens": 2000 * hit,
        "hit_rate": hit,
        "workers_per_user": users,
    }


def _cluster_doc() -> dict[str, Any]:
    args = {"workers": 2, "worker_args": "--max-input-len 2048", "seed": 0, "items_per_s": [4.0, 12.0, 30.0]}
    args.update(generate_as="ids", docs_per_call=2)
    return {
        "machine": MACHINE,
        "args": args,
        "threads_per_worker": 1,
        "worker_settings": {"dtype": "torch.bfloat16"},
        "workload": {"users": 4, "posts": 5, "mean_profile_tokens": 600.0, "mean_post_tokens": 80.0},
        "runs": [
            _cluster_run("cache_aware", 6.0, 0.8, 0.5, {"0": 1, "1": 1, "2": 1, "3": 1}),
            _cluster_run("round_robin", 4.0, 0.5, 2.0, {"0": 2, "1": 2, "2": 1, "3": 2}),
        ],
    }


def _sim_row(router: str, n: int, qps: float, hit: float, busy: float) -> dict[str, Any]:
    return {
        "router": router,
        "workers": n,
        "sustained_qps": qps,
        "hit_rate": hit,
        "imbalance": 1.0 + 0.01 * n,
        "p99_s": 9.0,
        "mean_s": 2.0,
        "mean_batch": 1.0,
        "span_over_bound": 10.0 if n == 8 else 50.0,  # the 8-worker run is one burst
        "busy_share": [busy] * n,
    }


def _sim_doc() -> dict[str, Any]:
    # Scaling efficiency: cache_aware 1.0, 1.2, 1.5, 1.5; round_robin 1.0, 0.9, 0.8, 0.7.
    ca = [(1, 1.0, 0.1), (2, 2.4, 0.4), (4, 6.0, 0.8), (8, 12.0, 0.81)]
    rr = [(1, 1.0, 0.1), (2, 1.8, 0.1), (4, 3.2, 0.1), (8, 5.6, 0.1)]
    rows = [_sim_row("cache_aware", n, q, h, 0.5) for n, q, h in ca]
    rows += [_sim_row("round_robin", n, q, h, 0.5 + n / 20) for n, q, h in rr]
    args = {"users": 40, "posts": 10, "scale": 8.0, "seed": 0, "fairness_lambda": 0.2, "pool_gib": 1.0}
    args.update(slo_x=8.0, warmup=0.0)
    return {
        "args": args,
        "jct_source": "a fake fit",
        "kv_bytes_per_token": 100,
        "dtype": "torch.bfloat16",
        "pool_tokens": 10000,
        "mean_profile_tokens": 1000.0,
        "requests": 400,
        "isolated_mean_s": 1.0,
        "slo_p99_s": 8.0,
        "router_settings": {
            "cache_threshold": 0.3,
            "balance_abs_threshold": 64,
            "balance_rel_threshold": 1.5,
        },
        "rows": rows,
    }


def test_cluster_affinity_table_and_ratios() -> None:
    doc = _cluster_doc()
    assert cluster_ratios(doc) == {
        "generate @ 4 posts/s": {
            "items_per_s": 1.5,
            "hit_rate": 1.6,
            "p50_s": 4.0,
            "p99_s": 4.0,
            "computed_tokens": 2.5,  # 1,000 of 2,000 prompt tokens computed against 400
            "cpu_per_item": 1.5,
        }
    }
    md = cluster_markdown(doc)
    assert "load rule at 64 (the router's default) outstanding requests" in md  # no router flag given
    doc["runs"][0]["router_cmd"] = ["-m", "sglang_router.launch_router", "--balance-abs-threshold", "8"]
    md = cluster_markdown(doc)
    assert "load rule at 8 outstanding requests" in md
    assert (
        "| generate | 4 | cache_aware | 10/10 | 6.00 | 0.50 | 2.00 | 500 | 80% | 80% / 80% | 8 / 12 | 1.00 / 1 | 100% |"
        in md
    )
    # round robin: 3 of 4 users on both workers; the run had other load beside it (`*`).
    assert (
        "| generate | 4 | round_robin* | 10/10 | 4.00 | 2.00 | 8.00 | 750 | 50% | 50% / 50% | 8 / 12 | 1.75 / 2 | 25% |"
        in md
    )
    assert (
        "cache_aware / round_robin items/s **1.50x**, hit rate **1.60x**; round_robin / cache_aware: tokens computed "
        "2.50x, CPU per item 1.50x, P50 latency 4.00x, P99 4.00x" in md
    )
    assert "2 PrefillOnly workers x 1 threads" in md and "4 users x 5 posts, profiles ~600 tokens" in md
    assert "Poisson arrivals at 4, 12 and 30 posts/s" in md
    # The committed run: its ratios and its markdown follow from its rows.
    committed = json.loads((RESULTS / "cluster.json").read_text())
    assert cluster_ratios(committed) == committed["ratios"]
    assert cluster_markdown(committed) == (RESULTS / "cluster.md").read_text()
    # Without its round-robin run a point has no ratio, and a run no call reached shows no affinity.
    doc["runs"] = [{**doc["runs"][0], "workers_per_user": {}}]
    assert cluster_ratios(doc) == {}
    assert cluster_rows(doc)[0][-2:] == ["-", "-"]


def test_cluster_sim_table_efficiency_and_bursts(tmp_path: Path) -> None:
    doc = _sim_doc()
    rows = cluster_sim_rows(doc)
    assert rows[2] == [
        "cache_aware",
        "4",
        "6.000",
        "1.500",
        "1.50",
        "1.88x",
        "80.0%",
        "1.040",
        "9.0",
        "2.00",
        "1.00",
        "50",
    ]
    assert rows[3][-1] == "10 †"  # a burst, not a sustained rate
    assert rows[7][:6] == ["round_robin", "8", "5.600", "0.700", "0.70", "1.00x"]
    md = cluster_sim_markdown(doc)
    assert "| round_robin | 1 | 1.000 | 1.000 | 1.00 | 1.00x | 10.0% |" in md
    assert "P99 bound 8.00 s = 8 x the isolated mean latency 1.000 s" in md
    plot_cluster_sim(doc, tmp_path / "cluster_sim.png")
    assert (tmp_path / "cluster_sim.png").stat().st_size > 1000


def test_cluster_tap_keys_tell_users_apart() -> None:
    from benchmarks.bench_cluster import KEY_TOKENS, call_items, call_key

    ids = list(range(100))
    assert call_key({"input_ids": ids}) == tuple(range(KEY_TOKENS))
    assert call_key({"input_ids": [ids, [7]]}) == call_key({"input_ids": ids})  # a batch: its first prompt
    assert call_key({"query": "User 3 profile", "documents": ["a", "b"]}) == "User 3 profile"
    assert call_key({"text": "User 3 profile. " * 20}) != call_key({"text": "User 4 profile. " * 20})
    assert call_key({"sampling_params": {}}) is None  # not a scoring call: not counted
    assert call_items({"query": "q", "documents": ["a", "b", "c"]}) == 3
    assert call_items({"input_ids": ids}) == 1
    assert call_items({"input_ids": [ids, ids]}) == 2
    assert call_items({"text": ["a", "b"]}) == 2 and call_items({"text": "a"}) == 1
