"""benchmarks/profile_forward.py on a tiny cut of a real shape: both systems profiled, every GEMM
of ours found with its exact (M, N, K) and compared with a bare mm. Not timed: structure only."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import profile_forward

TINY = "qwen3-0.6b?hidden_size=64&intermediate_size=128&num_attention_heads=4&num_key_value_heads=2"
TINY += "&head_dim=16&vocab_size=49152"


def test_profile_of_a_tiny_cut(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFILLONLY_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "p.json"
    assert profile_forward.main(["--shape", TINY, "--layers", "2", "--tokens", "96", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["weights"] == "random weights, real shape" and doc["model"].endswith("num_hidden_layers=2")
    assert set(doc["systems"]) == {"ours", "transformers"}
    ours = doc["systems"]["ours"]
    shapes = {(g["m"], g["n"], g["k"]): g for g in ours["gemms"]}
    # qkv (4 + 2 + 2 heads of 16), gate/up, down, o: one chunk of all 96 rows; the 1-row head.
    for mnk in [(96, 128, 64), (96, 256, 64), (96, 64, 128), (96, 64, 64), (1, 49152, 64)]:
        assert mnk in shapes, (mnk, sorted(shapes))
        assert shapes[mnk]["bare_mm_gflops"] > 0
    assert shapes[(96, 128, 64)]["calls"] == 2  # one per layer
    assert ours["categories_s"]["gemm"] > 0 and ours["categories_s"]["attention"] > 0
