"""The first thing to run: classify and rank with the po_lang DSL on the embedded
SmolLM2-135M-Instruct, in this process, through the same prefix-aware scheduler as the server.

    python -m po_lang.demo [--model PATH] [--dtype fp32|bf16]      (or: bash scripts/dev.sh demo)

An entry point, not a library module: it loads the engine (torch) when it runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import po_lang as po
from po_lang.api import Calibrate

# Three positive and three negative reviews. The raw 135M model calls too much "negative" (here
# it gets the first and fifth wrong); content-free calibration fixes that. Measured on the 60
# reviews of tests/data/sentiment.jsonl: 0.70 raw, 0.87 content-free (examples/README.md).
REVIEWS = (
    ("The food was delicious and the staff were friendly. I will come back!", "positive"),
    ("Terrible service, cold food, and we waited an hour. Never again.", "negative"),
    ("A wonderful book, I could not put it down.", "positive"),
    ("The plot was boring and the ending made no sense.", "negative"),
    ("Great value for money, works perfectly.", "positive"),
    ("The hotel room was dirty and the wifi never worked.", "negative"),
)

RECOMMENDER = (
    "You are a recommender system. You are given a user's profile and one social media post. "
    "Decide whether this user would engage with the post (like, comment or share).\n\n"
)
PROFILE = "Alex goes hiking and camping every weekend and drinks specialty coffee every morning."
POSTS = (
    "Tonight's football betting tips and odds.",
    "A guide to the best alpine hiking trails for beginners.",
    "Top 10 celebrity breakups of the year.",
    "Pour-over coffee: grind size, water temperature and timing explained.",
    "Stock market update: tech shares fall for a third day.",
    "How to pack a lightweight tent for a weekend camping trip.",
    "Which reality TV star wore it best at the awards party?",
    "We tasted ten espresso beans so you don't have to.",
)


def sentiment(backend: po.Backend, *, calibrate: Calibrate = "content-free") -> po.Classifier:
    # content-free: divide by the label prior of the prompt with the review replaced by "N/A"
    # (one extra request per shared prefix). With a few labeled rows, `fn.calibrate(rows)` fits it.
    @po.classify(labels=["positive", "negative"], chat=True, calibrate=calibrate, backend=backend)
    def classify_review(review: str) -> po.Prompt:
        return (
            po.shared("Classify the sentiment of this review as positive or negative.\n")
            + f"Review: {review}"
        )

    return classify_review


def engagement(backend: po.Backend) -> po.Classifier:
    @po.classify(labels=["Yes", "No"], chat=True, backend=backend)
    def will_engage(profile: str, post: str) -> po.Prompt:
        # The instructions and the profile are the shared prefix: computed once, then every
        # candidate post reads their K/V from the prefix cache.
        return (
            po.shared(RECOMMENDER)
            + po.shared(f"User profile:\n{profile}\n\n")
            + f"Post: {post}\n\nWould this user engage with this post? Answer Yes or No."
        )

    return will_engage


def rank_posts(backend: po.Backend) -> list[po.Ranked]:
    return po.rank(engagement(backend), list(POSTS), label="Yes", profile=PROFILE)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded", help="a HF folder, a GGUF file or 'embedded'")
    ap.add_argument(
        "--dtype", default="fp32", help="fp32 (default: the same numbers on every CPU) | bf16 | fp16"
    )
    args = ap.parse_args(argv)

    with po.Local(args.model, dtype=args.dtype) as local:
        t0 = time.perf_counter()
        config = local.engine.config
        print(f"loaded {args.model} ({config.dtype}, {config.device}) in {time.perf_counter() - t0:.1f}s")

        t0 = time.perf_counter()
        texts = [(text,) for text, _ in REVIEWS]
        raw = sentiment(local, calibrate=None).map(texts)
        calibrated = sentiment(local).map(texts)
        print('\n@po.classify(labels=["positive", "negative"], calibrate="content-free"):')
        print("  P(positive) raw -> calibrated")
        right_raw = right = 0
        for (text, gold), r, c in zip(REVIEWS, raw, calibrated, strict=True):
            if isinstance(r, po.Failed) or isinstance(c, po.Failed):
                print(f"  FAILED {r if isinstance(r, po.Failed) else c}  {text}")
                continue
            right_raw += r.label == gold
            right += c.label == gold
            mark = "ok" if c.label == gold else "WRONG"
            print(f"  {r.probs['positive']:.2f} -> {c.probs['positive']:.2f}  {c.label:8s} {mark:5s}  {text}")
        print(
            f"  {right_raw}/{len(REVIEWS)} right raw, {right}/{len(REVIEWS)} calibrated ({time.perf_counter() - t0:.1f}s)"
        )

        t0 = time.perf_counter()
        steps_before = local.loop.stats().steps
        ranked = rank_posts(local)
        steps = local.loop.stats().steps - steps_before
        print(f"\npo.rank(will_engage, posts, label='Yes', profile=...) for: {PROFILE}")
        # A 135M model ranks better than it thresholds: P(Yes) is low for every post, the order
        # is what counts (a per-label calibration would shift every score alike).
        prompt = cached = 0
        for n, item in enumerate(ranked, start=1):
            if isinstance(item.result, po.Failed):
                print(f"  {n}. FAILED {item.result.error}  {item.item}")
                continue
            prompt += item.result.prompt_tokens
            cached += item.result.cached_tokens
            tokens = f"{item.result.cached_tokens}/{item.result.prompt_tokens}"
            print(f"  {n}. P(Yes)={item.score:.3f}  cached {tokens:>7s}  {item.item}")
        print(
            f"  {cached} of {prompt} prompt tokens ({cached / max(prompt, 1):.0%}) came from the prefix cache; "
            f"{len(POSTS)} posts in {steps} forward{'s' if steps != 1 else ''} ({time.perf_counter() - t0:.1f}s)"
        )

    print(
        "\nNext: serve it over HTTP (SGLang, OpenAI and /v1/classify APIs):\n"
        "  python -m po_backend.entrypoints.launch_server --model-path embedded --port 30000\n"
        "and see examples/README.md (recommend.py, credit_check.py, label_data.py, sglang_select.py)."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
