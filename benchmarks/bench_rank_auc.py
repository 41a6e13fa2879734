"""`examples/recommend.py`'s ranking AUC on more users, per `--dtype` / `--quantization`, with the
spread: is a gap between two configurations more than the few pairs one list holds?

Each user ranks all 15 of recommend.py's posts (`po.rank`, the example's prompt); the AUC is the
share of (relevant, other) pairs ranked in the right order. Users: recommend.py's three (what
REPORT.md's "recommend AUC" column averages, over 10 posts each, also given here as
`example_auc`) and 24 more written for this benchmark, half of them a *choose* set (where a recipe
may be tuned) and half *held out* (never looked at while choosing). The difference to the first
configuration is paired per user; its spread is a bootstrap over users (2,000 resamples, seed 0).

    OMP_NUM_THREADS=1 python -m benchmarks.bench_rank_auc --configs fp32 w8a8x2_int8 --out /tmp/auc.json

A configuration is `fp32`, `bf16` or a `--quantization` mode (run in fp32), optionally followed by
recipe changes (`recipe_with`), e.g. `w8a8x2_int8:weight_scales=e4m3:outlier_weights=int8`, or
`:float=SPEC` to keep projections in float (`int8.parse_float_projections`' syntax: `down_proj` in
every layer, `down_proj@27-29` in layers 27 to 29, `;` between entries).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness
from examples import recommend
from examples.recommend import User

# Written for this benchmark; interests from recommend.py's topics (outdoors, coffee, scifi,
# gossip, betting, cooking, finance, running).
CHOOSE = (
    User(
        "priya",
        "Priya is a nurse who works night shifts. On her days off she goes trail running and signs "
        "up for half marathons. She follows celebrity news on her phone during breaks. She recently "
        "liked posts about running watches and a pop star's tour. She does not drink coffee and "
        "never gambles.",
        frozenset({"running", "gossip"}),
    ),
    User(
        "marco",
        "Marco owns a small cafe. He roasts his own beans, experiments with espresso recipes and "
        "cooks Italian food for his family every evening. He recently liked posts about latte art "
        "and homemade pasta. He is not interested in money markets or celebrity stories.",
        frozenset({"coffee", "cooking"}),
    ),
    User(
        "lena",
        "Lena is a retired accountant who manages her own pension portfolio and reads about "
        "dividend investing every day. She bets a little on horse races and football at weekends. "
        "She recently liked posts about bond yields and match odds. She dislikes camping and does "
        "not read fiction.",
        frozenset({"finance", "betting"}),
    ),
    User(
        "omar",
        "Omar is a physics teacher who reads science fiction novels on the train and spends school "
        "holidays backpacking and camping in national parks. He recently liked posts about a space "
        "opera series and a lightweight sleeping bag. He thinks celebrity gossip is a waste of time.",
        frozenset({"scifi", "outdoors"}),
    ),
    User(
        "yuki",
        "Yuki is a graphic designer who starts every day with a carefully brewed pour-over coffee "
        "and reads science fiction in the evenings. Yuki recently liked posts about a new coffee "
        "grinder and an award-winning space novel. Yuki has no interest in sports or betting.",
        frozenset({"coffee", "scifi"}),
    ),
    User(
        "ben",
        "Ben is a bank analyst who trades stocks in his spare time and runs before work every "
        "morning; he finished three marathons last year. He recently liked posts about interest "
        "rates and running shoes. He does not cook and finds reality TV boring.",
        frozenset({"finance", "running"}),
    ),
    User(
        "chloe",
        "Chloe is a food blogger who tests vegan recipes, bakes bread every weekend and follows "
        "reality TV shows and celebrity fashion. She recently liked posts about a sourdough "
        "starter and an awards night red carpet. She is not interested in finance or camping.",
        frozenset({"cooking", "gossip"}),
    ),
    User(
        "ivan",
        "Ivan is a long-distance hiker who spends summers walking mountain trails and camping "
        "under the stars, and trains for ultramarathons in winter. He recently liked posts about "
        "a tent review and a trail race. He never gambles and does not follow celebrities.",
        frozenset({"outdoors", "running"}),
    ),
    User(
        "rosa",
        "Rosa is a student who follows every football league, places bets on matches each weekend "
        "and keeps up with celebrity gossip and reality TV. She recently liked posts about betting "
        "odds and a celebrity breakup. She does not read novels and never goes hiking.",
        frozenset({"betting", "gossip"}),
    ),
    User(
        "theo",
        "Theo is a chef who cooks at a busy restaurant, roasts coffee at home and writes about "
        "household budgets and saving for retirement. He recently liked posts about a new knife "
        "set, a coffee roaster and index fund fees. He has no interest in running or sports.",
        frozenset({"cooking", "coffee", "finance"}),
    ),
    User(
        "nina",
        "Nina is a software tester who reads science fiction and fantasy, writes reviews of space "
        "opera books and plays board games. She recently liked posts about a hard science fiction "
        "trilogy and an interview with its author. She is not interested in sports or cooking.",
        frozenset({"scifi"}),
    ),
    User(
        "kofi",
        "Kofi is a personal trainer who runs every day and coaches beginners for their first "
        "marathon. He cooks healthy meals and shares recipes with his clients. He recently liked "
        "posts about running drills and a quick vegan dinner. He never bets and does not drink coffee.",
        frozenset({"running", "cooking"}),
    ),
)
HELD_OUT = (
    User(
        "ana",
        "Ana is a hiking guide who leads groups in the Alps every summer and camps most weekends. "
        "She drinks strong espresso before every climb. She recently liked posts about alpine "
        "routes and a camping stove. She avoids celebrity news and has no interest in stocks.",
        frozenset({"outdoors", "coffee"}),
    ),
    User(
        "dev",
        "Dev is a day trader who watches the stock market from morning to night and bets on "
        "cricket and football. He recently liked posts about earnings reports and betting tips. "
        "He does not cook, never reads fiction and does not exercise.",
        frozenset({"finance", "betting"}),
    ),
    User(
        "sara",
        "Sara is a journalist who writes about celebrities and television. She follows every "
        "reality show and red carpet event, and unwinds with space opera novels. She recently "
        "liked posts about an actor's wedding and a science fiction book prize. She does not run.",
        frozenset({"gossip", "scifi"}),
    ),
    User(
        "felix",
        "Felix is a baker who runs a small bakery, tries new bread recipes every week and cooks "
        "vegan dinners at home. He recently liked posts about rye bread and a curry recipe. He is "
        "not interested in sports, betting or the stock market.",
        frozenset({"cooking"}),
    ),
    User(
        "mei",
        "Mei is a doctor who trains for marathons and goes trail running and camping in the "
        "mountains whenever she can. She recently liked posts about a marathon training app and "
        "a hiking backpack. She has no interest in celebrity news or gambling.",
        frozenset({"running", "outdoors"}),
    ),
    User(
        "luis",
        "Luis is a barista and a science fiction fan. He competes in coffee brewing championships "
        "and reads space opera novels on his breaks. He recently liked posts about espresso "
        "extraction and a new science fiction series. He does not follow finance or sports.",
        frozenset({"coffee", "scifi"}),
    ),
    User(
        "hanna",
        "Hanna is an economist who reads market news every morning, invests in index funds and "
        "follows celebrity gossip magazines for fun. She recently liked posts about inflation "
        "figures and a pop star's new album. She never goes camping and does not run.",
        frozenset({"finance", "gossip"}),
    ),
    User(
        "paul",
        "Paul is a sports fan who bets on football every weekend, runs 10k races and follows the "
        "odds for every big match. He recently liked posts about a race result and betting "
        "tips. He does not cook, does not drink coffee and never reads novels.",
        frozenset({"betting", "running"}),
    ),
    User(
        "zoe",
        "Zoe is a park ranger who lives in the mountains, camps year round and cooks over an open "
        "fire. She recently liked posts about a hiking trail and a campfire stew recipe. She is "
        "not interested in celebrities, betting or the stock market.",
        frozenset({"outdoors", "cooking"}),
    ),
    User(
        "raj",
        "Raj is a financial adviser who writes a newsletter on saving and investing and brews "
        "specialty coffee at home every morning. He recently liked posts about retirement "
        "accounts and a pour-over kettle. He has no interest in sports or reality TV.",
        frozenset({"finance", "coffee"}),
    ),
    User(
        "ella",
        "Ella is a teenager who follows celebrity news and reality TV, reads science fiction and "
        "runs on her school's cross-country team. She recently liked posts about a celebrity "
        "feud, a space novel and running spikes. She does not cook and never bets.",
        frozenset({"gossip", "scifi", "running"}),
    ),
    User(
        "gus",
        "Gus is a retired engineer who spends his days camping, fishing and hiking, and reads "
        "science fiction by the campfire. He recently liked posts about a mountain hut and a "
        "classic science fiction novel. He is not interested in celebrities or betting.",
        frozenset({"outdoors", "scifi"}),
    ),
)
SETS = {"example": recommend.USERS, "choose": CHOOSE, "held_out": HELD_OUT}


def _backend(config: str) -> Any:
    """`fp32`, `bf16`, or a quantization mode in fp32, with `:field=value` recipe changes."""
    import po_lang as po
    from po_backend.engine.models import int8

    mode, *extra = config.split(":")
    if mode in ("fp32", "bf16"):
        assert not extra, "recipe options need a quantization mode"
        return po.Local("embedded", dtype=mode)
    if extra:
        attr = {int8.W8A8_INT8: "DEFAULT_RECIPE", int8.W8A8X2_INT8: "TWO_PASS_RECIPE"}[mode]
        setattr(int8, attr, recipe_with(int8.recipe_for(mode), extra))  # read at load (`recipe_for`)
    return po.Local("embedded", dtype="fp32", quantization=mode)


def recipe_with(base: Any, options: list[str]) -> Any:
    """`base` (an `Int8Recipe`) with "field=value" changes: `float=SPEC` (float projections),
    `weight_block=64`, `weight_scales=e4m3` (or `channel`), `outlier_weights=int8`, `outliers=4,4,4,16`,
    `alpha=0.3` (or four values; `none`: no smoothing)."""
    from po_backend.engine.models import int8

    changes: dict[str, Any] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key == "float":
            changes["float_projections"] = int8.parse_float_projections(value)
        elif key == "outliers":
            changes[key] = tuple(int(v) for v in value.split(","))
        elif key == "alpha":  # one value for every projection, or four; "none": not smoothed
            alphas = [None if v == "none" else float(v) for v in value.split(",")]
            changes[key] = tuple(alphas * 4 if len(alphas) == 1 else alphas)
        elif key == "weight_block":
            changes[key] = int(value)
        elif key in ("weight_scales", "outlier_weights"):
            changes[key] = value
        else:
            raise ValueError(f"unknown recipe option {key!r}")
    return dataclasses.replace(base, **changes)


def _bootstrap(d: np.ndarray, reps: int = 2000) -> tuple[float, float]:
    """A 95% interval of the mean of d (one value per user), users resampled."""
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, len(d), (reps, len(d)))].mean(1)
    return float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))


def run(configs: list[str], sets: list[str]) -> dict[str, Any]:
    import po_lang as po

    n_posts = len(recommend.POSTS)
    out: dict[str, Any] = {"configs": {}}
    for config in configs:
        t0 = time.perf_counter()
        row: dict[str, Any] = {}
        with po.using(_backend(config)):
            ex = [r.auc for r in recommend.recommend(recommend.USERS, 10) if r.auc is not None]
            row["example_auc"] = sum(ex) / len(ex)
            for s in sets:
                res = recommend.recommend(SETS[s], n_posts)
                row[s] = {r.user: r.auc for r in res}
                row.setdefault("scores", {}).update(
                    {r.user: {x.item: x.score for x in r.ranked} for r in res}
                )
        row["seconds"] = time.perf_counter() - t0
        out["configs"][config] = row
        print(config, json.dumps(row), flush=True)
    out["summary"] = summarize(out["configs"], sets)
    return out


def summarize(rows: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """Per configuration and user set: the mean AUC, and the paired difference to the first
    configuration (mean, bootstrap interval, per-user spread); with scores on both sides, the
    Kendall tau of each user's posts' P(Yes) against the first configuration's."""
    from scipy.stats import kendalltau

    configs = list(rows)
    base = rows[configs[0]]
    summary = {}
    for config in configs:
        row = rows[config]
        summary[config] = {"example_auc": row["example_auc"]}
        present = [t for t in sets if t in row and t in base]  # a run may cover fewer sets
        for s in [*present, "all"]:
            names = [u for t in present for u in base[t]] if s == "all" else list(base[s])
            own = np.array([_lookup(row, present, u) for u in names])
            ref = np.array([_lookup(base, present, u) for u in names])
            d = own - ref
            lo, hi = _bootstrap(d)
            summary[config][s] = {
                "users": len(names),
                "auc_mean": float(own.mean()),
                "diff_vs_first_mean": float(d.mean()),
                "diff_ci95": [lo, hi],
                "diff_per_user_sd": float(d.std(ddof=1)) if len(d) > 1 else 0.0,
            }
            if "scores" in row and "scores" in base:
                taus = [_tau(kendalltau, row["scores"][u], base["scores"][u]) for u in names]
                summary[config][s]["score_tau_vs_first_mean"] = float(np.mean(taus))
    return summary


def _tau(kendalltau: Any, a: dict[str, float], b: dict[str, float]) -> float:
    items = sorted(b)
    return float(kendalltau([a[i] for i in items], [b[i] for i in items]).statistic)


def _lookup(row: dict[str, Any], sets: list[str], user: str) -> float:
    return next(row[s][user] for s in sets if user in row[s])


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, None)
    ap.add_argument("--configs", nargs="+", default=["fp32", "w8a8x2_int8"])
    ap.add_argument("--sets", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--merge", nargs="+", type=Path, help="summarize these earlier results together")
    args = ap.parse_args(argv)
    if args.out is None:
        ap.error("--out is required")
    if args.merge:
        rows = {c: r for f in args.merge for c, r in json.loads(f.read_text())["configs"].items()}
        doc = {
            "configs": rows,
            "summary": summarize(rows, [s for s in SETS if s in next(iter(rows.values()))]),
        }
    else:
        doc = run(args.configs, args.sets)
    harness.save(args.out, {"machine": harness.machine_info(), **doc})
    print(json.dumps(doc["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
