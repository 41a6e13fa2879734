"""Credit verification on long transaction histories (the paper's WL2 shape, scaled down).

    python examples/credit_check.py                      # the embedded model, in process
    python examples/credit_check.py --url http://127.0.0.1:30000 --users 12

Each applicant's history is a few hundred to ~1.5k tokens of synthetic bank transactions,
generated deterministically (steady earners and risky ones: overdrafts, payday loans, gambling,
returned payments). The lending policy is the shared prefix of every request. The labels
"approve" / "deny" are two tokens each after the chat template, so they are scored with
`multi_token=True`: each label's full continuation in the same prefill, no decoding. Prints
P(approve) raw and with content-free calibration, and whether it separates the two kinds.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date, timedelta

import po_lang as po

POLICY = (
    "You are a loan officer at a retail bank. You review an applicant's recent bank transactions "
    "and decide whether to approve a small personal loan. Approve applicants with a regular "
    "income, a positive balance and regular savings. Deny applicants with overdrafts, returned "
    "payments, payday loans or gambling.\n\n"
)

GOOD_DEBITS = (
    ("GROCERY STORE", 20, 120),
    ("ELECTRICITY BILL", 40, 90),
    ("PHONE CONTRACT", 15, 40),
    ("PHARMACY", 5, 30),
    ("TRAIN TICKET", 3, 25),
    ("BOOKSHOP", 8, 35),
    ("CAFE", 3, 12),
)
RISKY_DEBITS = (
    ("ONLINE CASINO", 50, 400),
    ("SPORTS BETTING", 20, 250),
    ("PAYDAY LOAN REPAYMENT", 150, 450),
    ("OVERDRAFT FEE", 25, 35),
    ("RETURNED PAYMENT FEE", 15, 30),
    ("CASH WITHDRAWAL", 100, 300),
    ("FAST FOOD", 5, 25),
)


@dataclass(frozen=True)
class Applicant:
    name: str
    risky: bool  # how the history was generated (the ground truth)
    history: str


def make_history(rng: random.Random, *, risky: bool, n: int) -> str:
    """`n` transactions over consecutive days with a running balance; risky histories have
    irregular income, risky spending and a balance that goes negative."""
    day = date(2024, 1, 2)
    balance = rng.uniform(-200, 300) if risky else rng.uniform(1500, 4000)
    lines = []
    for i in range(n):
        day += timedelta(days=rng.randint(1, 2))
        if not risky and i % 10 == 0:
            desc, amount = "SALARY ACME LTD", rng.uniform(2300, 2600)
        elif not risky and i % 10 == 5:
            desc, amount = "TRANSFER TO SAVINGS", -rng.uniform(200, 400)
        elif risky and rng.random() < 0.12:
            desc, amount = rng.choice(("PAYDAY LOAN QUICKCASH", "GIG WORK PAYOUT")), rng.uniform(150, 600)
        else:
            table = RISKY_DEBITS if risky and rng.random() < 0.6 else GOOD_DEBITS
            desc, lo, hi = rng.choice(table)
            amount = -rng.uniform(lo, hi)
        balance += amount
        lines.append(f"{day.isoformat()} {desc:<24s} {amount:+9.2f} balance {balance:+10.2f}")
    return "\n".join(lines)


def applicants(n: int, seed: int = 0) -> list[Applicant]:
    """`n` applicants alternating steady / risky, histories of 12 to 45 transactions."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        risky = i % 2 == 1
        out.append(
            Applicant(f"applicant-{i + 1:02d}", risky, make_history(rng, risky=risky, n=rng.randint(12, 45)))
        )
    return out


@po.classify(labels=["approve", "deny"], chat=True, multi_token=True, calibrate="content-free")
def decide(history: str) -> po.Prompt:
    """Approve or deny a loan from a transaction history (content-free: history -> "N/A")."""
    return (
        po.shared(POLICY)
        + f"Transactions:\n{history}\n\nShould the bank approve or deny the loan? Answer approve or deny."
    )


@dataclass(frozen=True)
class Decision:
    applicant: Applicant
    result: po.Classification | po.Failed

    @property
    def raw_approve(self) -> float:
        """P(approve) from the uncalibrated label scores."""
        if isinstance(self.result, po.Failed):
            return math.nan
        a, d = self.result.logprobs["approve"], self.result.logprobs["deny"]
        return 1.0 / (1.0 + math.exp(d - a))

    @property
    def approve(self) -> float:
        return math.nan if isinstance(self.result, po.Failed) else self.result.probs["approve"]


def check(people: Sequence[Applicant]) -> list[Decision]:
    results = decide.map([{"history": a.history} for a in people])
    return [Decision(a, r) for a, r in zip(people, results, strict=True)]


def separation(decisions: Sequence[Decision]) -> float | None:
    """P(a steady applicant gets a higher P(approve) than a risky one): a ranking AUC."""
    good = [d.approve for d in decisions if not d.applicant.risky and not math.isnan(d.approve)]
    bad = [d.approve for d in decisions if d.applicant.risky and not math.isnan(d.approve)]
    if not good or not bad:
        return None
    return sum((g > b) + 0.5 * (g == b) for g in good for b in bad) / (len(good) * len(bad))


def main(argv: Sequence[str] | None = None, *, backend: po.Backend | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="score on a running server instead of the embedded model")
    ap.add_argument("--users", type=int, default=6, help="applicants (alternating steady / risky)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic histories")
    args = ap.parse_args(argv)
    if args.users < 1:
        ap.error("--users must be >= 1")
    if backend is None:
        backend = po.Remote(args.url) if args.url else po.Local("embedded")
    people = applicants(args.users, args.seed)
    t0 = time.perf_counter()
    try:
        with po.using(backend):
            decisions = check(people)
    except po.PoLangError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - t0
    print(
        f"{'applicant':<14s} {'kind':<7s} {'tokens':>6s} {'P(approve) raw':>15s} {'calibrated':>11s}  decision"
    )
    tokens = 0
    for d in decisions:
        kind = "risky" if d.applicant.risky else "steady"
        if isinstance(d.result, po.Failed):
            print(f"{d.applicant.name:<14s} {kind:<7s} FAILED: {d.result.error}")
            continue
        tokens += d.result.prompt_tokens
        print(
            f"{d.applicant.name:<14s} {kind:<7s} {d.result.prompt_tokens:6d} {d.raw_approve:15.3f} "
            f"{d.approve:11.3f}  {d.result.label}"
        )
    sep = separation(decisions)
    print(
        f"\nsteady-vs-risky ranking AUC: {'n/a' if sep is None else f'{sep:.2f}'}; "
        f"{tokens} prompt tokens in {elapsed:.1f}s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
