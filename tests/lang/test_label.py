"""`prefillonly label` (po_lang.label): bad-row reports, resume (also after SIGKILL), crash safety,
never deleting finished work, stopping on a backend that is down, CSV / Parquet in and out, the
gold summary, --server against our real server, and po.Remote's retries (--ray: tests/server/test_ray.py,
beside the other test of the session's local Ray)."""

from __future__ import annotations

import csv
import http.server
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

import po_lang as po
from po_lang.label import main as label_main
from po_lang.label import source, store
from po_lang.label.cli import parse_args
from po_lang.label.task import from_template
from tests.deps import require
from tests.server_utils import ServerProcess, dead_url

ROOT = Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "examples" / "data" / "reviews.jsonl"
TEMPLATE = "Classify the sentiment of this review as {labels}.\nReview: {text}"
BASE = ["--labels", "positive,negative", "--template", TEMPLATE, "--no-progress", "--calibrate", "none"]


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


def run(args: Sequence[str], fake: po.Backend) -> int:
    """The command with the test's defaults; later flags in `args` override them."""
    return label_main([*BASE, *args], backend=fake)


# ---- labeling, bad rows, resume -----------------------------------------------------------------


def test_labels_every_row_and_reports_bad_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lines = reviews(6)
    lines.insert(2, '{"id": "broken", "text": "no closing brace"')  # line 3
    lines.insert(4, json.dumps(["not", "an", "object"]))  # line 5
    lines.insert(5, json.dumps({"id": "x", "body": "no text field"}))  # line 6
    lines.insert(6, json.dumps({"id": "y", "text": "   "}))  # line 7
    lines.insert(7, json.dumps({"id": "z", "text": [42]}))  # line 8
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
        (8, "list"),
    ]:
        assert f"bad row at line {line_no}: " in err and what in err, (line_no, err)
    out = read_output(tmp_path / "data.labeled.jsonl")
    assert [r["line"] for r in out] == [1, 2, 4, 10, 11, 12]
    assert [r["input"]["id"] for r in out] == list(range(6))
    assert n_requests(fake) == 6
    # Each record is what the classifier says for that row.
    task = from_template(
        TEMPLATE, ["positive", "negative"], chat=True, calibrate=None, backend=fake, batch_size=8
    )
    assert task.classifier.prompt(text="x").shared_text.endswith("positive or negative.\nReview: ")
    for rec in out:
        want = task.classifier(text=rec["input"]["text"])
        assert rec["label"] == want.label
        assert rec["probs"] == pytest.approx(want.probs, abs=1e-6)


def test_resumes_without_recomputing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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


def test_edited_rows_are_relabeled_and_a_changed_setup_never_deletes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = reviews(8)
    path = write_jsonl(tmp_path / "data.jsonl", lines)
    out_path = tmp_path / "data.labeled.jsonl"
    fake = po.Fake(seed=3)
    assert run([str(path)], fake) == 0
    first = read_output(out_path)
    lines[4] = json.dumps({"id": 4, "text": "an edited review, now quite different"})
    write_jsonl(path, lines)
    before = n_requests(fake)
    assert run([str(path)], fake) == 0
    assert n_requests(fake) - before == 1, "only the edited row is labeled again"
    second = read_output(out_path)
    assert second[4]["input"]["text"].startswith("an edited review")
    assert [r for i, r in enumerate(second) if i != 4] == [r for i, r in enumerate(first) if i != 4]

    # Other labels, template or calibration: the run refuses before touching anything, also
    # when the backend is down (nothing is scored), and names the way out.
    capsys.readouterr()
    kept = out_path.read_bytes()
    for other in (
        ["--labels", "good,bad"],
        ["--template", "Review: {text}"],
        ["--calibrate", "content-free"],
    ):
        before = n_requests(fake)
        assert run([str(path), *other], fake) == 2, other
        assert "--output" in capsys.readouterr().err
        assert n_requests(fake) == before and out_path.read_bytes() == kept
    with dead_url() as nobody:
        assert run([str(path), "--labels", "good,bad"], po.Remote(nobody, retries=0)) == 2
    assert out_path.read_bytes() == kept
    # ... and labels into a new file when asked to.
    new = tmp_path / "goodbad.jsonl"
    assert run([str(path), "--labels", "good,bad", "-o", str(new)], fake) == 0
    assert {r["label"] for r in read_output(new)} <= {"good", "bad"} and len(read_output(new)) == 8
    assert out_path.read_bytes() == kept

    # Rows removed from the input keep their records (nothing finished is thrown away).
    write_jsonl(path, lines[:5])
    assert run([str(path)], fake) == 0
    assert [r["line"] for r in read_output(out_path)] == list(range(1, 9))


