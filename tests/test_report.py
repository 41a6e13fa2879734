"""benchmarks/report.py on small fake results: the tables, QPS-at-SLO ratios, MIL ratios and plots
it writes, and the harness's sustained-QPS analysis (no benchmark runs here)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from benchmarks.harness import poisson_arrivals, slo_table, sustained_qps
from benchmarks.report import (
    build_report,
    plot_sweeps,
    ratio_cell,
    schedule_sim_markdown,
    serving_markdown,
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


def _write(folder: Path, name: str, doc: dict[str, Any]) -> None:
    (folder / f"{name}.json").write_text(json.dumps(doc))


@pytest.fixture()
def fake_results(tmp_path: Path) -> Path:
    folder = tmp_path / "report"
    folder.mkdir()
    _write(folder, "meta", {"machine": MACHINE, "dtype": "torch.float32", "total_s": 600, "quick": True})
    # SLO 10 s. P99 crosses it (log-log interpolation, halfway in log between two points):
    # po between 4 (5 s) and 8 (20 s) -> 4*sqrt(2) = 5.657; chunked between 2 and 4 -> 2.828;
    # fcfs between 1 and 2 -> 1.414; hf never passes -> an upper bound at 1.
    p99 = {
        "po": [1, 2, 5, 20],
        "chunked": [1, 5, 20, 40],
        "fcfs": [5, 20, 40, 80],
        "hf": [20, 40, 80, 160],
    }
    steps = [[0.11 * k, 0.12 * k, 0.1 * k, 1] for k in range(1, 8)]  # predicted = 1.1 x measured
    runs = [
        _run(c, q, v, steps if c == "po" else None)
        for c, vs in p99.items()
        for q, v in zip([1.0, 2.0, 4.0, 8.0], vs, strict=True)
    ]
    args = {
        "mults": "0.25,0.5,1,2",
        "anchor": "isolated",
        "slo_x": 4,
        "wl1_users": 2,
        "wl1_items": 3,
        "wl1_profile": 300,
        "wl1_item_tokens": 40,
        "wl2_requests": 2,
        "wl2_min": 300,
        "wl2_max": 500,
        "cache_profiles": 2.0,
    }
    wl1 = {"requests": 6, "tokens": 2000, "slo_p99_s": 10.0, "saturated_qps": 4.0, "runs": runs}
    wl1.update(anchor="isolated", anchor_qps=2.0)
    _write(
        folder,
        "qps",
        {
            "args": args,
            "pool_tokens": 700,
            "jct_fit": {"pearson_r": 0.99},
            "workloads": {"WL1": wl1},
            "notes": ["WL1 was re-run"],
        },
    )
    mib = 1 << 20
    _write(
        folder,
        "mil",
        {
            "budget_mib": 256,
            "model_context": 8192,
            "args": {"lengths": "1024,2048"},
            "configs": {"hf-default": "HF default", "hybrid": "ours hybrid", "chunked": "ours chunked"},
            "mil": {
                "hf-default": {"c0_mib": 1, "kib_per_token": 200, "mil": 1000, "kind": "measured"},
                "hybrid": {"c0_mib": 5, "kib_per_token": 20, "mil": 12000, "kind": "extrapolated"},
                "chunked": {"c0_mib": 5, "kib_per_token": 80, "mil": 3000, "kind": "extrapolated"},
            },
            "rows": [
                {"config": "hybrid", "n": 1024, "status": "ok", "peak_bytes": 10 * mib, "tok_per_s": 420.0},
                {"config": "nochunk", "n": 1024, "status": "ok", "peak_bytes": 40 * mib, "tok_per_s": 400.0},
            ],
        },
    )
    sat = {
        "items_per_s": 2.0,
        "hit_rate": 0.8,
        "inserted_tokens": 600,
        "evicted_tokens": 0,
        "other_cores": 0.0,
    }
    sat_off = {**sat, "items_per_s": 1.0, "hit_rate": 0.4, "inserted_tokens": 900, "evicted_tokens": 500}
    poisson = {"mean_s": 1.0, "p99_s": 3.0, "hit_rate": 0.8, "other_cores": 0.0}
    lam = [
        {"policy": "fcfs", "lam": 0.0, "mean_s": 2.0, "p99_s": 4.0, "other_cores": 0.0},
        {"policy": "po", "lam": 0.5, "mean_s": 1.0, "p99_s": 3.0, "other_cores": 0.0},
    ]
    _write(
        folder,
        "ablation",
        {
            "requests": 6,
            "pool_tokens": 700,
            "qps": 2.0,
            "args": {"mult": 1.0},
            "suffix": {
                "on": {"saturated": sat, "poisson": poisson},
                "off": {"saturated": sat_off, "poisson": poisson},
            },
            "lambda": lam,
        },
    )
    _write(
        folder, "llamacpp", {"status": "not run: llama-cpp-python not installed", "install": "pip wheel ..."}
    )
    return folder


def test_report_tables_and_ratios(fake_results: Path) -> None:
    out = fake_results.parent / "REPORT.md"
    summary = build_report(fake_results, out)
    text = out.read_text()
    assert "Fake CPU 9000" in text and "avx2" in text and "torch.float32" in text
    # QPS at the SLO and po's ratio to each baseline.
    assert "0.25,0.5,1,2 x the isolated throughput" in text  # what the sweep's multiples refer to
    assert "Note: WL1 was re-run" in text
    assert "| WL1 | ours po | 5.657 | - |" in text
    assert "| WL1 | ours fcfs + radix cache | 1.414 | 4.00x |" in text
    assert "| WL1 | ours chunked prefill + cache | 2.828 | 2.00x |" in text
    assert "| WL1 | transformers (`--backend hf`) | <1.000 | >= 5.66x |" in text  # hf never met the SLO
    assert "| WL1 | 8 | 8.000 | fcfs* | 40.00 | 80.00 | 50% |" in text  # the contended point is flagged
    assert "| WL1 | 4 | 4.000 | fcfs | 20.00 | 40.00 | 50% |" in text
    # MIL against the transformers default, and hybrid on/off.
    assert "| ours hybrid | 20.0 | 5 | 12000 (beyond the model's context) | extrapolated | 12.0x |" in text
    assert "| 1024 | 10 | 40 | 4.0x | 1.05x | - | - |" in text
    # Ablations and the JCT fit.
    assert "Throughput with / without suffix discarding: **2.00x**" in text
    assert "| po | 0.5 | 1.00 | 3.00 |" in text
    assert "**1.000** (fitted model)" in text
    assert "not run: llama-cpp-python not installed" in text
    for png in ("qps_wl1.png", "lambda.png", "jct.png"):
        assert (fake_results / png).stat().st_size > 1000
        assert f"(report/{png})" in text  # linked relative to REPORT.md
    assert "WL1: po vs ours fcfs + radix cache: 4.00x" in summary
    assert any("WL1 po >= 4x fcfs at equal P99: 4.00x (met)" in s for s in summary)
    assert any("WL1 po >= 20x hf at equal P99: >= 5.66x (not met)" in s for s in summary)
    assert any("MIL hybrid >= 10x HF default: 12.0x (met)" in s for s in summary)


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
