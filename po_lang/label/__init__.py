"""`prefillonly label`: label a dataset (JSONL, CSV, Parquet) with a template or a `@po.classify`
function, resumably, in this process, on a running server (`--server`) or on Ray (`--ray`).

    prefillonly label reviews.jsonl --labels positive,negative \\
        --template 'Classify the sentiment of this review as {labels}.\\nReview: {text}'

From Python: `po_lang.label.main([...])` (the command line), or `run(Job(...))` for a `Summary`.
See `po_lang.label.store` for how finished rows are kept across kills, and `prefillonly label
--help` for the flags.
"""

from __future__ import annotations

from po_lang.label.cli import main
from po_lang.label.job import Job, RayOptions, Summary, run
from po_lang.label.source import BadRow, Row, UsageError, read_rows
from po_lang.label.task import Task, from_function, from_template

__all__ = [
    "BadRow",
    "Job",
    "RayOptions",
    "Row",
    "Summary",
    "Task",
    "UsageError",
    "from_function",
    "from_template",
    "main",
    "read_rows",
    "run",
]
