"""The scheduler's settings: the policy, its fairness and sharing knobs, and the priority classes
(which class a request is in, and in what order the classes run)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from po_backend.core.settings import (
    DEFAULT_BATCH_MIN_SHARE,
    DEFAULT_FAIRNESS_LAMBDA,
    DEFAULT_MIN_SHARED_PREFIX,
    DEFAULT_PRIORITY,
    SCHEDULER_FIELDS,
    check_priority,
    check_scheduler,
)
from po_backend.sched.batching import Request

CLASSES = ("online", "batch")  # the default priority or more urgent; less urgent


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "po"
    fairness_lambda: float = DEFAULT_FAIRNESS_LAMBDA
    min_shared_prefix: int = DEFAULT_MIN_SHARED_PREFIX  # see core.settings
    # Priority classes (core.settings: enable_priority_scheduling and the three after it)
    enable_priority: bool = False
    low_priority_first: bool = False
    online_slo_s: float | None = None
    batch_min_share: float = DEFAULT_BATCH_MIN_SHARE

    def __post_init__(self) -> None:
        check_scheduler(self.policy, self.fairness_lambda, self.min_shared_prefix)
        check_priority(None if self.online_slo_s is None else self.online_slo_s * 1e3, self.batch_min_share)

    def rank(self, req: Request) -> int:
        """A request's class, lower runs first: its priority in the configured order (0 for the
        default priority, and for every request with priority scheduling off)."""
        return self.rank_of(req.priority) if self.enable_priority else 0

    def cache_rank(self, req: Request) -> int:
        """The class the prefix cache keeps what `req` stores and reads under (less urgent first
        out): its rank, a prefix step's (`Pick.prefix_request`) included. The engine's tree holds
        a long request's prefix steps as one segment each and evicts a leaf at a time, so an
        urgent call short of room takes only the last segments, which the request's last step
        computes again; kept above the urgent class instead, they push the urgent calls' own
        profiles out, each then recomputed in a long step while the others wait
        (`Scheduler.prefix_room` bounds them either way)."""
        return self.rank(req)

    def rank_of(self, priority: int | None) -> int:
        if not self.enable_priority:
            return 0
        p = DEFAULT_PRIORITY if priority is None else priority
        return p - DEFAULT_PRIORITY if self.low_priority_first else DEFAULT_PRIORITY - p

    def class_of(self, priority: int | None) -> str:
        """The class of a priority: online (the default priority or more urgent) or batch (less
        urgent); online for every priority with priority scheduling off."""
        return CLASSES[self.rank_of(priority) > 0]

    def priority_class(self, req: Request) -> str:
        return self.class_of(req.priority) if self.enable_priority else CLASSES[0]

    @classmethod
    def from_settings(cls, s: Any) -> SchedulerConfig:
        """The scheduler part of a `core.settings.Settings`."""
        slo = s.online_slo_ms  # the one scheduler setting in other units
        given = {ours: getattr(s, name) for name, ours in SCHEDULER_FIELDS.items()}
        return cls(**given, online_slo_s=None if slo is None else slo / 1e3)

    @property
    def needs_jct(self) -> bool:
        """fcfs and lpm order without predicting step times; srjf and po need a JCT model, and so
        does sizing steps with priority scheduling on."""
        return self.policy not in ("fcfs", "lpm") or self.sizes_batch_steps

    @property
    def sizes_batch_steps(self) -> bool:
        """With priority scheduling on every step is sized (`backfill.BackfillBudget`): a more
        urgent call may arrive during any of them."""
        return self.enable_priority
