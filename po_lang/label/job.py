"""The labeling job: rows not labeled yet, batch by batch, in this process or on Ray Data, each
batch journaled before the next is asked for; a summary at the end."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from po_lang.backends import Backend
from po_lang.errors import BackendError, BackendUnavailable, PoLangError
from po_lang.label import store
from po_lang.label.source import BadRow, Row, UsageError, read_rows
from po_lang.label.task import Task
from po_lang.results import Classification, Failed

MAX_REPORTED = 20  # bad rows printed one by one; the rest are counted
ROW_COLUMN = "__po_row"  # --ray: the row's position in this run's to-do list, to join results back
GOLD_FIELDS = ("gold", "label")  # looked for when no gold field is named
PROBE_ROWS = 100  # rows tried for one whose prompt builds, to check the backend with


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
    backend_error: bool  # the backend's own error (as opposed to the row's prompt failing to build)


Outcome = Labeled | Unscored
# Labels rows batch by batch; each yielded batch is journaled before the next one is asked for.
Labeler = Callable[[Sequence[Row]], Iterator[list[Outcome]]]


@dataclass(frozen=True)
class RayOptions:
    """--ray: what `po_lang.ray.classify_dataset` gets."""

    # What each actor loads: a model path or "embedded" (a po.Local with `engine_options`), or a
    # zero-argument backend factory (e.g. partial(po.Remote, url)).
    model: str | Callable[[], Backend]
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    concurrency: int = 1  # actors, one engine each
    cpus_per_engine: float | None = None  # Ray's default (1) when None; OMP threads follow it
    progress: bool = True


@dataclass(frozen=True)
class GoldReport:
    field: str
    scored: int  # rows whose gold value is one of the labels
    accuracy: float
    # confusion[gold][predicted] = rows
    confusion: dict[str, dict[str, int]]


@dataclass(frozen=True)
class Summary:
    """What a run did; `print_summary` prints it, tests inspect it."""

    output: Path
    total_rows: int  # good rows in the input
    labeled: int  # labeled in this run
    reused: int  # already labeled by an earlier run
    bad: tuple[BadRow, ...]
    distribution: dict[str, int]  # label -> rows, over the input's rows that have a record
    complete: bool  # every good row has a record
    gold: GoldReport | None = None

    @property
    def accuracy(self) -> float | None:
        return None if self.gold is None else self.gold.accuracy


# ---- labelers -----------------------------------------------------------------------------------


def label_in_process(task: Task, rows: Sequence[Row], *, batch_size: int) -> Iterator[list[Outcome]]:
    for a in range(0, len(rows), batch_size):
        batch = rows[a : a + batch_size]
        results = task.classifier.map([task.kwargs(r.data) for r in batch])
        yield check_backend_alive([_outcome(row, res) for row, res in zip(batch, results, strict=True)])


def _outcome(row: Row, res: Classification | Failed) -> Outcome:
    if isinstance(res, Failed):
        if isinstance(res.error, BackendUnavailable):
            raise res.error  # the backend is down, not this row bad
        return Unscored(row, str(res.error), isinstance(res.error, BackendError))
    return Labeled(row, res.label, res.probs)


def check_backend_alive(batch: list[Outcome]) -> list[Outcome]:
    """A batch in which every row failed with one and the same backend error (a server that
    answers every request with an error, a model gone) is not a batch of bad rows: stop, keeping
    the progress so far, instead of marking every row bad."""
    reasons = {o.reason for o in batch if isinstance(o, Unscored) and o.backend_error}
    if len(batch) > 1 and len(reasons) == 1 and all(isinstance(o, Unscored) for o in batch):
        raise BackendError(f"the backend failed every row of a batch: {reasons.pop()}")
    return batch


def label_on_ray(
    task: Task, rows: Sequence[Row], *, batch_size: int, options: RayOptions
) -> Iterator[list[Outcome]]:
    """The rows through `classify_dataset`, results in the order Ray finishes them (each carries
    its position in `rows`, so order does not matter). A job that fails as a whole (an actor
    cannot load its model or reach its server, the cluster goes away) is a BackendError: the
    progress so far is kept."""
    if not rows:
        return  # an empty dataset has no schema for classify_dataset to match columns against
    import ray.cloudpickle
    import ray.data  # lazy: the [ray] extra
    import ray.exceptions

    from po_lang.ray import classify_dataset

    module = sys.modules.get(task.classifier.__module__)
    if module is not None and module.__name__.startswith("po_label_"):
        # A --function loaded from a file path: the actors cannot import it, so ship it whole.
        ray.cloudpickle.register_pickle_by_value(module)
    ray.data.DataContext.get_current().enable_progress_bars = options.progress
    ds = ray.data.from_items([{ROW_COLUMN: i, **task.kwargs(r.data)} for i, r in enumerate(rows)])
    try:
        out = classify_dataset(
            task.classifier,
            ds,
            model=options.model,
            concurrency=options.concurrency,
            batch_size=batch_size,
            # Rows of a template share its one instruction prefix: sorting by it (a shuffle) buys nothing.
            group_by_prefix=task.params is None or task.identity.startswith("function:"),
            num_cpus=options.cpus_per_engine,
            **options.engine_options,
        )
    except ValueError as e:  # a column clash or a parameter without a field
        raise UsageError(f"--ray: {e}") from None
    try:
        for batch in out.iter_batches(batch_size=batch_size, batch_format="pandas"):
            records = batch.to_dict("records")  # type: ignore[union-attr]
            outcomes = [_ray_outcome(rows[int(rec[ROW_COLUMN])], rec) for rec in records]
            yield check_backend_alive(outcomes)
    except ray.exceptions.RayError as e:
        raise BackendError(f"the Ray job failed: {type(e).__name__}: {e}") from e


def _ray_outcome(row: Row, rec: Mapping[str, Any]) -> Outcome:
    err = rec["error"]
    if isinstance(err, str):  # None (or NaN, through pandas) when the row was scored
        return Unscored(row, err, err.startswith(("BackendError:", "BackendUnavailable:")))
    return Labeled(row, rec["label"], rec["probs"])


# ---- the job ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    input: Path
    output: Path
    task: Task
    batch_size: int = 32
    max_rows: int | None = None
    gold: str | None = None  # the gold-label field; None: "gold" or "label" if the rows have one
    progress: bool = True
    ray: RayOptions | None = None
    calibration_file: Path | None = None  # fit per-label offsets on it before labeling


def run(job: Job) -> Summary:
    """Label the rows of `job.input` that have no record yet. Finished records are never thrown
    away: records made with another setup make the run refuse (UsageError) before anything is
    written, and a record whose row was edited since stays until that row is labeled again."""
    task = job.task
    paths = store.Paths.of(job.output)
    rows: list[Row] = []
    bad: list[BadRow] = []
    for item in read_rows(job.input, task.required, text=task.text_fields):
        (rows if isinstance(item, Row) else bad).append(item)  # type: ignore[arg-type]
    store.check_ours(paths)  # before the lock file, which would be left beside a file not ours
    with store.exclusive(paths):
        store.remove_stale_temporaries(paths)
        done, dropped = store.load_records(paths.records)
        journaled, torn = store.load_records(paths.journal)
        done.update(journaled)
        fp = task.fingerprint
        other = Counter(rec["config"] for rec in done.values() if rec["config"] != fp)
        if other:
            raise UsageError(
                f"{paths.records} holds {sum(other.values())} record(s) labeled with another setup "
                "(other labels, template, function or calibration); nothing was changed. Label into "
                "a new file with --output PATH, or rerun with the earlier setup to resume"
            )
        if dropped or torn:
            print(f"ignored {dropped + torn} torn record(s) a killed run left behind", file=sys.stderr)
        todo = [r for r in rows if r.key not in done]
        if job.max_rows is not None:
            todo = todo[: job.max_rows]
        if todo:
            task = _prepare(task, todo, job)
        reused = sum(r.key in done for r in rows)
        labeled = _label(job, task, paths, rows, todo, done, reused, bad)
    bad.sort(key=lambda b: b.line)
    current = [done[r.key] for r in rows if r.key in done]
    dist = Counter(rec["label"] for rec in current)
    return Summary(
        output=paths.output,
        total_rows=len(rows),
        labeled=labeled,
        reused=reused,
        bad=tuple(bad),
        distribution=dict(dist.most_common()),
        complete=len(current) == len(rows),
        gold=gold_report(current, task.labels, job.gold),
    )


def _prepare(task: Task, todo: Sequence[Row], job: Job) -> Task:
    """Before any row: check the backend answers and the labels compile after this prompt (one
    clear error instead of one bad row per input row), then fit --calibrate FILE's offsets."""
    fn = task.classifier
    for row in todo[:PROBE_ROWS]:
        kwargs = task.kwargs(row.data)
        try:
            fn.prompt(**kwargs)
        except Exception:
            continue  # this row's prompt cannot be built: it is reported bad when labeled
        try:
            fn.compile(**kwargs)  # tokenizes: loads the model / reaches the server
        except PoLangError:  # LabelError (labels that cannot be told apart), BackendError (down)
            raise
        except Exception as e:  # the model cannot be loaded, ...
            raise BackendError(f"cannot use the backend {fn.backend!r}: {type(e).__name__}: {e}") from e
        break
    if job.calibration_file is not None:
        examples = calibration_examples(job.calibration_file, task, job.gold)
        task.fit_calibration(examples, job.calibration_file)
    return task


