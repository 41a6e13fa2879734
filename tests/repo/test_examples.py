"""The example scripts' behaviour on the Fake backend (no model): label_data drives the label
command; recommend / credit_check end to end; sglang_select's error paths."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import po_lang as po
from tests.deps import missing
from tests.server_utils import dead_url, sglang_frontend

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def load_example(name: str) -> ModuleType:
    """Import examples/<name>.py (a script folder, not a package) under the name `examples_<name>`."""
    mod_name = f"examples_{name}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None, name
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


label_data = load_example("label_data")
recommend = load_example("recommend")
credit_check = load_example("credit_check")
sglang_select = load_example("sglang_select")


def n_requests(fake: po.Fake) -> int:
    return sum(len(b) for b in fake.batches)


def test_label_data_example_runs_the_label_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The short example drives `prefillonly label` (tests/lang/test_label.py tests the command)."""
    sample = tmp_path / "reviews.jsonl"
    sample.write_bytes(label_data.SAMPLE.read_bytes())
    monkeypatch.setattr(label_data, "SAMPLE", sample)
    fake = po.Fake(seed=1)
    real = label_data.label
    monkeypatch.setattr(label_data, "label", lambda argv: real(argv, backend=fake))
    assert label_data.main(["--no-progress", "--calibrate", "none"]) == 0
    out = capsys.readouterr().out
    assert "50 of 50 rows labeled" in out
    assert "accuracy against the gold field 'gold'" in out and "least sure:" in out
    assert len((tmp_path / "reviews.labeled.jsonl").read_text().splitlines()) == 50


# ---- recommend / credit_check -------------------------------------------------------------------


def test_recommend_ranks_by_p_yes_and_reuses_the_profile(capsys: pytest.CaptureFixture[str]) -> None:
    fake = po.Fake(seed=10, vocab_size=4096)
    with po.using(fake):
        results = recommend.recommend(recommend.USERS, 10)
        for i, (user, res) in enumerate(zip(recommend.USERS, results, strict=True)):
            assert sorted(r.item for r in res.ranked) == sorted(p.text for p in recommend.candidates(i, 10))
            scores = [r.score for r in res.ranked]
            assert scores == sorted(scores, reverse=True)
            for r in res.ranked:
                assert r.score == pytest.approx(recommend.will_engage(user.profile, r.item).probs["Yes"])
            # Every candidate after the first reuses at least the user's whole shared prefix.
            prefix = recommend.will_engage.compile(user.profile, "x").prompt.cache_prefix_len
            assert res.cached_tokens >= 9 * prefix
    assert recommend.main(["--top-k", "3"], backend=fake) == 0
    out = capsys.readouterr().out
    assert out.count("  1. P(Yes)=") == 3 and "cached" in out and "  4. " not in out


def test_pairwise_auc() -> None:
    assert recommend.pairwise_auc([0.9, 0.8], [0.1, 0.85]) == 0.75
    assert recommend.pairwise_auc([0.5], [0.5]) == 0.5
    assert recommend.pairwise_auc([], [0.1]) is None


def test_credit_check_histories_and_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    people = credit_check.applicants(6)
    assert people == credit_check.applicants(6), "deterministic"
    assert people != credit_check.applicants(6, seed=1)
    assert [p.risky for p in people] == [False, True] * 3
    assert all(12 <= len(p.history.splitlines()) <= 45 for p in people)
    assert all("SALARY" in p.history for p in people if not p.risky)
    assert all("SALARY" not in p.history for p in people if p.risky)

    fake = po.Fake(seed=11, vocab_size=8192)
    with po.using(fake):
        decisions = credit_check.check(people)
        # Two labels, each its own continuation (multi-token), for every applicant and for the
        # one content-free probe of the shared policy prefix.
        assert n_requests(fake) == 2 * len(people) + 2
        assert credit_check.decide("N/A").probs["approve"] == pytest.approx(0.5, abs=1e-9)
    for d in decisions:
        lp = d.result.logprobs
        assert d.raw_approve == pytest.approx(
            math.exp(lp["approve"]) / (math.exp(lp["approve"]) + math.exp(lp["deny"]))
        )
        assert d.approve == d.result.probs["approve"]
    sep = credit_check.separation(decisions)
    assert sep is not None and 0.0 <= sep <= 1.0
    assert credit_check.main([], backend=fake) == 0
    out = capsys.readouterr().out
    assert out.count("applicant-") == 6 and "ranking AUC" in out


# ---- sglang_select ------------------------------------------------------------------------------


def test_sglang_select_unreachable_server_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    sglang_frontend()  # installed, or a skip
    with dead_url() as url:
        assert sglang_select.main(["--url", url]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err


@pytest.mark.slow
def test_sglang_shim_does_not_import_torch() -> None:
    if importlib.util.find_spec("sglang") is None:
        missing("sglang is not installed (pip install --no-deps sglang==0.5.23)")
    # No ImportError is swallowed: with torch blocked, one means the shim (or what it loads) needs it.
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from po_lang.sglang_shim import import_sglang_frontend\n"
        "sgl = import_sglang_frontend()\n"
        "assert callable(sgl.select) and callable(sgl.function)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
