"""A rehearsal of benchmarks/bench_real_shapes.py (real shapes on the CPU against transformers and
llama.cpp, and the WL1-style labeling job): a 2-layer cut of each shape, tiny lengths, end to end, so
the benchmark cannot rot before someone runs it at full size. Not timed: structure and agreement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import bench_real_shapes, llamacpp


def test_rehearsal_writes_every_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "rs.json"
    assert (
        bench_real_shapes.main(["--rehearsal", "--shapes", "qwen3-0.6b", "--sdpa-ab", "--out", str(out)]) == 0
    )
    doc = json.loads(out.read_text())
    assert doc["weights"] == "random weights, real shape" and doc["dtype"] == "torch.float32"
    assert doc["gemm_peak_gflops"] > 0 and doc["machine"]["cpu"]
    (shape,) = doc["shapes"]
    assert [r["n"] for r in shape["prefill"]] == [64, 160]
    for row in shape["prefill"]:
        for system in ("ours", "transformers", "ours_sdpa"):
            r = row[system]
            assert len(r["seconds"]) == 2 and r["gemm_peak_frac"] > 0 and r["peak_mib"] >= 0
        assert row["ratio_to_sdpa"] > 0
    job = doc["labeling"]
    assert job["items"] == 6 and job["users"] == 2
    expected = {"ours", "transformers"} | (
        {"llama.cpp f16", "llama.cpp q8_0"} if llamacpp.available() else set()
    )
    assert set(job["systems"]) == expected
    # The same weights: every system's P(Yes) agrees with transformers' (Q8_0 within its rounding).
    diffs = job["max_abs_p_yes_vs_transformers"]
    assert (
        diffs["ours"] < 1e-4
        and diffs.get("llama.cpp f16", 0.0) < 1e-3
        and diffs.get("llama.cpp q8_0", 0.0) < 2e-2
    )
    if llamacpp.available():
        assert {r["gguf"] for r in shape["llama_cpp"]} == {"f16", "q8_0"}
    md = out.with_suffix(".md").read_text()
    assert "random weights, real shape" in md and "Labeling job" in md and "PO_CPU_ATTENTION=sdpa" in md
