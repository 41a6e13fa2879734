"""The GPU check's own logic, without a GPU: it refuses to start without the device it was asked
for, and its report names the device and turns failures into FAIL lines (a check that cannot
fail would verify nothing)."""

from __future__ import annotations

import pytest
import torch

from scripts import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA answers")
def test_refuses_without_cuda(capsys) -> None:
    assert gpu_check.main(["--device", "cuda", "--out", "/nonexistent/never-written.md"]) == 2
    assert "asks for CUDA" in capsys.readouterr().err


def _tests(**over) -> dict:
    base = {
        "ok": True,
        "seconds": 12.0,
        "counts": {"passed": 3, "failed": 0, "error": 0, "skipped": 0},
        "device_cases": 2,
        "device_passed": 2,
        "not_passed": [],
    }
    return {**base, **over}


def _bench() -> dict:
    row = {"dtype": "torch.bfloat16", "n": 1024, "status": "ok", "peak_bytes": 3 << 20}
    hybrid = {**row, "config": "hybrid", "tok_per_s": 2000.0, "gemm_peak_frac": 0.5, "attention_share": 0.2}
    hf = {**row, "config": "hf-ltk1", "tok_per_s": 1000.0, "gemm_peak_frac": 0.25, "attention_share": None}
    failed = {"dtype": "torch.bfloat16", "n": 8192, "config": "hybrid", "status": "oom", "detail": "exit -9"}
    doc = {
        "gemm_peak_gflops": {"torch.bfloat16": 500e3},
        "rows": [hybrid, hf, failed],
        "speed": [{"dtype": "torch.bfloat16", "n": 1024, "ratio": 2.0}],
    }
    return {"ok": False, "doc": doc, "failed": [failed]}


def test_report_names_the_device_and_the_failures() -> None:
    failing = ("tests/engine/test_cuda.py", "test_cold[llama-cuda]", "failed", "assert 0.3 <= 0.0001")
    md = gpu_check.render(
        torch.device("cpu"),
        _tests(ok=False, counts={"passed": 2, "failed": 1, "error": 0, "skipped": 0}, not_passed=[failing]),
        _bench(),
        "abc123",
    )
    assert md.startswith("## GPU check: cpu: ")
    assert "commit abc123" in md
    assert "1 failed" in md and "FAIL" in md and "test_cold[llama-cuda]" in md
    assert "| torch.bfloat16 | hybrid | 1024 | 2000 | 3.0 | 50.0% | 20% |" in md
    assert "| torch.bfloat16 | hybrid | 8192 | oom: exit -9 |" in md
    assert "n=1024: 2.00x" in md


def test_report_passes_only_when_everything_ran() -> None:
    md = gpu_check.render(torch.device("cpu"), _tests(), {"ok": False, "detail": "bench_mil exited 1"}, "x")
    assert "**bench_mil --device cpu**: FAIL" in md and "bench_mil exited 1" in md
    assert md.count("PASS") == 1  # the tests passed, the benchmark did not
