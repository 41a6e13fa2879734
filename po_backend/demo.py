"""The README's main job: score example prompts on the embedded SmolLM2-135M-Instruct model and
print label probabilities, then show prefix reuse across items that share a user profile.

    python -m po_backend.demo [--model PATH] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import math
import time

from po_backend import Engine

REVIEWS = [
    ("The food was delicious and the staff were friendly. I will come back!", "positive"),
    ("Terrible service, cold food, and we waited an hour. Never again.", "negative"),
    ("An absolute masterpiece: moving, funny and beautifully shot.", "positive"),
    ("The battery died after two days and support never answered.", "negative"),
]

PROFILE = (
    "User profile: a software engineer in Berlin who loves hiking, specialty coffee and "
    "science fiction novels. Recently liked posts about trail running shoes, pour-over coffee "
    "recipes and a review of a new space-opera trilogy. Dislikes celebrity gossip and sports "
    "betting."
)
POSTS = [
    "A guide to the best alpine hiking trails near Munich.",
    "Top 10 celebrity breakups of the year.",
    "How to dial in your pour-over: grind size, water temperature and timing.",
    "Tonight's football betting tips and odds.",
    "Interview with the author of a new hard science fiction novel.",
]


def chat_prompt(engine: Engine, user: str) -> str:
    messages = [{"role": "user", "content": user}]
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--dtype", default=None, help="fp32 | bf16 (default: bf16 where the CPU has it)")
    args = ap.parse_args()

    t0 = time.perf_counter()
    engine = Engine.from_pretrained(args.model, dtype=args.dtype)
    tok = engine.tokenizer
    print(
        f"loaded {args.model} ({engine.config.dtype}, {engine.config.device}) in {time.perf_counter() - t0:.1f}s"
    )

    # After the chat template's "assistant\n" the label tokens carry no leading space.
    labels = ["positive", "negative"]
    label_ids = [tok.encode(w)[0] for w in labels]
    prompts = [
        chat_prompt(engine, f"Classify the sentiment of this review as positive or negative.\nReview: {text}")
        for text, _ in REVIEWS
    ]
    print("\nSentiment (probabilities renormalised over the two labels):")
    correct = 0
    for (text, gold), res in zip(REVIEWS, engine.score(prompts, label_ids), strict=True):
        probs = [math.exp(lp) for lp in res.logprobs]
        total = sum(probs)
        pred = labels[probs.index(max(probs))]
        correct += pred == gold
        shown = "  ".join(f"{lab}={p / total:.2f}" for lab, p in zip(labels, probs, strict=True))
        print(f"  {shown}  [{pred:8s} gold {gold:8s}]  {text[:60]}")
    print(f"  accuracy {correct}/{len(REVIEWS)}")

    # Recommendation: 5 posts scored against one profile. The profile is the declared shared
    # prefix: computed once, cached, and the other posts run together as one multi-item forward.
    head = f"{PROFILE}\nWill this user engage with the following post? Answer Yes or No.\n"
    head_ids = tok.encode(head)
    yes, no = tok.encode(" Yes")[0], tok.encode(" No")[0]
    items = [head_ids + tok.encode(f"Post: {post}\nAnswer:") for post in POSTS]
    t0 = time.perf_counter()
    results = engine.score(items, [yes, no], cache_prefix_len=len(head_ids))
    dt = time.perf_counter() - t0
    print(f"\nRecommendation: P(Yes) for {len(POSTS)} posts, one shared {len(head_ids)}-token profile:")
    ranked = sorted(zip(POSTS, results, strict=True), key=lambda pr: -(pr[1].logprobs[0] - pr[1].logprobs[1]))
    for post, res in ranked:
        p_yes = 1 / (1 + math.exp(res.logprobs[1] - res.logprobs[0]))
        print(f"  P(Yes)={p_yes:.3f}  cached={res.cached_tokens:3d}/{res.prompt_tokens}  {post}")
    st = engine.stats()
    print(
        f"  {dt * 1000:.0f} ms; {st.cached_tokens} of {st.prompt_tokens} prompt tokens came from the prefix cache"
    )


if __name__ == "__main__":
    main()
