"""The example scripts' behaviour on the Fake backend (no model): label_data's resume, crash safety
and bad-row reports; recommend / credit_check end to end; sglang_select's error paths."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest

import po_lang as po
from tests.deps import missing, require
from tests.server_utils import sglang_frontend

ROOT = Path(__file__).resolve().parents[1]
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


def write_jsonl(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def reviews(n: int) -> list[str]:
    return [
        json.dumps({"id": i, "text": f"review number {i} was {'great' if i % 2 else 'bad'}"})
        for i in range(n)
    ]


def read_output(path: Path) -> list[dict]:
    """Every line must be a complete JSON record: the output is never partially written."""
    raw = path.read_bytes()
    assert raw == b"" or raw.endswith(b"\n"), "output ends mid-line"
    return [json.loads(line) for line in raw.decode().splitlines()]


def run(args: Sequence[str], fake: po.Fake) -> int:
    return label_data.main([*args, "--no-progress", "--calibrate", "none"], backend=fake)


# ---- label_data ---------------------------------------------------------------------------------


def test_label_data_labels_every_row_and_reports_bad_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = reviews(6)
    lines.insert(2, '{"id": "broken", "text": "no closing brace"')  # line 3
    lines.insert(4, json.dumps(["not", "an", "object"]))  # line 5
    lines.insert(5, json.dumps({"id": "x", "body": "no text field"}))  # line 6
    lines.insert(6, json.dumps({"id": "y", "text": "   "}))  # line 7
    lines.insert(7, json.dumps({"id": "z", "text": 42}))  # line 8
    lines.insert(8, "")  # line 9: blank, not a row
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    fake = po.Fake(seed=1)
    assert run([str(path)], fake) == 0
    err = capsys.readouterr().err
    for line_no, what in [
        (3, "invalid JSON"),
        (5, "JSON object"),
        (6, "no field 'text'"),
        (7, "empty"),
        (8, "int"),
    ]:
        assert f"bad row at line {line_no}: " in err and what in err, (line_no, err)
    out = read_output(tmp_path / "data.labeled.jsonl")
    good_lines = [1, 2, 4, 10, 11, 12]
    assert [r["line"] for r in out] == good_lines
    assert [r["input"]["id"] for r in out] == list(range(6))
    assert n_requests(fake) == 6
    # Each record is what the classifier says for that row.
    fn = label_data.make_classifier(
        ["positive", "negative"],
        instruction="Classify the sentiment of this review as positive or negative.",
        item_prefix="Review: ",
        calibrate="none",
        backend=fake,
        batch_size=8,
    )
    for rec in out:
        want = fn(rec["input"]["text"])
        assert rec["label"] == want.label
        assert rec["probs"] == pytest.approx(want.probs, abs=1e-6)


def test_label_data_resumes_without_recomputing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", reviews(20))
    fake = po.Fake(seed=2)
    assert run([str(path), "--max-rows", "7", "--batch-size", "3"], fake) == 0
    assert n_requests(fake) == 7
    assert len(read_output(tmp_path / "data.labeled.jsonl")) == 7
    assert "run the same command again to resume" in capsys.readouterr().out

    assert run([str(path), "--batch-size", "3"], fake) == 0
    assert n_requests(fake) == 20, "the 7 rows labeled before were not recomputed"
    assert "(13 now, 7 from an earlier run)" in capsys.readouterr().out
    resumed = read_output(tmp_path / "data.labeled.jsonl")

    # The same as labeling in one go; and a third run computes nothing.
    one_go = write_jsonl(tmp_path / "again.jsonl", reviews(20))
    assert run([str(one_go)], fake) == 0
    assert resumed == read_output(tmp_path / "again.labeled.jsonl")
    before = n_requests(fake)
    assert run([str(path)], fake) == 0
    assert n_requests(fake) == before


def test_label_data_relabels_edited_rows_and_changed_setups(tmp_path: Path) -> None:
    lines = reviews(8)
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    fake = po.Fake(seed=3)
    assert run([str(path)], fake) == 0
    first = read_output(tmp_path / "data.labeled.jsonl")
    lines[4] = json.dumps({"id": 4, "text": "an edited review, now quite different"})
    write_jsonl(path, lines)
    before = n_requests(fake)
    assert run([str(path)], fake) == 0
    assert n_requests(fake) - before == 1, "only the edited row is labeled again"
    second = read_output(tmp_path / "data.labeled.jsonl")
    assert second[4]["input"]["text"].startswith("an edited review")
    assert [r for i, r in enumerate(second) if i != 4] == [r for i, r in enumerate(first) if i != 4]

    before = n_requests(fake)
    assert run([str(path), "--labels", "good,bad"], fake) == 0
    assert n_requests(fake) - before == 8, "other labels: nothing earlier is reused"
    assert {r["label"] for r in read_output(tmp_path / "data.labeled.jsonl")} <= {"good", "bad"}


def test_label_data_hard_crash_leaves_a_valid_file_and_resumes(tmp_path: Path) -> None:
    """A process killed mid-job (os._exit: no finally, no flush) after two batches of 4."""
    path = write_jsonl(tmp_path / "data.jsonl", reviews(20))
    code = textwrap.dedent(
        f"""
        import importlib.util, os, sys
        import po_lang as po
        spec = importlib.util.spec_from_file_location("ld", {str(EXAMPLES / "label_data.py")!r})
        ld = importlib.util.module_from_spec(spec); sys.modules["ld"] = ld; spec.loader.exec_module(ld)

        class Crashing(po.Fake):
            def score(self, requests):
                if len(self.batches) == 2:
                    os._exit(9)
                return super().score(requests)

        ld.main([{str(path)!r}, "--batch-size", "4", "--calibrate", "none", "--no-progress"], backend=Crashing())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    out_path, journal = label_data.output_paths(path)
    assert read_output(out_path) == []  # the output from the start of the run: empty but valid
    journaled = read_output(journal)
    assert [r["line"] for r in journaled] == list(range(1, 9))

    # A crash while appending tears the journal's last line: it is dropped, that row redone.
    raw = journal.read_bytes()
    journal.write_bytes(raw[: raw.rstrip(b"\n").rfind(b"\n") + 1] + raw.splitlines()[-1][:30])
    fake = po.Fake(seed=4)
    assert run([str(path), "--batch-size", "4"], fake) == 0
    assert n_requests(fake) == 20 - 8 + 1
    out = read_output(out_path)
    assert [r["line"] for r in out] == list(range(1, 21))
    assert not journal.exists()


