"""Label every row of a JSONL or CSV file with a `@po.classify` classifier, resumably.

    python examples/label_data.py                          # the shipped sample: data/reviews.jsonl
    python examples/label_data.py my.csv --text-field review --labels positive,negative
    python examples/label_data.py --url http://127.0.0.1:30000   # score on a running server
    python examples/label_data.py big.jsonl --ray --concurrency 4 --cpus-per-engine 4   # on Ray Data

Writes `<name>.labeled.jsonl` next to the input: one record per labeled row, in input order,
`{"line", "key", "config", "label", "probs", "input"}`, and prints the label distribution.

Long jobs get interrupted, so:
- Resume: each row is keyed by its line number plus a hash of its content, and each record also
  carries a fingerprint of the labeling setup (labels, prompt, calibration). A rerun skips every
  row whose key and fingerprint already have a record; an edited row (same line, new content) or
  a changed setup is labeled again.
- Crash safety: the output file is only ever replaced whole (written to a temporary file in the
  same folder, fsynced, then `os.replace`d, which is atomic), so it is always either the previous
  complete version or the new one. Progress between those points goes to an append-only journal
  (`<output>.partial`), flushed and fsynced after every batch; a crash can only tear the journal's
  last line, which the next run detects (no newline, or not a valid record) and drops, relabeling
  that one row. Appending per batch keeps the cost linear in the rows, which rewriting the output
  after every batch would not be.
- Bad rows (invalid JSON, not an object, missing or empty text field, a prompt the model rejects)
  are reported with their line numbers and left out; the others go on.

With --ray the rows still to label go through `po_lang.ray.classify_dataset` (the `[ray]` extra):
a pool of --concurrency Ray actors, each loading its own engine (--model) or talking to --url, on
a local Ray or the cluster named by RAY_ADDRESS. Resume and crash safety are the same: rows already
in the output are skipped before the job starts, and records reach the journal batch by batch as
Ray hands them back, so a crash relabels only rows whose results had not come back yet. This
process still loads the model once to check the labels (and to fit --calibrate FILE).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

import po_lang as po

SAMPLE = Path(__file__).resolve().parent / "data" / "reviews.jsonl"
DEFAULT_INSTRUCTION = "Classify the sentiment of this review as {labels}."
# Bump when the prompt's wording changes, so old records are not reused for a different prompt.
PROMPT_VERSION = 1
RECORD_KEYS = frozenset({"line", "key", "config", "label", "probs", "input"})
MAX_REPORTED = 20  # bad rows printed one by one; the rest are counted
ROW_COLUMN = "__row"  # --ray: the row's position in this run's to-do list, to join results back


class UsageError(Exception):
    """Bad arguments or an unreadable input file: reported as one line, exit status 2."""


@dataclass(frozen=True)
class Row:
    line: int  # 1-based line of the input file where the row starts
    key: str  # f"{line}:{content hash}": identifies the row across runs
    text: str
    data: dict[str, Any]


@dataclass(frozen=True)
class BadRow:
    line: int
    reason: str


@dataclass(frozen=True)
class Labeled:
    row: Row
    label: str
    probs: Mapping[str, float]


@dataclass(frozen=True)
class Unscored:
    """A row the backend could not score (e.g. a prompt over the model's length)."""

    row: Row
    reason: str


Outcome = Labeled | Unscored
# Labels rows batch by batch; each yielded batch is journaled before the next one is asked for.
Labeler = Callable[[Sequence[Row]], Iterator[list[Outcome]]]


@dataclass(frozen=True)
class RayOptions:
    """--ray: what `po_lang.ray.classify_dataset` gets."""

    # What each actor loads: a model path or "embedded" (a po.Local with `engine_options`), or a
    # zero-argument backend factory (e.g. partial(po.Remote, url)).
    model: str | Callable[[], po.Backend]
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    concurrency: int = 1  # actors, one engine each
    cpus_per_engine: float | None = None  # Ray's default (1) when None; OMP threads follow it
    progress: bool = True


@dataclass(frozen=True)
class Setup:
    labels: tuple[str, ...]
    text_field: str
    instruction: str
    item_prefix: str
    calibrate: str  # "none", "content-free", or "fit:<sha of the labeled file>"

    @property
    def fingerprint(self) -> str:
        blob = json.dumps({**self.__dict__, "labels": list(self.labels), "version": PROMPT_VERSION})
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Summary:
    """What a run did; `main` prints it, tests inspect it."""

    output: Path
    total_rows: int  # good rows in the input
    labeled: int  # labeled in this run
    reused: int  # already labeled by an earlier run
    bad: tuple[BadRow, ...]
    distribution: dict[str, int]  # label -> rows, over every record in the output
    complete: bool  # every good row has a record
    accuracy: float | None = None  # against --gold-field, when given


# ---- reading the input --------------------------------------------------------------------------


def row_key(line: int, data: Mapping[str, Any]) -> str:
    content = json.dumps(data, sort_keys=True, ensure_ascii=False)
    return f"{line}:{hashlib.sha256(content.encode()).hexdigest()[:16]}"


def read_rows(path: Path, text_field: str) -> Iterator[Row | BadRow]:
    """Rows of a .jsonl or .csv file (by extension); a row that cannot be used is a BadRow."""
    if path.suffix.lower() == ".csv":
        yield from _read_csv(path, text_field)
    else:
        yield from _read_jsonl(path, text_field)


def _read_jsonl(path: Path, text_field: str) -> Iterator[Row | BadRow]:
    # Bytes, decoded per line: one line of bad UTF-8 is a bad row, not a failed file.
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                yield BadRow(line_no, f"not UTF-8 ({e.reason} at byte {e.start})")
                continue
            if not line.strip():
                continue  # blank lines (e.g. a trailing newline) are not rows
            try:
                data = json.loads(line.rstrip("\r\n"))
            except json.JSONDecodeError as e:
                yield BadRow(line_no, f"invalid JSON ({e.msg} at column {e.colno})")
                continue
            if not isinstance(data, dict):
                yield BadRow(line_no, f"expected a JSON object, got {type(data).__name__}")
                continue
            yield _row(line_no, data, text_field)


def _read_csv(path: Path, text_field: str) -> Iterator[Row | BadRow]:
    try:
        f = path.open(newline="", encoding="utf-8-sig")
        with f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise UsageError(f"{path}: the CSV file is empty (it needs a header row)")
            if text_field not in header:
                raise UsageError(f"{path}: no column {text_field!r} in the header {header}; use --text-field")
            prev = reader.line_num
            while True:
                start = prev + 1  # a quoted field may span lines: report where the row starts
                try:
                    values = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    prev = reader.line_num
                    yield BadRow(start, f"malformed CSV ({e})")
                    continue
                prev = reader.line_num
                if not values:
                    continue
                if len(values) != len(header):
                    yield BadRow(start, f"expected {len(header)} fields, got {len(values)}")
                    continue
                yield _row(start, dict(zip(header, values, strict=True)), text_field)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None


def _row(line: int, data: dict[str, Any], text_field: str) -> Row | BadRow:
    if text_field not in data:
        return BadRow(line, f"no field {text_field!r}")
    text = data[text_field]
    if not isinstance(text, str):
        return BadRow(line, f"field {text_field!r} is {type(text).__name__}, not text")
    if not text.strip():
        return BadRow(line, f"field {text_field!r} is empty")
    return Row(line, row_key(line, data), text, data)


# ---- earlier results ----------------------------------------------------------------------------


def output_paths(path: Path) -> tuple[Path, Path]:
    """(output, journal) next to the input."""
    out = path.with_name(path.stem + ".labeled.jsonl")
    return out, out.with_name(out.name + ".partial")


def load_records(path: Path, fingerprint: str) -> tuple[dict[str, dict[str, Any]], int]:
    """Valid records of `path` made with this setup, by key, and how many lines were dropped
    (torn, not a record, or from another setup)."""
    records: dict[str, dict[str, Any]] = {}
    dropped = 0
    if not path.exists():
        return records, dropped
    with path.open("rb") as f:
        for raw in f:
            # A line without its newline was cut off mid-write: never trust it.
            rec = _parse_record(raw) if raw.endswith(b"\n") else None
            if rec is None or rec["config"] != fingerprint:
                dropped += 1
                continue
            records[rec["key"]] = rec
    return records, dropped


def _parse_record(raw: bytes) -> dict[str, Any] | None:
    try:
        rec = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict) or not RECORD_KEYS <= rec.keys():
        return None
    if not isinstance(rec["key"], str) or not isinstance(rec["probs"], dict):
        return None
    return rec


