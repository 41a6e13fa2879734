"""`prefillonly label`: the command line of the labeling tool."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from po_lang.api import Calibrate
from po_lang.backends import Backend
from po_lang.errors import BackendError
from po_lang.label import job as jobs
from po_lang.label.source import UsageError, file_format
from po_lang.label.task import Task, file_hash, from_function, from_template, load_function

DEFAULT_TEMPLATE = "Classify this text as {labels}.\nText: {text}"
API_KEY_ENV = "PREFILLONLY_API_KEY"

DESCRIPTION = """\
Label every row of a JSONL, CSV or Parquet file with one of a few labels, resumably: each row's
prompt is built from a template with {field} placeholders (or by a @po.classify function), and
the model's probabilities of the labels are written out with the row.

  prefillonly label reviews.jsonl --labels positive,negative \\
      --template 'Classify the sentiment of this review as {labels}.\\nReview: {text}'
  prefillonly label data.csv -o labeled.parquet --function mymodule:will_engage
  prefillonly label big.jsonl --labels yes,no --server http://127.0.0.1:30000
  prefillonly label big.jsonl --labels yes,no --ray --concurrency 4 --cpus-per-engine 4

Kill it at any time and run the same command again: finished rows are kept (each batch is
fsynced to a journal) and only the rest are labeled. Records made with another setup (labels,
template, calibration) are never overwritten: the run refuses and asks for a new --output."""

EPILOG = """\
Output (by its suffix): .jsonl, one record per row in input order, {"line", "key", "config",
"label", "probs", "input"}; .csv, the record flattened (line, label, probs.<label>,
input.<field>); .parquet, probs and input as structs. A CSV / Parquet output keeps its records in
<output>.records.jsonl beside it (for resuming). Exit status: 0 done, 1 the backend is down or
failed (the labels so far are kept), 2 bad arguments or input, 130 interrupted."""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="prefillonly label",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("input", type=Path, help="a .jsonl, .csv or .parquet file")
    ap.add_argument(
        "-o",
        "--output",
        type=Path,
        default=None,
        help="where the labels go, .jsonl / .csv / .parquet (default: <input name>.labeled.jsonl beside it)",
    )
    what = ap.add_argument_group("what to ask")
    what.add_argument("--labels", default=None, help="comma-separated labels, e.g. positive,negative")
    what.add_argument(
        "--template",
        default=None,
        help="the prompt, {field} placeholders filled from each row and {labels} with the labels, "
        f"\\n a newline; the text before the first field is the shared (cached) prefix (default: {DEFAULT_TEMPLATE!r})",
    )
    what.add_argument(
        "--function",
        default=None,
        metavar="MODULE:NAME",
        help="a @po.classify function (module:name from the current folder, or file.py:name); its "
        "parameters bind to the row's fields by name, its labels are used",
    )
    what.add_argument(
        "--no-chat",
        action="store_true",
        help="send the template as plain text (default: as the user message of the model's chat template)",
    )
    what.add_argument(
        "--calibrate",
        default=None,
        metavar="MODE|FILE",
        help="'content-free' (default with a template), 'none', or a labeled file (the prompt's fields + "
        "the gold field) to fit per-label offsets on; a --function keeps its own unless this is given",
    )
    what.add_argument(
        "--gold",
        default=None,
        metavar="FIELD",
        help="the field holding the true label, for accuracy and a confusion matrix in the summary "
        "(default: 'gold' or 'label' when the rows have one)",
    )
    run = ap.add_argument_group("how to run")
    run.add_argument("--batch-size", type=int, default=32, help="rows per batch (and per journal flush)")
    run.add_argument("--max-rows", type=int, default=None, help="label at most this many new rows, then stop")
    run.add_argument("--server", default=None, metavar="URL", help="score on a running prefillonly server")
    run.add_argument(
        "--priority",
        type=_priority,
        default="low",
        help="with --server: the request priority of the job's calls (an integer, or 'low': just "
        "below the server's default in its order, so a server launched with "
        "--enable-priority-scheduling runs its online calls first; default: low)",
    )
    run.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"the server's API key (default: ${API_KEY_ENV})",
    )
    run.add_argument(
        "--model", default=None, help="a model folder or GGUF file (default: the embedded model)"
    )
    run.add_argument("--dtype", default=None, help="the engine's dtype, e.g. fp32 or bf16 (default: its own)")
    run.add_argument(
        "--quantization", default=None, help="the engine's quantization, e.g. w8a8_int8 (default: none)"
    )
    run.add_argument(
        "--ray",
        action="store_true",
        help="label on Ray Data (a local Ray, or the cluster in RAY_ADDRESS), one engine (or --server "
        "client) per actor; resume works as without it",
    )
    run.add_argument("--concurrency", type=int, default=1, help="with --ray: engines (Ray actors)")
    run.add_argument(
        "--cpus-per-engine",
        type=float,
        default=None,
        help="with --ray: CPUs each actor reserves (Ray's default: 1)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return ap


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.batch_size < 1:
        ap.error("--batch-size must be >= 1")
    if args.max_rows is not None and args.max_rows < 0:
        ap.error("--max-rows must be >= 0")
    if args.server and (args.model or args.dtype or args.quantization):
        ap.error(
            "--server scores on a server: --model, --dtype and --quantization are the server's to choose"
        )
    if args.function and (args.template or args.labels or args.no_chat):
        ap.error("--function builds its own prompt: --template, --labels and --no-chat are for templates")
    if not args.function and not args.labels:
        ap.error("--labels is required (or give a --function)")
    if args.concurrency < 1:
        ap.error("--concurrency must be >= 1")
    if not args.ray and (args.concurrency != 1 or args.cpus_per_engine is not None):
        ap.error("--concurrency and --cpus-per-engine need --ray")
    if args.ray and importlib.util.find_spec("ray") is None:  # before any model is loaded
        ap.error("--ray needs Ray Data: pip install 'prefillonly[ray]'")
    return args


def _priority(text: str) -> int | str:
    if text == "low":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an integer or 'low', got {text!r}") from None


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options = {"dtype": args.dtype, "quantization": args.quantization}
    return {k: v for k, v in options.items() if v}


def make_backend(args: argparse.Namespace) -> Backend:
    from po_lang.local import Local
    from po_lang.remote import Remote

    if args.server:
        return Remote(args.server, args.api_key, priority=args.priority)
    return Local(args.model or "embedded", **engine_options(args))


def ray_options(args: argparse.Namespace) -> jobs.RayOptions:
    """The actors' backends, built from the same flags as this process's own."""
    from po_lang.remote import Remote

    model: str | Callable[[], Backend] = (
        partial(Remote, args.server, args.api_key, priority=args.priority)
        if args.server
        else args.model or "embedded"
    )
    return jobs.RayOptions(
        model=model,
        engine_options={} if args.server else engine_options(args),
        concurrency=args.concurrency,
        cpus_per_engine=args.cpus_per_engine,
        progress=not args.no_progress,
    )


def make_task(args: argparse.Namespace, backend: Backend) -> tuple[Task, Path | None]:
    """The task, and the --calibrate file to fit on (None for a mode)."""
    cal_file: Path | None = None
    mode: str | None = args.calibrate
    if mode not in (None, "none", "content-free"):
        cal_file = Path(mode)
        if not cal_file.is_file():
            raise UsageError(f"--calibrate {cal_file}: no such file (or use 'none' / 'content-free')")
        mode = "none"  # fitted offsets replace the content-free probe
    if args.function:
        task = from_function(
            load_function(args.function), calibrate=mode, backend=backend, batch_size=args.batch_size
        )
    else:
        labels = tuple(x.strip() for x in args.labels.split(","))
        calibrate: Calibrate = None if mode == "none" else "content-free"
        task = from_template(
            (args.template or DEFAULT_TEMPLATE).replace("\\n", "\n"),
            labels,
            chat=not args.no_chat,
            calibrate=calibrate,
            backend=backend,
            batch_size=args.batch_size,
        )
    if cal_file is not None:
        task = dataclasses.replace(task, fitted_on=file_hash(cal_file))
    return task, cal_file


def default_output(path: Path) -> Path:
    return path.with_name(path.stem + ".labeled.jsonl")


def main(argv: Sequence[str] | None = None, *, backend: Backend | None = None) -> int:
    """`backend` replaces the one the flags name, in this process (tests pass a po.Fake); with
    --ray the actors still build theirs from --model / --server."""
    args = parse_args(argv)
    output = args.output or default_output(args.input)
    try:
        file_format(args.input)
        file_format(output)
        if output.resolve() == args.input.resolve():
            raise UsageError(f"--output {output} is the input; name another file")
        task, cal_file = make_task(args, backend or make_backend(args))
        summary = jobs.run(
            jobs.Job(
                input=args.input,
                output=output,
                task=task,
                batch_size=args.batch_size,
                max_rows=args.max_rows,
                gold=args.gold,
                progress=not args.no_progress,
                ray=ray_options(args) if args.ray else None,
                calibration_file=cal_file,
            )
        )
    except BackendError as e:
        print(
            f"error: {e}\nthe labels so far are kept in {output}: rerun the same command to resume",
            file=sys.stderr,
        )
        return 1
    except (UsageError, ValueError) as e:  # ValueError: po.LabelError, a calibration file that fails
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\ninterrupted: the labels so far are kept in {output}; rerun the same command to resume",
            file=sys.stderr,
        )
        return 130
    jobs.print_summary(summary)
    return 0