def calibration_examples(path: Path, task: Task, gold: str | None) -> list[tuple[dict[str, Any], str]]:
    """(row, gold label) pairs of a labeled file, for `Classifier.calibrate`."""
    rows = [r for r in read_rows(path, task.required, text=task.text_fields) if isinstance(r, Row)]
    name = gold or _find_gold([r.data for r in rows], task.labels)
    examples = [(r.data, r.data[name]) for r in rows if name and r.data.get(name) in task.labels]
    if not examples:
        raise UsageError(
            f"--calibrate {path}: no row has the prompt's fields {list(task.required)} and a gold field "
            f"({gold or ' or '.join(GOLD_FIELDS)}) holding one of {list(task.labels)}; nothing to calibrate on"
        )
    return examples


def _label(
    job: Job,
    task: Task,
    paths: store.Paths,
    rows: Sequence[Row],
    todo: Sequence[Row],
    done: dict[str, dict[str, Any]],
    reused: int,
    bad: list[BadRow],
) -> int:
    """Label `todo`, journaling each batch; whatever happens (Ctrl-C, a backend that goes down),
    the records so far are folded into the records file and exported."""
    labeler: Labeler
    if job.ray is None:
        labeler = partial(label_in_process, task, batch_size=job.batch_size)
    else:
        labeler = partial(label_on_ray, task, batch_size=job.batch_size, options=job.ray)
    fp = task.fingerprint
    # Fold the previous run's journal into the records first: this run's journal starts empty,
    # so its appends never land after a line a crash tore.
    store.save(paths, rows, done)
    labeled = 0
    bar = tqdm(
        total=len(rows),
        initial=reused,
        desc=job.input.name,
        unit="row",
        disable=not job.progress,
        smoothing=0.1,
    )
    try:
        with paths.journal.open("a", encoding="utf-8") as journal:
            for batch in labeler(todo):
                lines = []
                for outcome in batch:
                    if isinstance(outcome, Unscored):
                        bad.append(BadRow(outcome.row.line, f"not scored: {outcome.reason}"))
                        continue
                    rec = make_record(outcome, fp)
                    lines.append(store.record_line(rec))
                    done[outcome.row.key] = rec
                store.append(journal, lines)
                labeled += len(lines)
                bar.update(len(batch))
    finally:
        bar.close()
        records = store.save(paths, rows, done)
        store.export(paths, records)
    return labeled