@contextlib.contextmanager
def exclusive(out: Path) -> Iterator[None]:
    """One run per output at a time: two runs on one file would delete each other's journal.
    An advisory lock on `<output>.lock`, released by the OS even when the run is killed."""
    lock_path = out.with_name(out.name + ".lock")
    with lock_path.open("a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"another run is labeling into {out} (it holds {lock_path}); wait for it"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def remove_stale_temporaries(out: Path) -> int:
    """Temporary files a killed run left behind (`write_atomic`'s, never renamed); call with the
    lock held, so none of them belongs to a live run."""
    stale = list(out.parent.glob(out.name + ".*.tmp"))
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def write_atomic(path: Path, lines: Sequence[str]) -> None:
    """Replace `path` with `lines` so that no reader or crash ever sees a partial file. The file
    gets the mode a plain `open` would (0666 less the umask): mkstemp's 0600 is for the
    temporary only."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~_umask())
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _umask() -> int:
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return mask


def _fsync_dir(folder: Path) -> None:
    # Makes the rename itself durable on POSIX; not possible (nor needed) everywhere.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _append(journal: TextIO, lines: Sequence[str]) -> None:
    journal.writelines(lines)
    journal.flush()
    os.fsync(journal.fileno())


def make_record(labeled: Labeled, fingerprint: str) -> dict[str, Any]:
    return {
        "line": labeled.row.line,
        "key": labeled.row.key,
        "config": fingerprint,
        "label": labeled.label,
        "probs": {k: round(float(v), 6) for k, v in labeled.probs.items()},
        "input": labeled.row.data,
    }


def save(
    out: Path, journal: Path, rows: Sequence[Row], done: Mapping[str, dict[str, Any]]
) -> list[dict[str, Any]]:
    """Write the records of the current rows, in input order, atomically to `out`; then drop the
    journal. The journal goes only after the output holds its records: a crash in between loses
    nothing (the next run reads both, and they agree). Records of rows no longer in the input
    (edited or removed) are dropped here."""
    records = [done[r.key] for r in rows if r.key in done]
    write_atomic(out, [json.dumps(rec, ensure_ascii=False) + "\n" for rec in records])
    journal.unlink(missing_ok=True)
    return records


# ---- the classifier -----------------------------------------------------------------------------


def make_classifier(
    labels: Sequence[str],
    *,
    instruction: str,
    item_prefix: str,
    calibrate: str,
    backend: po.Backend,
    batch_size: int,
) -> po.Classifier:
    """A chat classifier whose instruction is the shared (cached) prefix; the label tokens follow
    the template's `assistant\\n`, so they carry no leading space."""

    @po.classify(
        labels=list(labels),
        chat=True,
        calibrate="content-free" if calibrate == "content-free" else None,
        backend=backend,
        batch_size=batch_size,
    )
    def label_row(text: str) -> po.Prompt:
        return po.shared(instruction + "\n") + item_prefix + text

    return label_row


def fit_calibration(fn: po.Classifier, path: Path, text_field: str, label_field: str) -> str:
    """Fit per-label offsets on a labeled file; returns its content hash (for the fingerprint)."""
    examples: list[tuple[tuple[str], str]] = []
    for item in read_rows(path, text_field):
        if isinstance(item, BadRow):
            continue
        gold = item.data.get(label_field)
        if gold in fn.labels:
            examples.append(((item.text,), gold))
    if not examples:
        raise UsageError(
            f"{path}: no row has a {text_field!r} text and a {label_field!r} field holding one of "
            f"{list(fn.labels)}, so there is nothing to calibrate on"
        )
    report = fn.calibrate(examples)
    print(
        f"calibrated on {report.n} labeled rows of {path.name}: accuracy {report.accuracy_before:.1%} -> "
        f"{report.accuracy_after:.1%} on them; offsets "
        + ", ".join(f"{k} {v:+.2f}" for k, v in report.offsets.items())
    )
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


# ---- the job ------------------------------------------------------------------------------------


def label_file(
    path: Path,
    fn: po.Classifier,
    setup: Setup,
    *,
    batch_size: int = 32,
    max_rows: int | None = None,
    gold_field: str | None = None,
    progress: bool = True,
    fresh: bool = False,
    ray: RayOptions | None = None,
) -> Summary:
    """Label the rows of `path` not labeled yet, in this process or (`ray`) on Ray Data."""
    out, journal_path = output_paths(path)
    if ray is None:
        labeler: Labeler = partial(label_in_process, fn, batch_size=batch_size)
    else:
        labeler = partial(label_on_ray, fn, batch_size=batch_size, options=ray)
    with exclusive(out):
        if fresh:
            out.unlink(missing_ok=True)
            journal_path.unlink(missing_ok=True)
        remove_stale_temporaries(out)
        return _label_locked(path, labeler, setup, max_rows, gold_field, progress)


def label_in_process(fn: po.Classifier, rows: Sequence[Row], *, batch_size: int) -> Iterator[list[Outcome]]:
    for a in range(0, len(rows), batch_size):
        batch = rows[a : a + batch_size]
        results = fn.map([(r.text,) for r in batch])
        _check_backend_alive(results)
        yield [
            Unscored(row, str(res.error))
            if isinstance(res, po.Failed)
            else Labeled(row, res.label, res.probs)
            for row, res in zip(batch, results, strict=True)
        ]


def label_on_ray(
    fn: po.Classifier, rows: Sequence[Row], *, batch_size: int, options: RayOptions
) -> Iterator[list[Outcome]]:
    """The rows through `classify_dataset`, results in the order Ray finishes them (each carries
    its position in `rows`, so order does not matter). A job that fails as a whole (an actor
    cannot load its model, the cluster goes away) is a BackendError: progress so far is kept."""
    if not rows:
        return  # an empty dataset has no schema for classify_dataset to match columns against
    import ray.data  # lazy: the [ray] extra
    import ray.exceptions

    from po_lang.ray import classify_dataset

    ray.data.DataContext.get_current().enable_progress_bars = options.progress
    ds = ray.data.from_items([{ROW_COLUMN: i, "text": r.text} for i, r in enumerate(rows)])
    out = classify_dataset(
        fn,
        ds,
        model=options.model,
        concurrency=options.concurrency,
        batch_size=batch_size,
        # Every row shares the one instruction prefix: sorting by it (a shuffle) would buy nothing.
        group_by_prefix=False,
        num_cpus=options.cpus_per_engine,
        **options.engine_options,
    )
    try:
        for batch in out.iter_batches(batch_size=batch_size, batch_format="pandas"):
            yield [_ray_outcome(rows[int(rec[ROW_COLUMN])], rec) for rec in batch.to_dict("records")]
    except ray.exceptions.RayError as e:
        raise po.BackendError(f"the Ray job failed: {type(e).__name__}: {e}") from e


def _ray_outcome(row: Row, rec: Mapping[str, Any]) -> Outcome:
    if isinstance(rec["error"], str):  # None (or NaN, through pandas) when the row was scored
        return Unscored(row, rec["error"])
    return Labeled(row, rec["label"], rec["probs"])


def _label_locked(
    path: Path,
    labeler: Labeler,
    setup: Setup,
    max_rows: int | None,
    gold_field: str | None,
    progress: bool,
) -> Summary:
    out, journal_path = output_paths(path)
    fp = setup.fingerprint
    rows: list[Row] = []
    bad: list[BadRow] = []
    for item in read_rows(path, setup.text_field):
        (rows if isinstance(item, Row) else bad).append(item)  # type: ignore[arg-type]

    # Earlier results: the last complete output, then the journal of the run after it. Folding
    # them into a fresh output first means this run's journal starts empty: its appends never
    # land after a torn line a crash left behind.
    done, dropped = load_records(out, fp)
    journaled, torn = load_records(journal_path, fp)
    done.update(journaled)
    if dropped or torn:
        print(
            f"ignored {dropped + torn} earlier record(s) that are torn or from another setup", file=sys.stderr
        )
    wanted = {r.key for r in rows}
    reused = len(wanted & done.keys())
    save(out, journal_path, rows, done)
    todo = [r for r in rows if r.key not in done]
    if max_rows is not None:
        todo = todo[:max_rows]

    labeled = 0
    bar = tqdm(total=len(rows), initial=reused, desc=path.name, unit="row", disable=not progress)
    try:
        with journal_path.open("a", encoding="utf-8") as journal:
            for batch in labeler(todo):
                lines = []
                for outcome in batch:
                    if isinstance(outcome, Unscored):
                        bad.append(BadRow(outcome.row.line, f"not scored: {outcome.reason}"))
                        continue
                    rec = make_record(outcome, fp)
                    lines.append(json.dumps(rec, ensure_ascii=False) + "\n")
                    done[outcome.row.key] = rec
                _append(journal, lines)
                labeled += len(lines)
                bar.update(len(batch))
    finally:
        bar.close()
        # Also on Ctrl-C or an error: fold what is done into the output.
        records = save(out, journal_path, rows, done)

    bad.sort(key=lambda b: b.line)
    dist = Counter(rec["label"] for rec in records)
    accuracy = None
    if gold_field is not None:
        scored = [rec for rec in records if rec["input"].get(gold_field) is not None]
        if scored:
            accuracy = sum(rec["label"] == rec["input"][gold_field] for rec in scored) / len(scored)
    return Summary(
        output=out,
        total_rows=len(rows),
        labeled=labeled,
        reused=reused,
        bad=tuple(bad),
        distribution=dict(dist.most_common()),
        complete=len(records) == len(rows),
        accuracy=accuracy,
    )


def _check_backend_alive(results: Sequence[po.Classification | po.Failed]) -> None:
    """A batch in which every row failed for the backend's sake (server down, model missing) is
    not a batch of bad rows: stop, keeping the progress so far, instead of marking every row bad."""
    errors = [r.error for r in results if isinstance(r, po.Failed)]
    if (
        len(results) > 1
        and len(errors) == len(results)
        and all(isinstance(e, po.BackendError) for e in errors)
    ):
        if len({str(e) for e in errors}) == 1:
            raise po.BackendError(f"the backend failed every row of a batch: {errors[0]}")


def print_summary(s: Summary) -> None:
    for b in s.bad[:MAX_REPORTED]:
        print(f"bad row at line {b.line}: {b.reason}", file=sys.stderr)
    if len(s.bad) > MAX_REPORTED:
        print(f"... and {len(s.bad) - MAX_REPORTED} more bad rows", file=sys.stderr)
    n = sum(s.distribution.values())
    print(
        f"{s.output}: {n} of {s.total_rows} rows labeled ({s.labeled} now, {s.reused} from an earlier run), "
        f"{len(s.bad)} bad"
    )
    for label, count in s.distribution.items():
        print(f"  {label:>12s}  {count:5d}  {count / n:6.1%}")
    if s.accuracy is not None:
        print(f"accuracy against the gold field: {s.accuracy:.1%}")
    if not s.complete:
        print("not every row is labeled yet: run the same command again to resume")


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "path", nargs="?", type=Path, default=SAMPLE, help="a .jsonl or .csv file (default: the sample)"
    )
    ap.add_argument("--text-field", default="text", help="the field (column) holding the text to label")
    ap.add_argument("--labels", default="positive,negative", help="comma-separated labels")
    ap.add_argument(
        "--instruction", default=DEFAULT_INSTRUCTION, help="the shared instruction; {labels} is filled in"
    )
    ap.add_argument("--item-prefix", default="Review: ", help="text before each row's text")
    ap.add_argument("--batch-size", type=int, default=32, help="rows per batch (and per journal flush)")
    ap.add_argument("--max-rows", type=int, default=None, help="label at most this many new rows, then stop")
    ap.add_argument(
        "--calibrate",
        default="content-free",
        help="'content-free' (default), 'none', or a labeled .jsonl/.csv file (text field + --label-field) "
        "to fit per-label offsets on",
    )
    ap.add_argument("--label-field", default="label", help="the gold label field of a --calibrate file")
    ap.add_argument("--gold-field", default=None, help="report accuracy against this field of the input")
    ap.add_argument("--fresh", action="store_true", help="discard earlier results and label everything again")
    ap.add_argument("--url", default=None, help="score on a running server instead of the embedded model")
    ap.add_argument("--model", default=None, help="a model folder or GGUF file (default: the embedded model)")
    ap.add_argument("--dtype", default=None, help="the engine's dtype, e.g. fp32 or bf16 (default: its own)")
    ap.add_argument(
        "--ray",
        action="store_true",
        help="label on Ray Data (po_lang.ray.classify_dataset): a local Ray, or the cluster in RAY_ADDRESS; "
        "resume works as without it (labeled rows are skipped, results are journaled as they come back)",
    )
    ap.add_argument("--concurrency", type=int, default=1, help="with --ray: engines (Ray actors)")
    ap.add_argument(
        "--cpus-per-engine",
        type=float,
        default=None,
        help="with --ray: CPUs each actor reserves (Ray's default: 1)",
    )
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    if args.max_rows is not None and args.max_rows < 0:
        ap.error("--max-rows must be >= 0")
    if args.url and (args.model or args.dtype):
        ap.error("--url scores on a server: --model and --dtype are the server's to choose")
    if args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if not args.ray and (args.concurrency != 1 or args.cpus_per_engine is not None):
        ap.error("--concurrency and --cpus-per-engine need --ray")
    if args.ray and importlib.util.find_spec("ray") is None:  # before any model is loaded
        ap.error("--ray needs Ray Data: pip install '.[ray]' (the [ray] extra)")
    return args


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype} if args.dtype else {}


