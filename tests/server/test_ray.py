"""The tests of the session's local Ray (2 CPUs), in one file so one test process starts Ray once:
`po_lang.ray.classify_dataset` gives the same labels as the in-process `.map`, every row out (errors
as rows), rows that share a prefix grouped so the cache serves them; `prefillonly label --ray`
labels as in process, resumes, and stops on a dead server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import po_lang as po
from po_lang.label import main as label_main
from tests.deps import require
from tests.lang.test_label import (
    MODEL_ARGS,
    _tiny_lines,
    assert_same_labels,
    label_in_process,
    n_requests,
    read_output,
    reviews,
    write_jsonl,
)
from tests.server_utils import dead_url

ray = require("ray", "pip install 'ray[data]'")
from po_lang.ray import classify_dataset, hit_rate  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray cluster

PROFILES = ["likes cats and dogs", "likes tax news", "likes a cat video"]
POSTS = ["a cat video", "a dog", "tax news", "cats and dogs"]


def make_fn() -> po.Classifier:
    @po.classify(labels=["Yes", "No"])
    def engage(profile: str, post: str) -> po.Prompt:
        return po.shared(f"User profile:\n{profile}\n") + f"Post: {post}\nWill the user engage? Answer:"

    return engage


def test_classify_dataset_equals_map(local_ray: None, tokenized_llama: Path) -> None:
    fn = make_fn()
    rows = [
        {"id": i, "profile": p, "post": q} for i, (p, q) in enumerate((p, q) for q in POSTS for p in PROFILES)
    ]
    rows.append({"id": len(rows), "profile": "x " * 400, "post": "too long"})  # over max_input_len
    ds = ray.data.from_items(rows)
    lazy = classify_dataset(fn, ds, model=str(tokenized_llama), dtype="fp32", max_input_len=128, batch_size=4)
    out = lazy.materialize()  # run once: each materialize() of the lazy dataset would run it again
    got = {r["id"]: r for r in out.take_all()}
    assert sorted(got) == [r["id"] for r in rows]  # no row dropped
    with po.Local(str(tokenized_llama), dtype="fp32", max_input_len=128) as local, po.using(local):
        want = fn.map([(r["profile"], r["post"]) for r in rows])
    for r, w in zip(rows, want, strict=True):
        g: dict[str, Any] = got[r["id"]]
        if isinstance(w, po.Failed):
            assert g["error"] and g["label"] is None
            continue
        assert g["error"] is None and g["label"] == w.label
        assert g["probs"]["Yes"] == pytest.approx(w.probs["Yes"], abs=1e-5)
    # Grouped by profile: all but the first row of each profile read it from the cache.
    assert hit_rate(out) > 0.3


@pytest.fixture(scope="module")
def in_process_labels(tokenized_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return label_in_process(tokenized_llama, tmp_path_factory.mktemp("local"))


@pytest.mark.slow
def test_ray_labels_as_in_process_resumes_and_stops_on_a_dead_server(
    tmp_path: Path,
    tokenized_llama: Path,
    in_process_labels: list[dict],
    local_ray: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # This process's backend only checks the labels: a Fake that never scores a row here, so every
    # record below was computed by the Ray actors (on the tiny model, from --model).
    driver = po.Fake(seed=12)
    on_ray = write_jsonl(tmp_path / "ray.jsonl", _tiny_lines())
    model = ["--model", str(tokenized_llama), "--dtype", "fp32"]
    ray_args = [str(on_ray), *model, *MODEL_ARGS, "--ray"]
    # The first 5 rows on one actor (each actor loads its own engine); the rest, resumed, on two,
    # whose results come back in the order Ray finishes them.
    assert label_main([*ray_args, "--max-rows", "5"], backend=driver) == 0
    assert len(read_output(tmp_path / "ray.labeled.jsonl")) == 5
    capsys.readouterr()
    # Resumes: the 5 are not labeled again.
    assert label_main([*ray_args, "--concurrency", "2"], backend=driver) == 0
    out, err = capsys.readouterr()
    assert "12 of 13 rows labeled (7 now, 5 from an earlier run), 1 bad" in out
    assert "bad row at line 13: not scored: " in err
    assert n_requests(driver) == 0
    assert_same_labels(read_output(tmp_path / "ray.labeled.jsonl"), in_process_labels)

    # Actors whose server cannot be reached: the job stops (exit 1), no row becomes a bad row,
    # the records stay.
    fresh = write_jsonl(tmp_path / "dead.jsonl", reviews(6))
    with dead_url() as dead:
        assert label_main([str(fresh), "--server", dead, *MODEL_ARGS, "--ray"], backend=driver) == 1
    err = capsys.readouterr().err
    assert "bad row" not in err and "BackendUnavailable" in err
    assert read_output(tmp_path / "dead.labeled.jsonl") == []