def test_label_data_failed_write_keeps_the_previous_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", reviews(6))
    fake = po.Fake(seed=5)
    assert run([str(path), "--max-rows", "3"], fake) == 0
    out_path, _ = label_data.output_paths(path)
    before = out_path.read_bytes()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(label_data.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        run([str(path)], fake)
    assert out_path.read_bytes() == before
    assert not list(tmp_path.glob("*.tmp")), "the temporary file is cleaned up"


def test_label_data_backend_down_stops_with_progress_saved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    class Dying(po.Fake):
        def score(self, requests):  # type: ignore[no-untyped-def]
            if len(self.batches) >= 2:
                self.batches.append(list(requests))
                return [po.BackendError("request to http://x/generate failed: refused") for _ in requests]
            return super().score(requests)

    path = write_jsonl(tmp_path / "data.jsonl", reviews(12))
    assert run([str(path), "--batch-size", "3"], Dying(seed=6)) == 1
    err = capsys.readouterr().err
    assert "failed every row of a batch" in err and "rerun" in err
    assert len(read_output(label_data.output_paths(path)[0])) == 6
    fake = po.Fake(seed=6)
    assert run([str(path), "--batch-size", "3"], fake) == 0
    assert n_requests(fake) == 6


def test_label_data_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "data.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "review"])
        w.writerow(["1", "good food"])  # line 2
        w.writerow(["2", "spans\ntwo lines"])  # lines 3-4
        w.writerow(["3", ""])  # line 5: empty text
        w.writerow(["4", "too", "many"])  # line 6
        w.writerow(["5", "bad service"])  # line 7
    fake = po.Fake(seed=7)
    assert run([str(path), "--text-field", "review"], fake) == 0
    err = capsys.readouterr().err
    assert "line 5: field 'review' is empty" in err and "line 6: expected 2 fields, got 3" in err
    out = read_output(tmp_path / "data.labeled.jsonl")
    assert [(r["line"], r["input"]["id"]) for r in out] == [(2, "1"), (3, "2"), (7, "5")]

    assert run([str(path)], fake) == 2
    assert "no column 'text'" in capsys.readouterr().err


def test_label_data_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = po.Fake(seed=8)
    assert run([str(tmp_path / "missing.jsonl")], fake) == 2
    assert "no such file" in capsys.readouterr().err
    path = write_jsonl(tmp_path / "data.jsonl", reviews(2))
    assert run([str(path), "--labels", "yes,yes"], fake) == 2
    assert "distinct" in capsys.readouterr().err
    assert run([str(path), "--labels", "yes"], fake) == 2
    assert "at least two labels" in capsys.readouterr().err


def test_label_data_calibration_modes(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", reviews(6))
    fake = po.Fake(seed=9)
    assert label_data.main([str(path), "--no-progress"], backend=fake) == 0  # default: content-free
    assert n_requests(fake) == 6 + 1, "one content-free probe for the shared prefix"
    cf = read_output(tmp_path / "data.labeled.jsonl")

    gold = [
        json.dumps({"text": f"sample {i}", "label": "positive" if i % 2 else "negative"}) for i in range(6)
    ]
    cal = write_jsonl(tmp_path / "gold.jsonl", gold)
    assert label_data.main([str(path), "--no-progress", "--calibrate", str(cal)], backend=fake) == 0
    fitted = read_output(tmp_path / "data.labeled.jsonl")
    assert {r["config"] for r in fitted}.isdisjoint({r["config"] for r in cf}), "another setup"
    assert [r["probs"] for r in fitted] != [r["probs"] for r in cf]


def test_shipped_sample_reports_its_two_bad_rows() -> None:
    rows = list(label_data.read_rows(label_data.SAMPLE, "text"))
    bad = [r for r in rows if isinstance(r, label_data.BadRow)]
    good = [r for r in rows if isinstance(r, label_data.Row)]
    assert [b.line for b in bad] == [18, 35]
    assert 40 <= len(good) <= 60
    golds = [r.data["gold"] for r in good]
    assert golds.count("positive") == golds.count("negative")


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray on 2 CPUs (as tests/test_ray.py), shut down after this module's tests."""
    ray = require("ray", "pip install 'ray[data]'")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_label_data_on_ray_equals_in_process_and_resumes(
    tmp_path: Path, tokenized_llama: Path, local_ray: None, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = reviews(12)
    lines.append(json.dumps({"id": "long", "text": "x " * 1200}))  # line 13: over max_input_len
    model = ["--model", str(tokenized_llama), "--dtype", "fp32", "--labels", "Yes,No"]
    common = [*model, "--batch-size", "4", "--calibrate", "none", "--no-progress"]
    local = write_jsonl(tmp_path / "local.jsonl", lines)
    assert label_data.main([str(local), *common]) == 0
    want = read_output(tmp_path / "local.labeled.jsonl")
    assert len(want) == 12 and {r["label"] for r in want} <= {"Yes", "No"}
    assert "bad row at line 13: not scored: " in capsys.readouterr().err

    # This process's backend only checks the labels: a Fake that never scores a row here, so every
    # record below was computed by the Ray actors (on the tiny model, from --model).
    driver = po.Fake(seed=12)
    on_ray = write_jsonl(tmp_path / "ray.jsonl", lines)
    ray_args = [str(on_ray), *common, "--ray", "--concurrency", "2"]
    assert label_data.main([*ray_args, "--max-rows", "5"], backend=driver) == 0
    assert len(read_output(tmp_path / "ray.labeled.jsonl")) == 5
    capsys.readouterr()
    assert label_data.main(ray_args, backend=driver) == 0  # resumes: the 5 are not labeled again
    out, err = capsys.readouterr()
    assert "12 of 13 rows labeled (7 now, 5 from an earlier run), 1 bad" in out
    assert "bad row at line 13: not scored: " in err
    assert n_requests(driver) == 0
    got = read_output(tmp_path / "ray.labeled.jsonl")
    assert [r["line"] for r in got] == [r["line"] for r in want] == list(range(1, 13))
    for g, w in zip(got, want, strict=True):
        assert (g["key"], g["config"], g["label"], g["input"]) == (
            w["key"],
            w["config"],
            w["label"],
            w["input"],
        )
        assert g["probs"] == pytest.approx(w["probs"], abs=1e-5)


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
    url = f"http://127.0.0.1:{sglang_select.free_port()}"  # nothing listens there
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


def test_label_data_one_run_per_file_user_umask_no_stale_temporaries(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", reviews(6))
    out, _ = label_data.output_paths(path)
    stale = out.with_name(out.name + ".abc123.tmp")  # what a run killed inside write_atomic leaves
    stale.write_text("half")
    fake = po.Fake(seed=5)
    old = os.umask(0o027)
    try:
        # While another run holds the file, a second run refuses (it would delete its journal).
        with label_data.exclusive(out):
            assert run([str(path)], fake) == 2
        assert not out.exists()
        assert run([str(path)], fake) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o640  # 0666 less the umask, not mkstemp's 0600
    assert not stale.exists() and not list(tmp_path.glob("*.tmp"))
    assert len(read_output(out)) == 6
