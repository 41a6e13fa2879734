"""A rehearsal of benchmarks/bench_attention_cpu.py (fp32 CPU attention alone): short lengths, one
repeat, every candidate, so the benchmark cannot rot. Not timed: structure and agreement."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import bench_attention_cpu


def test_rehearsal_checks_every_candidate_against_flash(tmp_path: Path) -> None:
    out = tmp_path / "attn.json"
    assert bench_attention_cpu.main(["--lengths", "64,600", "--repeats", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["heads"] == [16, 8, 128] and doc["gemm_peak"]["max_gflops"] > 0
    assert [r["n"] for r in doc["rows"]] == [64, 600]
    for row in doc["rows"]:
        for name in ("flash", "kernel", "torch_blocks"):
            r = row[name]
            assert len(r["seconds"]) == 1 and r["gflops"] > 0 and r["gemm_peak_frac"] > 0
            assert r["max_abs_diff"] < 1e-4  # the same attention as torch's flash kernel
        assert row["flash"]["vs_flash"] == 1.0
    assert "x flash" in out.with_suffix(".md").read_text()
