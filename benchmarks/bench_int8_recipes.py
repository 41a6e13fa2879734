"""Int8 recipe variants against fp32 on the embedded model: Kendall tau of the Yes-No log-odds on
`bench_mil --compare-dtypes`' held-out item lists (4 profiles x 16 items, each prompt cold), the
largest log-prob difference, the mean log-odds difference and the decoder layers' bytes; with
`--full`, also a prefix-cache hit against the cold run and the sentiment set's accuracy (bench_mil
--compare-dtypes' own functions), fp32's included.

    OMP_NUM_THREADS=1 python -m benchmarks.bench_int8_recipes \\
        "w8a8x2_int8" "w8a8x2_int8:weight_scales=e4m3" --out /tmp/recipes.json

A variant is a `--quantization` mode, optionally with recipe changes (`bench_rank_auc.recipe_with`:
`MODE:weight_block=64:outlier_weights=int8:...`).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.bench_int8 import _with_recipe
from benchmarks.bench_mil import ITEMS, PROFILES, QUESTION, _scores, _sentiment
from benchmarks.workloads import label_ids


def main(argv: list[str] | None = None) -> int:
    from scipy.stats import kendalltau

    from po_backend import Engine
    from po_backend.engine.models.int8 import weight_bytes

    ap = harness.parser(__doc__, None)
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--full", action="store_true", help="hit vs cold and the sentiment set too")
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out is required")
    kw: dict[str, Any] = {"max_input_len": 512, "max_batch_tokens": 1024}
    e32 = Engine.from_pretrained("embedded", dtype="fp32", **kw)
    labels = label_ids(e32.tokenizer)
    items = [e32.tokenizer.encode(f"Item: {it}{QUESTION}", add_special_tokens=False) for it in ITEMS]
    lists = [(e32.tokenizer.encode(f"Profile: {p}\n"), items) for p in PROFILES]
    ref = _scores(e32, lists, labels, cached=False)
    rows: list[dict[str, Any]] = [{"variant": "fp32", **_sentiment(e32)}] if args.full else []
    del e32
    for spec in args.variants:
        t0 = time.perf_counter()
        eng = Engine.from_pretrained("embedded", dtype="fp32", quantization=_with_recipe(spec), **kw)
        cold = _scores(eng, lists, labels, cached=False)
        odds, ref_odds = cold[..., 0] - cold[..., 1], ref[..., 0] - ref[..., 1]
        taus = [float(kendalltau(a, b).statistic) for a, b in zip(odds, ref_odds, strict=True)]
        row = {
            "variant": spec,
            "kendall_tau_mean": float(np.mean(taus)),
            "kendall_tau_min": min(taus),
            "taus": taus,
            "max_abs_dlogprob_vs_fp32": float(np.abs(cold - ref).max()),
            "mean_abs_dlogodds_vs_fp32": float(np.abs(odds - ref_odds).mean()),
            "layer_bytes": sum(weight_bytes(layer) for layer in eng.model.decoder_layers),
        }
        if args.full:
            hit = _scores(eng, lists, labels, cached=True)
            row["max_abs_dlogprob_hit_vs_cold"] = float(np.abs(hit - cold).max())
            row.update(_sentiment(eng))
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        print(row, flush=True)
        del eng
    harness.save(args.out, {"machine": harness.machine_info(), "variants": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
