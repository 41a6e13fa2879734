"""`po_lang.ray.classify_dataset` on a local Ray (2 CPUs): the same labels as the in-process
`.map`, every row out (errors as rows), rows that share a prefix grouped so the cache serves them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import po_lang as po
from tests.deps import require

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
    out = classify_dataset(fn, ds, model=str(tokenized_llama), dtype="fp32", max_input_len=128, batch_size=4)
    got = {r["id"]: r for r in out.materialize().take_all()}
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
    assert hit_rate(out.materialize()) > 0.3
