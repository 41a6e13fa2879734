"""Rerank candidate posts per user with `po.rank` (the paper's WL1 shape, scaled down for a CPU).

    python examples/recommend.py                       # the embedded model, in process
    python examples/recommend.py --url http://127.0.0.1:30000 --top-k 3

Each user's profile is the shared prefix (`po.shared`) of every request about that user, so the
engine computes it once and the candidate posts reuse its KV cache; the script prints, per user,
the top-k posts with P(Yes), whether each one matches the user's interests (the data marks them),
and how many prompt tokens came from the prefix cache.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import po_lang as po

INSTRUCTIONS = (
    "You are a recommender system. You are given a user's profile and one social media post. "
    "Decide whether this user would engage with the post (like, comment or share).\n\n"
)


@dataclass(frozen=True)
class Post:
    text: str
    topic: str


@dataclass(frozen=True)
class User:
    name: str
    profile: str
    interests: frozenset[str]  # topics of the posts this user engages with (the ground truth)


POSTS = (
    Post("A guide to the best alpine hiking trails for beginners.", "outdoors"),
    Post("How to pack a lightweight tent for a weekend camping trip.", "outdoors"),
    Post("Pour-over coffee: grind size, water temperature and timing explained.", "coffee"),
    Post("We tasted ten espresso beans so you don't have to.", "coffee"),
    Post("Interview with the author of a new hard science fiction novel.", "scifi"),
    Post("The ten best space opera books of the decade, ranked.", "scifi"),
    Post("Top 10 celebrity breakups of the year.", "gossip"),
    Post("Which reality TV star wore it best at the awards party?", "gossip"),
    Post("Tonight's football betting tips and odds.", "betting"),
    Post("Five easy vegan weeknight dinners in under 30 minutes.", "cooking"),
    Post("How to bake sourdough bread at home, step by step.", "cooking"),
    Post("Stock market update: tech shares fall for a third day.", "finance"),
    Post("Index funds versus picking stocks: what the data says.", "finance"),
    Post("Training plan for your first marathon.", "running"),
    Post("Review of the lightest trail running shoes this season.", "running"),
)

USERS = (
    User(
        "alex",
        "Alex is a software engineer who spends every weekend hiking in the mountains and camping. "
        "Alex drinks specialty coffee, brews pour-over at home every morning and reads science "
        "fiction novels, especially space opera. Alex recently liked posts about hiking boots, "
        "coffee grinders and a review of a new science fiction trilogy. Alex never reads celebrity "
        "gossip and finds sports betting annoying.",
        frozenset({"outdoors", "coffee", "scifi"}),
    ),
    User(
        "sam",
        "Sam is a personal finance blogger and a keen home cook. Sam invests in index funds, follows "
        "the stock market daily and writes about saving money. In the evenings Sam cooks vegan "
        "recipes and bakes bread. Sam recently liked posts about budgeting apps, dividend stocks "
        "and a sourdough starter. Sam has no interest in sports or outdoor activities.",
        frozenset({"finance", "cooking"}),
    ),
    User(
        "jo",
        "Jo is a university student who runs five times a week and is training for a marathon. "
        "Jo follows celebrity news and reality TV closely and bets on football matches every "
        "weekend. Jo recently liked posts about running shoes, a celebrity wedding and football "
        "odds. Jo does not cook and never reads novels.",
        frozenset({"running", "gossip", "betting"}),
    ),
)


@po.classify(labels=["Yes", "No"], chat=True)
def will_engage(profile: str, post: str) -> po.Prompt:
    """Would the user with this profile engage with this post? (Yes/No after the chat template.)"""
    # Two nested shared segments: the instructions are shared by every request, the profile by
    # every request about one user; both are token-stable prefixes for the cache.
    return (
        po.shared(INSTRUCTIONS)
        + po.shared(f"User profile:\n{profile}\n\n")
        + f"Post: {post}\n\nWould this user engage with this post? Answer Yes or No."
    )


def candidates(user_index: int, n: int) -> list[Post]:
    """`n` candidate posts for a user, a deterministic rotation of the pool (so users differ)."""
    n = min(n, len(POSTS))
    start = (user_index * 5) % len(POSTS)
    return [POSTS[(start + i) % len(POSTS)] for i in range(n)]


@dataclass(frozen=True)
class UserResult:
    user: str
    ranked: tuple[po.Ranked, ...]  # every candidate, best first
    prompt_tokens: int
    cached_tokens: int
    auc: float | None  # P(relevant post ranked above an irrelevant one); None without both kinds


def recommend(users: Sequence[User], n_candidates: int) -> list[UserResult]:
    out = []
    for i, user in enumerate(users):
        posts = candidates(i, n_candidates)
        # Each item binds to `post`, the one parameter the fixed `profile` leaves open.
        ranked = po.rank(will_engage, [p.text for p in posts], label="Yes", profile=user.profile)
        topic = {p.text: p.topic for p in posts}
        results = [r.result for r in ranked if isinstance(r.result, po.Classification)]
        relevant = [r.score for r in ranked if topic[r.item] in user.interests]
        other = [r.score for r in ranked if topic[r.item] not in user.interests]
        out.append(
            UserResult(
                user=user.name,
                ranked=tuple(ranked),
                prompt_tokens=sum(r.prompt_tokens for r in results),
                cached_tokens=sum(r.cached_tokens for r in results),
                auc=pairwise_auc(relevant, other),
            )
        )
    return out


def pairwise_auc(pos: Sequence[float], neg: Sequence[float]) -> float | None:
    if not pos or not neg:
        return None
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def main(argv: Sequence[str] | None = None, *, backend: po.Backend | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="score on a running server instead of the embedded model")
    ap.add_argument("--top-k", type=int, default=5)
    ap.add_argument("--candidates", type=int, default=10, help=f"posts per user (at most {len(POSTS)})")
    args = ap.parse_args(argv)
    if args.top_k < 1 or args.candidates < 1:
        ap.error("--top-k and --candidates must be >= 1")
    if backend is None:
        backend = po.Remote(args.url) if args.url else po.Local("embedded")
    t0 = time.perf_counter()
    try:
        with po.using(backend):  # not po.set_backend: main() leaves no global state behind
            results = recommend(USERS, args.candidates)
    except po.PoLangError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    interests = {u.name: u.interests for u in USERS}
    topics = {p.text: p.topic for p in POSTS}
    for r in results:
        print(f"\n{r.user} (interests: {', '.join(sorted(interests[r.user]))})")
        for rank_no, item in enumerate(r.ranked[: args.top_k], start=1):
            if isinstance(item.result, po.Failed):
                print(f"  {rank_no}. FAILED {item.result.error}  {item.item}")
                continue
            mark = "*" if topics[item.item] in interests[r.user] else " "
            print(f"  {rank_no}. P(Yes)={item.score:.3f} {mark} {item.item}")
        failed = sum(isinstance(x.result, po.Failed) for x in r.ranked)
        auc = "n/a" if r.auc is None else f"{r.auc:.2f}"
        print(
            f"  cached {r.cached_tokens} of {r.prompt_tokens} prompt tokens "
            f"({r.cached_tokens / max(r.prompt_tokens, 1):.0%}); ranking AUC {auc}"
            + (f"; {failed} failed" if failed else "")
        )
    aucs = [r.auc for r in results if r.auc is not None]
    print(
        f"\n* = matches the user's interests. Mean ranking AUC {sum(aucs) / max(len(aucs), 1):.2f}; {elapsed:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
