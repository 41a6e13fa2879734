"""Label the sample reviews with `prefillonly label`, from Python, and read the labels back.

    python examples/label_data.py                  # the embedded model, in process
    python examples/label_data.py --server http://127.0.0.1:30000
    python examples/label_data.py --ray --concurrency 2

The same job from a shell (any flag of `prefillonly label --help` works here too):

    prefillonly label examples/data/reviews.jsonl --labels positive,negative \\
        --template 'Classify the sentiment of this review as {labels}.\\nReview: {text}'

It writes examples/data/reviews.labeled.jsonl, one record per review in input order; the sample
has two deliberately bad rows, reported by line and left out, and a `gold` field, so the summary
ends with the accuracy and a confusion matrix. Kill it and run it again: it resumes.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from po_lang.label import main as label

SAMPLE = Path(__file__).resolve().parent / "data" / "reviews.jsonl"
TEMPLATE = "Classify the sentiment of this review as {labels}.\nReview: {text}"


def main(argv: Sequence[str] = ()) -> int:
    output = SAMPLE.with_name("reviews.labeled.jsonl")
    status = label(
        [str(SAMPLE), "-o", str(output), "--labels", "positive,negative", "--template", TEMPLATE, *argv]
    )
    if status == 0:
        # Each record: the row as read ("input"), the label, and the probability of every label.
        records = [json.loads(line) for line in output.read_text(encoding="utf-8").splitlines()]
        unsure = sorted(records, key=lambda r: abs(r["probs"]["positive"] - 0.5))[:3]
        print("least sure:")
        for r in unsure:
            print(f"  P(positive)={r['probs']['positive']:.2f}  {r['input']['text']}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
