"""benchmarks/report.py on small fake results: the tables, QPS-at-SLO ratios, MIL ratios and plots
it writes (no benchmark runs here)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from report import build_report, ratio_cell  # noqa: E402

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
