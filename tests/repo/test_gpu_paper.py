"""A CPU rehearsal of benchmarks/gpu_paper.py (the paper's experiments on one GPU): a 2-layer cut of
the Llama-3.1-8B shape and tiny workloads, end to end, so the script cannot rot before a GPU runs it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import gpu_paper


def test_bisection_finds_the_largest_fitting_length() -> None:
    r = gpu_paper.bisect_max(lambda n: n <= 5000, start=1024, cap=65536, step=256)
    assert r["mil"] <= 5000 < r["first_failure"] and r["first_failure"] - r["mil"] <= max(256, 5000 // 50 + 1)
    assert not r["capped"]
    capped = gpu_paper.bisect_max(lambda n: True, start=1024, cap=4096, step=256)
    assert capped["mil"] == 4096 and capped["capped"]


def test_cpu_rehearsal_writes_every_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    assert gpu_paper.main(["--device", "cpu", "--rehearsal", "--out-dir", str(tmp_path)]) == 0
    (out,) = tmp_path.glob("gpu_paper_*.json")
    doc = json.loads(out.read_text())
    assert doc["weights"] == "random weights, real shape" and doc["packages"]
    assert set(doc["mil"]) == set(gpu_paper.MIL_CONFIGS)
    # the cap is on activation memory: nochunk needs the most per token, hybrid the least
    assert doc["mil"]["hybrid"]["mil"] >= doc["mil"]["nochunk"]["mil"] > 0
    for name in ("WL1", "WL2"):
        w = doc["workloads"][name]
        assert {r["config"] for r in w["runs"]} == {"po", "fcfs", "chunked", "hf"}
        assert w["sustained"]["po"]["qps"] > 0
    assert doc["real"]["WL1"]["requests"] == 6 and doc["real"]["jct"]["steps"] > 0
    assert doc["prefill"]["gemm_peak_frac"] > 0
    md = out.with_suffix(".md").read_text()
    assert "Table 2" in md and "Sustained QPS" in md
