"""Seeded synthetic workloads shaped like the PrefillOnly paper's, scaled for a 2-core CPU. WL1 (post
recommendation): users with long profiles, each scored against many ~150-token posts; prompt =
profile + history + question (the shared prefix) + post + "Your answer is:"; labels Yes/No. WL2
(credit verification): one long transaction history per user, one request each. Text comes from
small word lists so token counts are realistic for a BPE tokenizer."""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

TOPICS = (
    "hiking coffee jazz football cooking startups gardening photography chess travel robotics painting "
    "cycling history fashion gaming"
).split()
WORDS = (
    "the a of to and in is was for on with as by at from that this it are be or an have has not "
    "new post user likes shares comments reads week month city local team project open source "
    "review guide tips story video photo update event today best great small quick easy deep "
    "morning evening weekend trip market price recipe garden match score album book film game"
).split()
QUESTION = "\nQuestion: will this user engage with the following post? Answer Yes or No.\n"
MERCHANTS = "grocery,fuel,rent,salary,restaurant,online shop,pharmacy,utilities,travel".split(",")


@dataclass(frozen=True)
class Item:
    """One scoring request: `prefix` is the part shared with other requests of the same user."""

    user: int
    index: int
    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @property
    def ids(self) -> tuple[int, ...]:
        return self.prefix + self.suffix


def _sentence(rng: random.Random, topic: str) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 16))]
    words.insert(rng.randrange(len(words)), topic)
    return " ".join(words).capitalize() + "."


def _transaction(rng: random.Random) -> str:
    return f"{rng.randint(1, 28):02d}/{rng.randint(1, 12):02d} {rng.choice(MERCHANTS)} {rng.uniform(-900, 3000):.2f} EUR;"


def _ids(tok: Any, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _text(tok: Any, n_tokens: int, make: Callable[[], str]) -> list[int]:
    """Token ids of text made sentence by sentence by `make`, cut to exactly n_tokens."""
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids.extend(_ids(tok, " " + make()))
    return ids[:n_tokens]


def label_ids(tok: Any) -> tuple[int, int]:
    """' Yes' / ' No' after "Your answer is:" (plain text: the label carries a leading space)."""
    return _ids(tok, " Yes")[0], _ids(tok, " No")[0]


def wl1(
    tok: Any,
    users: int = 8,
    items: int = 20,
    profile_mean: int = 3000,
    profile_std: int = 600,
    profile_range: tuple[int, int] = (2000, 4000),
    item_tokens: int = 150,
    seed: int = 0,
) -> list[Item]:
    """Post recommendation: `users` x `items` requests, grouped by user in that order."""
    rng = random.Random(seed)
    out: list[Item] = []
    for u in range(users):
        likes = rng.sample(TOPICS, 3)
        n_profile = int(min(max(rng.gauss(profile_mean, profile_std), profile_range[0]), profile_range[1]))
        head = _ids(tok, f"User {u} profile. Interests: {', '.join(likes)}.\nHistory:")
        body = _text(tok, n_profile - len(head), lambda likes=likes: _sentence(rng, rng.choice(likes)))
        prefix = tuple(head + body + _ids(tok, QUESTION))
        for i in range(items):
            topic = rng.choice(TOPICS)
            post, tail = _ids(tok, f"Post about {topic}:"), _ids(tok, "\nYour answer is:")
            text = _text(tok, item_tokens - len(post) - len(tail), lambda t=topic: _sentence(rng, t))
            out.append(Item(u, i, prefix, tuple(post + text + tail)))
    return out


def wl2(
    tok: Any, users: int = 12, history_range: tuple[int, int] = (4000, 7500), seed: int = 1
) -> list[Item]:
    """Credit verification: one long, unique transaction history per user (nothing shared)."""
    rng = random.Random(seed)
    out: list[Item] = []
    for u in range(users):
        n = rng.randint(*history_range)
        head = _ids(tok, f"Customer {u} transaction history:")
        tail = _ids(tok, "\nShould this customer's credit application be approved? Your answer is:")
        body = _text(tok, n - len(head) - len(tail), lambda: _transaction(rng))
        out.append(Item(u, 0, (), tuple(head + body + tail)))
    return out


def build_traces(
    args: argparse.Namespace, tok: Any, wanted: tuple[str, ...] = ("WL1", "WL2")
) -> dict[str, list[Item]]:
    """The workloads in `wanted`, sized by bench_schedule's `--wl1-*` / `--wl2-*` flags."""
    out: dict[str, list[Item]] = {}
    if "WL1" in wanted:
        mean, span = args.wl1_profile, (int(args.wl1_profile * 0.8), int(args.wl1_profile * 1.2))
        out["WL1"] = wl1(tok, args.wl1_users, args.wl1_items, mean, mean // 8, span, args.wl1_item_tokens)
    if "WL2" in wanted:
        out["WL2"] = wl2(tok, args.wl2_requests, (args.wl2_min, args.wl2_max))
    return out
