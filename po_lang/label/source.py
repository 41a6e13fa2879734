"""Reading the rows to label: JSONL, CSV or Parquet (by the file's suffix).

Every row gets a 1-based position (the line of a JSONL/CSV file where it starts, the row number
of a Parquet file) and a key, position plus a hash of its content, that identifies it across runs.
A row that cannot be used (bad JSON, a missing or empty field the prompt needs) is a `BadRow`
with the reason; the others go on.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet"}
# Values a prompt field may hold: text, or a number / boolean (rendered as text).
SCALARS = (str, int, float, bool)


class UsageError(Exception):
    """Bad arguments, an unreadable input, or an output that would lose work: one line, exit 2."""


@dataclass(frozen=True)
class Row:
    line: int  # 1-based line (JSONL, CSV: where the row starts) or row number (Parquet)
    key: str  # f"{line}:{content hash}": identifies the row across runs
    data: dict[str, Any]


@dataclass(frozen=True)
class BadRow:
    line: int
    reason: str


def file_format(path: Path) -> str:
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise UsageError(f"{path}: unknown format {path.suffix!r}; use one of {sorted(set(FORMATS))}")
    return fmt


def to_json(data: Any) -> str:
    """JSON of a row or record; values JSON lacks (dates, decimals, bytes from Parquet) as text."""
    return json.dumps(data, ensure_ascii=False, default=str)


def row_key(line: int, data: Mapping[str, Any]) -> str:
    content = json.dumps(data, sort_keys=True, ensure_ascii=False, default=str)
    return f"{line}:{hashlib.sha256(content.encode()).hexdigest()[:16]}"


def read_rows(path: Path, fields: Sequence[str], *, text: bool = True) -> Iterator[Row | BadRow]:
    """The rows of `path`; `fields` are those every row needs (what the prompt reads), holding
    non-empty text or a number when `text` (a template's fields; a function's take any value)."""
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    fmt = file_format(path)
    if fmt == "csv":
        yield from _read_csv(path, fields, text)
    elif fmt == "parquet":
        yield from _read_parquet(path, fields, text)
    else:
        yield from _read_jsonl(path, fields, text)


def _read_jsonl(path: Path, fields: Sequence[str], text: bool) -> Iterator[Row | BadRow]:
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
            yield make_row(line_no, data, fields, text)


def _check_columns(path: Path, columns: Sequence[str], fields: Sequence[str]) -> None:
    missing = [f for f in fields if f not in columns]
    if missing:
        raise UsageError(
            f"{path}: no column {missing[0]!r} (the prompt reads it); the columns are {list(columns)}"
        )


def _read_csv(path: Path, fields: Sequence[str], text: bool) -> Iterator[Row | BadRow]:
    try:
        with path.open(newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                raise UsageError(f"{path}: the CSV file is empty (it needs a header row)")
            _check_columns(path, header, fields)
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
                yield make_row(start, dict(zip(header, values, strict=True)), fields, text)
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 ({e.reason} at byte {e.start})") from None


def _read_parquet(path: Path, fields: Sequence[str], text: bool) -> Iterator[Row | BadRow]:
    pq = import_parquet()
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid & co: not a Parquet file
        raise UsageError(f"{path}: cannot read it as Parquet ({e})") from None
    _check_columns(path, pf.schema_arrow.names, fields)
    n = 0
    for batch in pf.iter_batches():
        for data in batch.to_pylist():
            n += 1
            yield make_row(n, data, fields, text)


def import_parquet() -> Any:
    try:
        import pyarrow.parquet as pq  # lazy: the [parquet] extra
    except ImportError:
        raise UsageError("Parquet needs pyarrow: pip install 'prefillonly[parquet]'") from None
    return pq


def make_row(line: int, data: dict[str, Any], fields: Sequence[str], text: bool = True) -> Row | BadRow:
    for name in fields:
        if name not in data or data[name] is None:
            return BadRow(line, f"no field {name!r}")
        value = data[name]
        if not text:
            continue
        if not isinstance(value, SCALARS):
            return BadRow(line, f"field {name!r} is {type(value).__name__}, not text")
        if isinstance(value, str) and not value.strip():
            return BadRow(line, f"field {name!r} is empty")
    return Row(line, row_key(line, data), data)