def make_record(labeled: Labeled, fingerprint: str) -> dict[str, Any]:
    return {
        "line": labeled.row.line,
        "key": labeled.row.key,
        "config": fingerprint,
        "label": labeled.label,
        "probs": {k: round(float(v), 6) for k, v in labeled.probs.items()},
        "input": labeled.row.data,
    }


# ---- the summary --------------------------------------------------------------------------------


def _find_gold(inputs: Sequence[Mapping[str, Any]], labels: Sequence[str]) -> str | None:
    """The first of GOLD_FIELDS that some row fills with one of the labels."""
    for name in GOLD_FIELDS:
        if any(d.get(name) in labels for d in inputs):
            return name
    return None


def gold_report(
    records: Sequence[Mapping[str, Any]], labels: Sequence[str], gold: str | None
) -> GoldReport | None:
    inputs = [rec["input"] for rec in records]
    name = gold or _find_gold(inputs, labels)
    if name is None:
        return None
    scored = [(rec["input"].get(name), rec["label"]) for rec in records if rec["input"].get(name) in labels]
    if not scored:
        return GoldReport(name, 0, float("nan"), {})
    confusion = {g: dict.fromkeys(labels, 0) for g in labels}
    for g, p in scored:
        confusion[g][p] += 1
    return GoldReport(name, len(scored), sum(g == p for g, p in scored) / len(scored), confusion)


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
    g = s.gold
    if g is not None:
        if not g.scored:
            print(f"gold field {g.field!r}: no labeled row holds one of the labels")
        else:
            print(f"accuracy against the gold field {g.field!r}: {g.accuracy:.1%} of {g.scored} rows")
            labels = list(g.confusion)
            width = max(8, *(len(x) for x in labels))
            print("confusion (rows: gold, columns: predicted)")
            print(" " * (width + 2) + "".join(f"{p:>{width + 2}s}" for p in labels))
            for gl in labels:
                print(f"  {gl:>{width}s}" + "".join(f"{g.confusion[gl][p]:>{width + 2}d}" for p in labels))
    if not s.complete:
        print("not every row is labeled yet: run the same command again to resume")
