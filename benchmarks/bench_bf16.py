"""bf16 against fp32 on the embedded model: do rankings, AUC and cache hits agree, and what does
the fp32 residual stream cost? Compares `--residual-dtype fp32` (bf16 weights and matmuls, fp32
residual stream and norms) with `model` (everything bf16, transformers' way).

- Kendall tau of bf16 vs fp32 P(Yes) rankings on held-out item lists (profiles and items that
  appear nowhere else in the repository);
- `examples/recommend.py`'s mean ranking AUC;
- cache hit vs cold: the largest |log-prob difference| between scoring items with their prefix
  read from the cache and computing them from scratch, same engine, same dtype;
- speed: one cold 2k-token forward, the two residual modes in the same run (same-run ratio).

    python -m benchmarks.bench_bf16 --out benchmarks/results/report/bf16.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch
from scipy.stats import kendalltau

import po_lang as po
from benchmarks.harness import machine_info, save
from examples import recommend
from po_backend import Engine, ScoreRequest

PROFILES = (
    "Maria restores vintage motorcycles and races them on weekends; she follows Formula 1 and "
    "reads about engine tuning. She dislikes fashion news and has no pets.",
    "Tom teaches high-school chemistry, grows tomatoes and chillies on his allotment and watches "
    "nature documentaries. He avoids video games and does not follow any sport.",
    "Priya is a cardiologist who plays the violin in an amateur orchestra and travels to Japan "
    "every year. She never gambles and is not interested in cars.",
    "Leo is a teenage gamer who streams strategy games, builds his own PCs and collects trading "
    "cards. He finds gardening and classical music boring.",
)
ITEMS = (
    "Ten tips for a faster lap time on a wet track.",
    "Rebuilding a carburettor: a step-by-step photo guide.",
    "Grand Prix preview: who wins in Monaco this year?",
    "Spring fashion week: the looks everyone is talking about.",
    "Why your tomato leaves turn yellow, and how to fix it.",
    "A beginner's guide to growing chilli peppers indoors.",
    "New documentary follows a family of snow leopards.",
    "Mixing acids and bases: a safe classroom experiment.",
    "Understanding heart rhythm disorders: a patient's guide.",
    "The best violin concertos for a rainy afternoon.",
    "A week in Kyoto: temples, tea houses and trains.",
    "Patch notes: the new season of a popular strategy game.",
    "Building a quiet gaming PC on a budget.",
    "Rare trading card sells for a record price at auction.",
    "Online casino bonus codes for this weekend.",
    "Adopting a rescue dog: what to know first.",
)
QUESTION = "\nWould this person be interested in this item? Answer Yes or No.\nAnswer:"


def _lists(tok: Any) -> list[tuple[list[int], list[list[int]]]]:
    """(prefix ids, item suffix ids) per profile: every item list over one shared profile."""
    out = []
    for p in PROFILES:
        prefix = tok.encode(f"Profile: {p}\n")
        out.append((prefix, [tok.encode(f"Item: {it}{QUESTION}", add_special_tokens=False) for it in ITEMS]))
    return out


def _scores(engine: Engine, lists: Any, labels: tuple[int, int], cached: bool) -> list[list[list[float]]]:
    """Label log-probs per list and item; `cached`: the prefix is read from the cache (computed
    once, then the items over it), else every prompt is computed from scratch."""
    out = []
    for prefix, items in lists:
        engine.flush_cache()
        if cached:
            engine.run([ScoreRequest(tuple(prefix), labels, cache_prefix_len=len(prefix))])
            reqs = [ScoreRequest(tuple(prefix + s), labels, cache_prefix_len=len(prefix)) for s in items]
            res = engine.run(reqs)
            assert all(r.cached_tokens == len(prefix) for r in res), "the prefix was not read from the cache"
        else:
            res = []
            for s in items:
                engine.flush_cache()
                res += engine.run([ScoreRequest(tuple(prefix + s), labels)])
        out.append([list(r.logprobs) for r in res])
    return out


def _tau(a: list[list[list[float]]], b: list[list[list[float]]]) -> list[float]:
    """Kendall tau per list of the Yes-No log-odds (the ranking `po.rank` makes)."""
    return [
        float(kendalltau([x[0] - x[1] for x in la], [y[0] - y[1] for y in lb]).statistic)
        for la, lb in zip(a, b, strict=True)
    ]


def _max_diff(a: list[list[list[float]]], b: list[list[list[float]]]) -> float:
    return max(
        abs(x - y)
        for la, lb in zip(a, b, strict=True)
        for ra, rb in zip(la, lb, strict=True)
        for x, y in zip(ra, rb, strict=True)
    )


def _auc(**options: Any) -> float:
    with po.using(po.Local("embedded", **options)):
        aucs = [r.auc for r in recommend.recommend(recommend.USERS, 10) if r.auc is not None]
    return sum(aucs) / len(aucs)


def _forward_seconds(engine: Engine, n: int, repeats: int) -> float:
    ids = torch.randint(0, engine.vocab_size, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    times = []
    for _ in range(repeats):
        engine.flush_cache()
        t = time.perf_counter()
        engine.score([ids], [0])
        times.append(time.perf_counter() - t)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/report/bf16.json"))
    ap.add_argument("--speed-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    n = args.speed_tokens
    kw: dict[str, Any] = {"max_input_len": max(n, 512), "max_batch_tokens": max(n, 1024)}
    e32 = Engine.from_pretrained("embedded", dtype="fp32", **kw)
    tok = e32.tokenizer
    labels = (tok.encode(" Yes", add_special_tokens=False)[0], tok.encode(" No", add_special_tokens=False)[0])
    lists = _lists(tok)
    ref = _scores(e32, lists, labels, cached=False)
    doc: dict[str, Any] = {"machine": machine_info(), "fp32": {"auc": _auc(dtype="fp32")}}
    del e32
    for mode in ("fp32", "model"):
        eng = Engine.from_pretrained("embedded", dtype="bf16", residual_dtype=mode, **kw)
        cold = _scores(eng, lists, labels, cached=False)
        hit = _scores(eng, lists, labels, cached=True)
        taus = _tau(cold, ref)
        doc[f"bf16-residual-{mode}"] = {
            "kendall_tau_mean": sum(taus) / len(taus),
            "kendall_tau_min": min(taus),
            "max_abs_dlogprob_vs_fp32": _max_diff(cold, ref),
            "max_abs_dlogprob_hit_vs_cold": _max_diff(hit, cold),
            "auc": _auc(dtype="bf16", residual_dtype=mode),
            f"forward_s_{n}": _forward_seconds(eng, n, args.repeats),
        }
        print(mode, doc[f"bf16-residual-{mode}"], flush=True)
        del eng
    f, m = doc["bf16-residual-fp32"][f"forward_s_{n}"], doc["bf16-residual-model"][f"forward_s_{n}"]
    doc["speed_ratio_fp32_residual_vs_model"] = f / m
    print(doc)
    save(args.out, doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
