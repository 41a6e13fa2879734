"""po_lang on the embedded SmolLM2-135M-Instruct (fp32): a sanity check of accuracy on a small
labeled sentiment set shipped in tests/data, before and after calibration.

Measured on this set (60 short reviews, 30 positive / 30 negative, interleaved) with the chat
prompt "Classify the sentiment of this review as positive or negative.\\nReview: ..." and labels
positive/negative (no leading space after the template's "assistant\\n"), fp32 on CPU:
- raw accuracy 0.700 (the model says "negative" too often: 12/60 predicted positive);
- content-free calibration: 0.867 (one "N/A" probe for the shared prefix);
- fitted offsets (`fn.calibrate`) on the first 20 rows, evaluated on the other 40: 0.975
  (raw on those 40: 0.700);
- ranking AUC of P(positive): 1.000.
The thresholds below sit a few errors under those numbers: a sanity check, not a benchmark.
About 30 s with the model load on one thread of a busy 2-core CPU.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

import po_lang as po
from po_backend import Engine
from po_lang import demo
from po_lang.calibration import accuracy, softmax

DATA = Path(__file__).resolve().parents[1] / "data" / "sentiment.jsonl"
LABELS = ["positive", "negative"]
INSTRUCTION = "Classify the sentiment of this review as positive or negative.\n"
N_FIT = 20  # the held-out split the fitted offsets are learned on (balanced: rows alternate)

pytestmark = pytest.mark.embedded


@pytest.fixture(scope="module")
def backend() -> po.Local:
    # The demo's settings (test_demo_runs; po.Local("embedded") on an AVX2-only CPU): the start-up
    # memory and JCT profiles they need are measured once per session for all of them.
    return po.Local.from_engine(Engine.from_pretrained("embedded", dtype="fp32"))


def load_rows() -> list[dict[str, str]]:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert all(r["label"] in LABELS and r["text"].strip() for r in rows)
    return rows


def sentiment(backend: po.Backend, **kw: object) -> po.Classifier:
    @po.classify(labels=LABELS, chat=True, backend=backend, **kw)
    def classify_review(review: str) -> po.Prompt:
        return po.shared(INSTRUCTION) + f"Review: {review}"

    return classify_review


def ranking_auc(scores: list[float], gold: list[str]) -> float:
    pos = [s for s, g in zip(scores, gold, strict=True) if g == "positive"]
    neg = [s for s, g in zip(scores, gold, strict=True) if g == "negative"]
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def raw_label(r: po.Classification) -> str:
    return max(LABELS, key=lambda label: r.logprobs[label])


def test_the_shipped_set_is_balanced() -> None:
    rows = load_rows()
    assert 40 <= len(rows) <= 80
    assert sum(r["label"] == "positive" for r in rows) * 2 == len(rows)
    assert sum(r["label"] == "positive" for r in rows[:N_FIT]) * 2 == N_FIT


def test_sentiment_accuracy_before_and_after_calibration(backend: po.Local) -> None:
    rows = load_rows()
    gold = [r["label"] for r in rows]

    cf = sentiment(backend, calibrate="content-free")
    results = cf.map([(r["text"],) for r in rows])
    assert all(isinstance(r, po.Classification) for r in results), results
    # The shared instruction is computed once and reused by the other 59 reviews.
    assert sum(r.cached_tokens > 0 for r in results) >= len(rows) - 1
    raw_acc = sum(raw_label(r) == g for r, g in zip(results, gold, strict=True)) / len(rows)
    cf_acc = sum(r.label == g for r, g in zip(results, gold, strict=True)) / len(rows)
    # Raw log-probs decide the ranking (one prefix, so calibration shifts every row alike).
    auc = ranking_auc([r.logprobs["positive"] - r.logprobs["negative"] for r in results], gold)

    fitted = sentiment(backend)
    report = fitted.calibrate([((r["text"],), r["label"]) for r in rows[:N_FIT]])
    assert report.n == N_FIT and report.failed == 0
    held_out = rows[N_FIT:]
    # The fitted classifier scores a row as its raw log-probs plus the offsets (test_lang checks
    # that on the Fake backend), so the held-out rows need no second pass through the model.
    off = fitted.offsets
    assert off is not None
    scores = [[r.logprobs[k] for k in LABELS] for r in results[N_FIT:]]
    gold_ids = [LABELS.index(g) for g in gold[N_FIT:]]
    fit_acc = accuracy(scores, gold_ids, [off[k] for k in LABELS])
    raw_held = accuracy(scores, gold_ids, [0.0] * len(LABELS))
    one = fitted(held_out[0]["text"])  # and one row end to end, to be sure
    assert one.probs["positive"] == pytest.approx(
        softmax([s + off[k] for s, k in zip(scores[0], LABELS, strict=True)])[0], abs=1e-5
    )

    print(
        f"\nraw {raw_acc:.3f}  content-free {cf_acc:.3f}  fitted(held-out {len(held_out)}) {fit_acc:.3f} "
        f"(raw there {raw_held:.3f})  AUC {auc:.3f}"
    )
    assert raw_acc >= 0.60  # measured 0.700
    assert cf_acc >= 0.78  # measured 0.867
    assert fit_acc >= 0.875  # measured 0.975
    assert auc >= 0.95  # measured 1.000
    assert cf_acc > raw_acc and fit_acc > raw_held, "calibration helps this prompt"


def test_credit_check_histories_are_a_few_hundred_to_1500_tokens(backend: po.Local) -> None:
    """The credit_check example's claim about its synthetic histories, on the real tokenizer."""
    path = Path(__file__).resolve().parents[2] / "examples" / "credit_check.py"
    spec = importlib.util.spec_from_file_location("examples_credit_check", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules.get("examples_credit_check")
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules["examples_credit_check"] = module
        spec.loader.exec_module(module)
    lengths = [len(backend.tokenize(p.history)) for p in module.applicants(6)]
    assert min(lengths) >= 200 and max(lengths) <= 1600, lengths


def test_demo_classifies_and_ranks_sensibly(backend: po.Local) -> None:
    """What `scripts/dev.sh demo` shows a newcomer holds: calibration makes every review right
    (the raw model does not), the posts matching the profile rank above the others, and every
    post after the first reads the shared profile from the cache."""
    texts = [(text,) for text, _ in demo.REVIEWS]
    gold = [g for _, g in demo.REVIEWS]
    raw = demo.sentiment(backend, calibrate=None).map(texts)
    calibrated = demo.sentiment(backend).map(texts)
    assert [r.label for r in calibrated] == gold  # type: ignore[union-attr]
    assert [r.label for r in raw] != gold, "the demo shows what calibration fixes"  # type: ignore[union-attr]
    ranked = demo.rank_posts(backend)
    matches = [any(w in r.item for w in ("hiking", "coffee", "espresso", "camping")) for r in ranked]
    assert matches == [True] * 4 + [False] * 4, [r.item for r in ranked]
    results = [r.result for r in ranked]
    assert all(isinstance(r, po.Classification) for r in results)
    cached = [r.cached_tokens for r in results]  # type: ignore[union-attr]
    assert max(cached) > 0 and cached.count(max(cached)) == len(results) - 1, cached


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    assert f"{len(demo.REVIEWS)}/{len(demo.REVIEWS)} calibrated" in out
    assert "came from the prefix cache" in out and "launch_server" in out
