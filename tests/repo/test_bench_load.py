"""benchmarks/bench_load.py on a tiny cut of a real shape: each configuration in its own process,
with and without a busy loop beside it, and the busy loops gone afterwards. Not timed."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest

from benchmarks import bench_load

TINY = "qwen3-0.6b?hidden_size=64&intermediate_size=128&num_attention_heads=4&num_key_value_heads=2"
TINY += "&head_dim=16&vocab_size=49152"


@pytest.mark.slow
def test_load_benchmark_on_a_tiny_cut(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    argv = ["--shape", TINY, "--layers", "2", "--tokens", "48", "--repeats", "1", "--spinners", "0,1"]
    argv += ["--envs", ",OMP_WAIT_POLICY=PASSIVE", "--threads-list", "1", "--out", str(out)]
    assert bench_load.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["spinners"], r["env"]) for r in rows] == [
        (s, e) for s in (0, 1) for e in ("", "OMP_WAIT_POLICY=PASSIVE")
    ]
    assert all(r["threads"] == 1 and set(r["median_s"]) == {"ours", "transformers"} for r in rows)
    left = [p for p in psutil.Process().children(recursive=True) if bench_load.SPIN in " ".join(p.cmdline())]
    assert left == []  # this run's busy loops, not another process's