def ray_options(args: argparse.Namespace) -> RayOptions:
    """The actors' backends, built from the same flags as this process's own."""
    model: str | Callable[[], po.Backend] = (
        partial(po.Remote, args.url) if args.url else args.model or "embedded"
    )
    return RayOptions(
        model=model,
        engine_options={} if args.url else engine_options(args),
        concurrency=args.concurrency,
        cpus_per_engine=args.cpus_per_engine,
        progress=not args.no_progress,
    )


def main(argv: Sequence[str] | None = None, *, backend: po.Backend | None = None) -> int:
    """`backend` replaces the one the flags name, in this process (tests pass a po.Fake); with
    --ray the actors still build theirs from --model / --url."""
    args = parse_args(argv)
    labels = tuple(x.strip() for x in args.labels.split(","))
    try:
        if not args.path.is_file():
            raise UsageError(f"{args.path}: no such file")
        if backend is None:
            model = args.model or "embedded"
            backend = po.Remote(args.url) if args.url else po.Local(model, **engine_options(args))
        instruction = args.instruction.replace("{labels}", " or ".join(labels))
        calibrate = args.calibrate
        if calibrate not in ("none", "content-free"):
            calibrate = "fit"
        fn = make_classifier(
            labels,
            instruction=instruction,
            item_prefix=args.item_prefix,
            calibrate=calibrate,
            backend=backend,
            batch_size=args.batch_size,
        )
        # Compile once up front: labels that cannot be told apart after this prompt fail here with
        # the compiler's message, not as one bad row per input row. (Also loads the model.)
        try:
            fn.compile("probe")
        except po.PoLangError:
            raise
        except Exception as e:  # the model cannot be loaded, the server cannot be reached, ...
            raise po.BackendError(f"cannot use the backend {backend!r}: {type(e).__name__}: {e}") from e
        if calibrate == "fit":
            cal_path = Path(args.calibrate)
            if not cal_path.is_file():
                raise UsageError(f"--calibrate {cal_path}: no such file (or use 'none' / 'content-free')")
            calibrate = "fit:" + fit_calibration(fn, cal_path, args.text_field, args.label_field)
        setup = Setup(labels, args.text_field, instruction, args.item_prefix, calibrate)
        summary = label_file(
            args.path,
            fn,
            setup,
            batch_size=args.batch_size,
            max_rows=args.max_rows,
            gold_field=args.gold_field,
            progress=not args.no_progress,
            fresh=args.fresh,
            ray=ray_options(args) if args.ray else None,
        )
    except po.BackendError as e:
        print(f"error: {e}\nprogress is saved: rerun the same command to resume", file=sys.stderr)
        return 1
    except (UsageError, ValueError) as e:  # ValueError: po.LabelError, a calibration file that fails
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: progress is saved, rerun the same command to resume", file=sys.stderr)
        return 130
    print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
