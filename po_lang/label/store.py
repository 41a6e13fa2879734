"""Where labels go, so that no finished row is ever lost, duplicated or silently thrown away.

- The records live in a JSONL file (the output itself when it is `.jsonl`, else
  `<output>.records.jsonl` beside a CSV / Parquet output, which is exported from it). One record
  per labeled row: `{"line", "key", "config", "label", "probs", "input"}`, `config` being the
  fingerprint of the labeling setup (labels, prompt, calibration).
- The records file is only ever replaced whole (a temporary file in the same folder, fsynced,
  then `os.replace`d, which is atomic), so it is always either the previous complete version or the
  new one. Progress in between goes to an append-only journal (`<records>.partial`), flushed and
  fsynced after every batch; a crash can only tear the journal's last line, which the next run
  drops (that one row is labeled again). Appending per batch keeps the cost linear in the rows.
- One run per output at a time (an advisory lock, released by the OS when a run is killed); files
  get the mode a plain `open` would (0666 less the umask).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from po_lang.label.source import Row, UsageError, file_format, import_parquet, to_json

RECORD_KEYS = frozenset({"line", "key", "config", "label", "probs", "input"})
EXPORTED_KEYS = ("line", "label", "probs", "input")  # what a CSV / Parquet output holds


@dataclass(frozen=True)
class Paths:
    output: Path  # what the user asked for (.jsonl, .csv or .parquet)
    records: Path  # the JSONL records: `output` itself, or beside it
    journal: Path  # append-only progress since the records were last written
    lock: Path

    @classmethod
    def of(cls, output: Path) -> Paths:
        records = (
            output if file_format(output) == "jsonl" else output.with_name(output.name + ".records.jsonl")
        )
        return cls(
            output,
            records,
            records.with_name(records.name + ".partial"),
            records.with_name(records.name + ".lock"),
        )


def load_records(path: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """Valid records of `path` by key (whatever their setup), and how many lines were dropped
    (torn by a crash, or not a record)."""
    records: dict[str, dict[str, Any]] = {}
    dropped = 0
    if not path.exists():
        return records, dropped
    with path.open("rb") as f:
        for raw in f:
            # A line without its newline was cut off mid-write: never trust it.
            rec = _parse_record(raw) if raw.endswith(b"\n") else None
            if rec is None:
                dropped += 1
                continue
            records[rec["key"]] = rec
    return records, dropped


def check_ours(paths: Paths) -> None:
    """Refuse (UsageError, nothing changed) an output this tool did not write: a records file
    with a complete line that is not a label record (a torn last line is a killed run's), or a
    CSV / Parquet output with no records file beside it. Only reads: the records file is replaced
    whole, so a run holding the lock never shows it half written."""
    if paths.output != paths.records and paths.output.exists() and not paths.records.exists():
        raise UsageError(
            f"{paths.output} exists and was not written by prefillonly label (there is no "
            f"{paths.records.name} beside it); nothing was changed. Choose another --output"
        )
    if not paths.records.exists():
        return
    with paths.records.open("rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.endswith(b"\n") and _parse_record(raw) is None:
                raise UsageError(
                    f"{paths.records} is not a records file of prefillonly label (line {n} is not a "
                    "label record); nothing was changed. Choose another --output"
                )


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
def exclusive(paths: Paths) -> Iterator[None]:
    """One run per output at a time: two runs on one file would fold each other's journal away."""
    with paths.lock.open("a") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"another run is labeling into {paths.output} (it holds {paths.lock}); wait for it"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def remove_stale_temporaries(paths: Paths) -> int:
    """Temporary files a killed run left behind (`write_atomic`'s, never renamed); call with the
    lock held, so none of them belongs to a live run."""
    stale = {p for f in (paths.output, paths.records) for p in f.parent.glob(f.name + ".*.tmp")}
    for p in stale:
        p.unlink(missing_ok=True)
    return len(stale)


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Replace `path` with what `write` writes, so that no reader or crash ever sees a partial
    file. The file gets the mode a plain `open` would: mkstemp's 0600 is for the temporary only."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
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


def append(journal: IO[str], lines: Sequence[str]) -> None:
    journal.writelines(lines)
    journal.flush()
    os.fsync(journal.fileno())


def record_line(rec: Mapping[str, Any]) -> str:
    return to_json(rec) + "\n"


def save(paths: Paths, rows: Sequence[Row], done: Mapping[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Write the records, in input order, atomically; then drop the journal. The journal goes
    only after the records file holds its records: a crash in between loses nothing (the next
    run reads both, and they agree). Nothing finished is dropped: a record whose row has since
    been edited (same position, other content) or removed stays, at its position, until the row
    there is labeled again."""
    current = {r.key for r in rows}
    relabeled = {r.line for r in rows if r.key in done}
    stale: dict[int, dict[str, Any]] = {}
    for rec in done.values():
        if rec["key"] not in current and rec["line"] not in relabeled:
            stale.setdefault(int(rec["line"]), rec)
    records: list[dict[str, Any]] = []
    for r in rows:
        kept = done.get(r.key) or stale.pop(r.line, None)
        if kept is not None:
            records.append(kept)
    records += [stale[line] for line in sorted(stale)]
    blob = "".join(record_line(rec) for rec in records).encode()
    write_atomic(paths.records, lambda f: _write_bytes(f, blob))
    paths.journal.unlink(missing_ok=True)
    return records


def _write_bytes(f: IO[bytes], blob: bytes) -> None:
    f.write(blob)


def export(paths: Paths, records: Sequence[Mapping[str, Any]]) -> None:
    """The CSV / Parquet output from the records (a JSONL output is the records file itself).
    CSV columns are the record flattened as pandas.json_normalize does (`probs.<label>`,
    `input.<field>`); Parquet keeps `probs` and `input` as structs."""
    fmt = file_format(paths.output)
    if fmt == "jsonl":
        return
    rows = [{k: rec[k] for k in EXPORTED_KEYS} for rec in records]
    if fmt == "csv":
        write_atomic(paths.output, lambda f: _write_csv(f, rows))
        return
    pq = import_parquet()
    import pyarrow as pa

    try:
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise UsageError(
            f"{paths.output}: the rows do not fit one Parquet schema ({e}); the labels are in {paths.records}"
        ) from None
    write_atomic(paths.output, lambda f: pq.write_table(table, f))


def _write_csv(f: IO[bytes], rows: Sequence[Mapping[str, Any]]) -> None:
    flat = [_flatten(r) for r in rows]
    columns: dict[str, None] = {}
    for r in flat:
        columns.update(dict.fromkeys(r))
    text = io.TextIOWrapper(f, encoding="utf-8", newline="", write_through=True)
    w = csv.DictWriter(text, fieldnames=list(columns))
    w.writeheader()
    w.writerows(flat)
    text.flush()
    text.detach()  # leave `f` open for write_atomic's fsync


def _flatten(rec: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in rec.items():
        if isinstance(v, dict) and k in ("probs", "input") and not prefix:
            out.update(_flatten(v, f"{k}."))
        elif isinstance(v, dict | list):
            out[prefix + k] = to_json(v)
        else:
            out[prefix + k] = v
    return out