@pytest.mark.slow
def test_hard_crash_leaves_a_valid_file_and_resumes(tmp_path: Path) -> None:
    """A process killed mid-job (os._exit: no finally, no flush) after two batches of 4."""
    path = write_jsonl(tmp_path / "data.jsonl", reviews(20))
    code = textwrap.dedent(
        f"""
        import os
        import po_lang as po
        from po_lang.label import main

        class Crashing(po.Fake):
            def score(self, requests):
                if len(self.batches) == 2:
                    os._exit(9)
                return super().score(requests)

        main([*{BASE!r}, {str(path)!r}, "--batch-size", "4"], backend=Crashing())
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    paths = store.Paths.of(tmp_path / "data.labeled.jsonl")
    assert read_output(paths.records) == []  # the output from the start of the run: empty but valid
    journaled = read_output(paths.journal)
    assert [r["line"] for r in journaled] == list(range(1, 9))

    # A crash while appending tears the journal's last line: it is dropped, that row redone.
    raw = paths.journal.read_bytes()
    paths.journal.write_bytes(raw[: raw.rstrip(b"\n").rfind(b"\n") + 1] + raw.splitlines()[-1][:30])
    fake = po.Fake(seed=4)
    assert run([str(path), "--batch-size", "4"], fake) == 0
    assert n_requests(fake) == 20 - 8 + 1
    out = read_output(paths.records)
    assert [r["line"] for r in out] == list(range(1, 21))
    assert not paths.journal.exists()


@pytest.mark.slow
def test_sigkill_mid_run_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    """`prefillonly label` killed with SIGKILL once some batches are journaled; the rerun labels
    exactly the rest, and the output has every row once."""
    n = 60
    path = write_jsonl(tmp_path / "data.jsonl", reviews(n))
    code = textwrap.dedent(
        f"""
        import time
        import po_lang as po
        from po_lang.label import main

        class Slow(po.Fake):
            def score(self, requests):
                time.sleep(0.05)
                return super().score(requests)

        main([*{BASE!r}, {str(path)!r}, "--batch-size", "2"], backend=Slow(seed=5))
        """
    )
    paths = store.Paths.of(tmp_path / "data.labeled.jsonl")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (paths.journal.exists() and paths.journal.read_bytes().count(b"\n") >= 6):
            assert proc.poll() is None, "the run ended before it was killed"
            assert time.monotonic() < deadline, "no six journaled rows within 60 s"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done_before, _ = store.load_records(paths.journal)
    assert 6 <= len(done_before) < n, "killed mid-run"
    fake = po.Fake(seed=5)
    assert run([str(path), "--batch-size", "2"], fake) == 0
    assert n_requests(fake) == n - len(done_before), "every journaled row kept, none labeled twice"
    out = read_output(paths.records)
    assert [r["line"] for r in out] == list(range(1, n + 1))
    assert len({r["key"] for r in out}) == n
    # The records from before the kill are the ones in the output, unchanged.
    by_key = {r["key"]: r for r in out}
    assert all(by_key[k] == rec for k, rec in done_before.items())


def test_failed_write_keeps_the_previous_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", reviews(6))
    fake = po.Fake(seed=5)
    assert run([str(path), "--max-rows", "3"], fake) == 0
    out_path = tmp_path / "data.labeled.jsonl"
    before = out_path.read_bytes()

    def broken_replace(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(store.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        run([str(path)], fake)
    assert out_path.read_bytes() == before
    assert not list(tmp_path.glob("*.tmp")), "the temporary file is cleaned up"


# ---- a backend that is down ---------------------------------------------------------------------


def test_backend_down_stops_with_progress_saved(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    class Dying(po.Fake):
        def score(self, requests):  # type: ignore[no-untyped-def]
            if len(self.batches) >= 2:
                self.batches.append(list(requests))
                return [po.BackendError("request to http://x/generate failed: refused") for _ in requests]
            return super().score(requests)

    path = write_jsonl(tmp_path / "data.jsonl", reviews(12))
    assert run([str(path), "--batch-size", "3"], Dying(seed=6)) == 1
    err = capsys.readouterr().err
    assert "failed every row of a batch" in err and "rerun" in err and "bad row" not in err
    assert len(read_output(tmp_path / "data.labeled.jsonl")) == 6
    fake = po.Fake(seed=6)
    assert run([str(path), "--batch-size", "3"], fake) == 0
    assert n_requests(fake) == 6


def test_unreachable_backend_stops_on_the_first_row_it_cannot_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """BackendUnavailable (what po.Remote gives for a server it cannot reach) stops the run even
    when only part of a batch failed; nothing is reported as a bad row."""

    class Flaky(po.Fake):
        def score(self, requests):  # type: ignore[no-untyped-def]
            out = super().score(requests)
            if len(self.batches) >= 2:
                out[-1] = po.BackendUnavailable("request to http://x/generate failed: refused")
            return out

    path = write_jsonl(tmp_path / "data.jsonl", reviews(12))
    out_path = tmp_path / "data.labeled.jsonl"
    assert run([str(path), "--batch-size", "4", "--max-rows", "4"], po.Fake(seed=6)) == 0
    assert run([str(path), "--batch-size", "4"], Flaky(seed=6)) == 1
    err = capsys.readouterr().err
    assert "refused" in err and "bad row" not in err and "kept in" in err
    assert [r["line"] for r in read_output(out_path)] == list(range(1, 9))

    # A server that is not there at all: the first request fails, exit 1, the records stay.
    with dead_url() as nobody:
        assert run([str(path)], po.Remote(nobody, retries=1, max_retry_wait=0.5)) == 1
    assert "127.0.0.1" in capsys.readouterr().err
    assert [r["line"] for r in read_output(out_path)] == list(range(1, 9))


# ---- formats ------------------------------------------------------------------------------------


def test_csv_in_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
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
    review = ["--template", "Classify as {labels}.\nReview: {review}"]
    assert run([str(path), *review], fake) == 0
    err = capsys.readouterr().err
    assert "line 5: field 'review' is empty" in err and "line 6: expected 2 fields, got 3" in err
    out = read_output(tmp_path / "data.labeled.jsonl")
    assert [(r["line"], r["input"]["id"]) for r in out] == [(2, "1"), (3, "2"), (7, "5")]

    # A template field the file lacks: one clear error naming it.
    assert run([str(path)], fake) == 2
    assert "no column 'text'" in capsys.readouterr().err

    # CSV out: the records flattened; resumable (its records beside it).
    csv_out = tmp_path / "labeled.csv"
    assert run([str(path), *review, "-o", str(csv_out), "--max-rows", "2"], fake) == 0
    assert run([str(path), *review, "-o", str(csv_out)], fake) == 0
    assert "(1 now, 2 from an earlier run)" in capsys.readouterr().out
    with csv_out.open(newline="", encoding="utf-8") as f:
        got = list(csv.DictReader(f))
    assert list(got[0]) == ["line", "label", "probs.positive", "probs.negative", "input.id", "input.review"]
    assert [g["input.review"] for g in got] == ["good food", "spans\ntwo lines", "bad service"]
    for g, r in zip(got, out, strict=True):
        assert g["label"] == r["label"]
        assert float(g["probs.positive"]) == pytest.approx(r["probs"]["positive"])


def test_parquet_in_and_out(tmp_path: Path) -> None:
    pa = require("pyarrow", "pip install pyarrow")
    pq = require("pyarrow.parquet", "pip install pyarrow")
    rows = [json.loads(x) for x in reviews(7)]
    rows[3]["text"] = ""  # row 4: bad
    src = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    fake = po.Fake(seed=8)
    out = tmp_path / "out.parquet"
    assert run([str(src), "-o", str(out)], fake) == 0
    got = pq.read_table(out).to_pylist()
    assert [g["line"] for g in got] == [1, 2, 3, 5, 6, 7]
    assert [g["input"] for g in got] == [r for i, r in enumerate(rows) if i != 3]
    # The same labels as from the JSONL of the same rows.
    same = write_jsonl(tmp_path / "same.jsonl", [json.dumps(r) for r in rows])
    assert run([str(same)], fake) == 0
    want = read_output(tmp_path / "same.labeled.jsonl")
    assert [(g["label"], g["probs"]) for g in got] == [(w["label"], w["probs"]) for w in want]
    assert run([str(src), "--template", "{nope}"], fake) == 2  # a missing column, named up front


def test_gold_column_gives_accuracy_and_a_confusion_matrix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [json.loads(x) for x in reviews(10)]
    for i, r in enumerate(rows):
        r["gold"] = "positive" if i % 3 else "negative"
    path = write_jsonl(tmp_path / "data.jsonl", [json.dumps(r) for r in rows])
    assert run([str(path)], po.Fake(seed=9)) == 0
    out = capsys.readouterr().out
    recs = read_output(tmp_path / "data.labeled.jsonl")
    right = sum(r["label"] == r["input"]["gold"] for r in recs)
    assert f"accuracy against the gold field 'gold': {right / 10:.1%} of 10 rows" in out
    pp = sum(r["label"] == "positive" and r["input"]["gold"] == "positive" for r in recs)
    cells = next(
        x.split()
        for x in out.splitlines()
        if x.split()[:1] == ["positive"] and x.split()[1:2] != ["negative"] and "%" not in x
    )
    assert cells[1:] == [str(pp), str(sum(r["input"]["gold"] == "positive" for r in recs) - pp)]
    # No gold field: no accuracy line.
    plain = write_jsonl(tmp_path / "plain.jsonl", reviews(4))
    assert run([str(plain)], po.Fake(seed=9)) == 0
    assert "accuracy" not in capsys.readouterr().out


def test_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake = po.Fake(seed=8)
    assert run([str(tmp_path / "missing.jsonl")], fake) == 2
    assert "no such file" in capsys.readouterr().err
    path = write_jsonl(tmp_path / "data.jsonl", reviews(2))
    assert run([str(path), "--labels", "yes,yes"], fake) == 2
    assert "distinct" in capsys.readouterr().err
    assert run([str(path), "--labels", "yes"], fake) == 2
    assert "at least two labels" in capsys.readouterr().err
    assert run([str(path), "--template", "Review: {}"], fake) == 2
    assert "names no field" in capsys.readouterr().err
    assert run([str(path), "--template", "no field here"], fake) == 2
    assert "no {field}" in capsys.readouterr().err
    assert run([str(path), "-o", str(tmp_path / "x.xlsx")], fake) == 2
    assert "unknown format" in capsys.readouterr().err
    assert label_main([str(path), "--function", "no_such_module_xyz:fn"], backend=fake) == 2
    assert "cannot import 'no_such_module_xyz'" in capsys.readouterr().err
    assert label_main([str(path), "--function", "json:dumps"], backend=fake) == 2
    assert "not a @po.classify function" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        label_main([str(path), "--function", "json:dumps", "--labels", "a,b"], backend=fake)
    assert "--function builds its own prompt" in capsys.readouterr().err


def test_function_from_a_file(tmp_path: Path) -> None:
    mod = tmp_path / "clf.py"
    mod.write_text(
        textwrap.dedent(
            """
            import po_lang as po

            @po.classify(labels=["Yes", "No"])
            def engage(text: str, topic: str = "food") -> po.Prompt:
                return po.shared(f"Topic: {topic}\\n") + f"Post: {text}\\nRelevant? Answer:"
            """
        )
    )
    path = write_jsonl(tmp_path / "data.jsonl", reviews(5))
    fake = po.Fake(seed=11)
    args = [str(path), "--function", f"{mod}:engage", "--no-progress"]
    assert label_main(args, backend=fake) == 0
    out = read_output(tmp_path / "data.labeled.jsonl")
    assert len(out) == 5 and {r["label"] for r in out} <= {"Yes", "No"}
    # Rows missing a required parameter's field are bad rows naming it; optional ones may be missing.
    write_jsonl(path, [json.dumps({"id": 1, "body": "x"}), json.dumps({"text": "t", "topic": "cars"})])
    assert label_main([*args, "-o", str(tmp_path / "two.jsonl")], backend=fake) == 0
    assert [r["input"]["topic"] for r in read_output(tmp_path / "two.jsonl")] == ["cars"]


def test_calibration_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", reviews(6))
    fake = po.Fake(seed=9)
    common = ["--labels", "positive,negative", "--template", TEMPLATE, "--no-progress"]
    assert label_main([str(path), *common], backend=fake) == 0  # default: content-free
    assert n_requests(fake) == 6 + 1, "one content-free probe for the shared prefix"
    cf = read_output(tmp_path / "data.labeled.jsonl")

    gold = [
        json.dumps({"text": f"sample {i}", "label": "positive" if i % 2 else "negative"}) for i in range(6)
    ]
    cal = write_jsonl(tmp_path / "gold.jsonl", gold)
    fitted_out = tmp_path / "fitted.jsonl"
    assert label_main([str(path), *common, "--calibrate", str(cal), "-o", str(fitted_out)], backend=fake) == 0
    assert "calibrated on 6 labeled rows" in capsys.readouterr().out
    fitted = read_output(fitted_out)
    assert {r["config"] for r in fitted}.isdisjoint({r["config"] for r in cf}), "another setup"
    assert [r["probs"] for r in fitted] != [r["probs"] for r in cf]
    # The same calibration file again: the same setup, so it resumes (nothing to do).
    before = n_requests(fake)
    assert label_main([str(path), *common, "--calibrate", str(cal), "-o", str(fitted_out)], backend=fake) == 0
    assert n_requests(fake) == before


def test_shipped_sample_reports_its_two_bad_rows() -> None:
    rows = list(source.read_rows(SAMPLE, ("text",)))
    bad = [r for r in rows if isinstance(r, source.BadRow)]
    good = [r for r in rows if isinstance(r, source.Row)]
    assert [b.line for b in bad] == [18, 35]
    assert 40 <= len(good) <= 60
    golds = [r.data["gold"] for r in good]
    assert golds.count("positive") == golds.count("negative")


def test_one_run_per_file_user_umask_no_stale_temporaries(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "data.jsonl", reviews(6))
    paths = store.Paths.of(tmp_path / "data.labeled.jsonl")
    stale = paths.output.with_name(paths.output.name + ".abc123.tmp")  # what a killed write_atomic leaves
    stale.write_text("half")
    fake = po.Fake(seed=5)
    old = os.umask(0o027)
    try:
        # While another run holds the file, a second run refuses (it would fold its journal away).
        with store.exclusive(paths):
            assert run([str(path)], fake) == 2
        assert not paths.output.exists()
        assert run([str(path)], fake) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE(paths.output.stat().st_mode) == 0o640  # 0666 less the umask, not mkstemp's 0600
    assert not stale.exists() and not list(tmp_path.glob("*.tmp"))
    assert len(read_output(paths.output)) == 6


def test_prefillonly_label_entry_point_and_api_key_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from po_lang.cli import main; main(['label', '--help'])"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--template" in proc.stdout and "--server" in proc.stdout
    monkeypatch.setenv("PREFILLONLY_API_KEY", "from-env")
    assert parse_args(["x.jsonl", "--labels", "a,b"]).api_key == "from-env"
    assert parse_args(["x.jsonl", "--labels", "a,b", "--api-key", "flag"]).api_key == "flag"


# ---- po.Remote's retries ------------------------------------------------------------------------


class Busy(http.server.BaseHTTPRequestHandler):
    """Answers 503 with the class's Retry-After `busy` times, then 200; records when asked."""

    busy = 0
    status = 503
    retry_after = "1"
    times: list[float] = []
    auth: list[str | None] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("content-length", 0)))
        cls = type(self)
        cls.times.append(time.monotonic())
        cls.auth.append(self.headers.get("authorization"))
        if len(cls.times) <= cls.busy:
            body, status = b'{"message": "server overloaded"}', cls.status
        else:
            body, status = b'{"tokens": [1, 2, 3]}', 200
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        if status == 503:
            self.send_header("retry-after", cls.retry_after)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def busy_server() -> Iterator[tuple[str, type[Busy]]]:
    handler = type("BusyNow", (Busy,), {"times": [], "auth": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_remote_retries_503_honouring_retry_after(busy_server: tuple[str, type[Busy]]) -> None:
    url, handler = busy_server
    handler.busy = 2
    remote = po.Remote(url, api_key="k", retries=4, max_retry_wait=10)
    assert remote.tokenize("hello") == [1, 2, 3]
    t = handler.times
    assert len(t) == 3
    assert t[1] - t[0] >= 0.95 and t[2] - t[1] >= 0.95, "waited what Retry-After asked"
    assert handler.auth == ["Bearer k"] * 3

    # Busy for longer than the retries: BackendUnavailable, after retries + 1 attempts.
    handler.times.clear()
    handler.busy, handler.retry_after = 100, "0"
    with pytest.raises(po.BackendUnavailable, match="HTTP 503: server overloaded"):
        po.Remote(url, retries=2).tokenize("x")
    assert len(handler.times) == 3
    # A Retry-After beyond the wait budget: no sleeping past it, one attempt.
    handler.times.clear()
    handler.retry_after = "3600"
    t0 = time.monotonic()
    with pytest.raises(po.BackendUnavailable, match="gave up after 1 attempt"):
        po.Remote(url, retries=5, max_retry_wait=30).tokenize("x")
    assert len(handler.times) == 1 and time.monotonic() - t0 < 30
    # Scoring through a busy server: every item gets BackendUnavailable (the label tool stops on it).
    out = po.Remote(url, retries=0).score([po.LabelRequest((1, 2), (3,))])
    assert isinstance(out[0], po.BackendUnavailable)


# ---- --server on the tiny model ------------------------------------------------------------


MODEL_ARGS = ["--labels", "Yes,No", "--batch-size", "4", "--calibrate", "none", "--no-progress"]


def _tiny_lines() -> list[str]:
    lines = reviews(12)
    lines.append(json.dumps({"id": "long", "text": "x " * 1200}))  # line 13: over max_input_len
    return lines


def label_in_process(model: Path, folder: Path) -> list[dict]:
    """The tiny model's labels, in this process: what --server and --ray (tests/server/test_ray.py) must
    reproduce."""
    path = write_jsonl(folder / "local.jsonl", _tiny_lines())
    assert label_main([str(path), "--model", str(model), "--dtype", "fp32", *MODEL_ARGS]) == 0
    want = read_output(folder / "local.labeled.jsonl")
    assert len(want) == 12 and {r["label"] for r in want} <= {"Yes", "No"}
    return want


@pytest.fixture(scope="module")
def in_process_labels(tokenized_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return label_in_process(tokenized_llama, tmp_path_factory.mktemp("local"))


def assert_same_labels(got: list[dict], want: list[dict]) -> None:
    assert [r["line"] for r in got] == [r["line"] for r in want] == list(range(1, 13))
    for g, w in zip(got, want, strict=True):
        assert (g["key"], g["config"], g["label"], g["input"]) == (
            w["key"],
            w["config"],
            w["label"],
            w["input"],
        )
        assert g["probs"] == pytest.approx(w["probs"], abs=1e-4)


@pytest.mark.slow
def test_server_labels_as_in_process_and_resumes(
    tmp_path: Path, tokenized_llama: Path, in_process_labels: list[dict], capsys: pytest.CaptureFixture[str]
) -> None:
    proc = ServerProcess(
        [
            "--model-path",
            str(tokenized_llama),
            "--dtype",
            "fp32",
            "--max-input-len",
            "512",
            "--log-level",
            "warning",
        ]
    )
    proc.start()
    try:
        proc.wait_ready()
        path = write_jsonl(tmp_path / "remote.jsonl", _tiny_lines())
        args = [str(path), "--server", proc.url, *MODEL_ARGS]
        assert label_main([*args, "--max-rows", "5"]) == 0
        capsys.readouterr()
        assert label_main(args) == 0
        out, err = capsys.readouterr()
        assert "12 of 13 rows labeled (7 now, 5 from an earlier run), 1 bad" in out
        assert "bad row at line 13: not scored: " in err
        assert_same_labels(read_output(tmp_path / "remote.labeled.jsonl"), in_process_labels)
    finally:
        proc.stop()
    # The server is gone: a run with rows left stops (exit 1) and keeps every record.
    more = write_jsonl(
        tmp_path / "remote.jsonl", [*_tiny_lines(), json.dumps({"id": 99, "text": "one more"})]
    )
    before = read_output(tmp_path / "remote.labeled.jsonl")
    # (Its port may already serve a server another test started: a URL that nothing answers at.)
    with dead_url() as gone:
        assert label_main([str(more), "--server", gone, *MODEL_ARGS]) == 1
    assert read_output(tmp_path / "remote.labeled.jsonl") == before


@pytest.mark.parametrize("status", [502, 504])
def test_remote_retries_a_gateways_failure_but_not_a_500(
    busy_server: tuple[str, type[Busy]], status: int
) -> None:
    """A router that could not reach a worker (502) or timed out on it (504): the call, idempotent,
    is sent again. A 500 is a bug the same call meets again: one attempt, the error raised."""
    url, handler = busy_server
    handler.busy, handler.status = 2, status
    assert po.Remote(url, retries=3, max_retry_wait=10).tokenize("hello") == [1, 2, 3]
    assert len(handler.times) == 3
    handler.times.clear()
    handler.busy, handler.status = 1, 500
    with pytest.raises(po.BackendError, match="HTTP 500") as raised:
        po.Remote(url, retries=3).tokenize("x")
    assert not isinstance(raised.value, po.BackendUnavailable)
    assert len(handler.times) == 1
