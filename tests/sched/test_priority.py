"""Request priorities: the scheduler's classes on the simulator (order, enablement, backfill step
sizing, the batch class's starvation credit), and `priority` accepted on every route of a live
server. No timing: the simulator's clock is virtual, the server tests assert answers and state."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

import po_lang as po
from po_backend.compat.sglang import SGLangEngine
from po_backend.core.request import ScoreRequest
from po_backend.core.settings import (
    BACKFILL_ALONE_SHARE,
    BACKFILL_SHARE_BOUNDS,
    BACKFILL_SLO_SHARE,
    DEFAULT_PRIORITY_STEP_S,
    resolve,
)
from po_backend.sched.backfill import BackfillBudget
from po_backend.sched.config import SchedulerConfig
from po_backend.sched.jct import JCTModel
from po_backend.sched.steps import MIN_PREFIX_STEP
from po_backend.sim.radix import RadixLRU
from po_backend.sim.simulator import PrefixLRU, SimRun, simulate
from po_lang.backends import LabelRequest
from po_lang.label.cli import parse_args
from tests.fake_scorer import FakeScorer
from tests.server_utils import ServerProcess, metric

JCT = JCTModel.proxy(seconds_per_ktok=1.0)  # a step costs 1 ms per computed token
TIMEOUT_S = 60.0


def ids(tag: int, n: int) -> tuple[int, ...]:
    return tuple(tag * 100_000 + k for k in range(n))


def req(tag: int, n: int, priority: int | None = None, prefix: tuple[int, ...] = ()) -> ScoreRequest:
    return ScoreRequest(prefix + ids(tag, n), (1,), cache_prefix_len=len(prefix) or None, priority=priority)


def run(
    config: SchedulerConfig, trace: Sequence[tuple[float, ScoreRequest]], pool: int = 10**6
) -> list[SimRun]:
    return simulate(config, JCT, trace, RadixLRU(pool))


def order(runs: Sequence[SimRun]) -> list[int]:
    return [r.rid for r in sorted(runs, key=lambda r: (r.start, r.rid))]


# Same length, no shared prefix: the policy alone cannot tell them apart (ties: arrival order).
PRIOS = [None, 5, -3, 0]
TRACE = [(0.0, req(i + 1, 50, p)) for i, p in enumerate(PRIOS)]


def test_higher_values_first_by_default() -> None:
    cfg = SchedulerConfig("po", enable_priority=True, batch_min_share=0.0)
    assert order(run(cfg, TRACE)) == [1, 0, 3, 2]  # 5, then None and 0 (the default, in arrival order), -3


def test_low_values_first_flag() -> None:
    cfg = SchedulerConfig("po", enable_priority=True, low_priority_first=True, batch_min_share=0.0)
    assert order(run(cfg, TRACE)) == [2, 0, 3, 1]


@pytest.mark.parametrize("policy", ["fcfs", "po"])
def test_priorities_ignored_when_disabled(policy: str) -> None:
    # The long request arrived first and has the highest priority: it still runs by policy.
    trace = [(0.0, req(1, 400, priority=100)), (0.0, req(2, 50, priority=-100))]
    runs = run(SchedulerConfig(policy), trace)
    assert order(runs) == ([0, 1] if policy == "fcfs" else [1, 0])
    on = run(SchedulerConfig(policy, enable_priority=True, batch_min_share=0.0), trace)
    assert order(on) == [0, 1]


def test_srjf_within_a_class() -> None:
    trace = [(0.0, req(1, 400, 3)), (0.0, req(2, 50, 3)), (0.0, req(3, 10, -1)), (0.0, req(4, 200, 3))]
    cfg = SchedulerConfig("po", enable_priority=True, batch_min_share=0.0)
    assert order(run(cfg, trace)) == [1, 3, 0, 2]


def test_class_of_a_request() -> None:
    hi_first = SchedulerConfig(enable_priority=True)
    lo_first = SchedulerConfig(enable_priority=True, low_priority_first=True)
    assert [hi_first.priority_class(req(1, 5, p)) for p in (None, 0, 1, -1)] == ["online"] * 3 + ["batch"]
    assert [lo_first.priority_class(req(1, 5, p)) for p in (None, 0, 1, -1)] == [
        "online",
        "online",
        "batch",
        "online",
    ]
    assert SchedulerConfig().priority_class(req(1, 5, -9)) == "online"  # disabled: one class


def test_settings_reach_the_scheduler() -> None:
    s = resolve(
        "embedded",
        enable_priority_scheduling=True,
        schedule_low_priority_values_first=True,
        online_slo_ms=250,
        batch_min_share=0.2,
    )
    cfg = SchedulerConfig.from_settings(s)
    assert (cfg.enable_priority, cfg.low_priority_first, cfg.online_slo_s, cfg.batch_min_share) == (
        True,
        True,
        0.25,
        0.2,
    )
    assert cfg.needs_jct  # sizing batch steps needs step times, whatever the policy
    assert SchedulerConfig.from_settings(resolve("embedded", schedule_policy="fcfs")).needs_jct is False
    with pytest.raises(ValueError, match="online_slo_ms"):
        resolve("embedded", online_slo_ms=0)
    with pytest.raises(ValueError, match="batch_min_share"):
        resolve("embedded", batch_min_share=1.0)


def batch_backlog(n: int = 10) -> list[tuple[float, ScoreRequest]]:
    """n batch items over one 50-token shared prefix, 20 tokens each."""
    shared = ids(9, 50)
    return [(0.0, req(100 + i, 20, -1, prefix=shared)) for i in range(n)]


def step_times(runs: Sequence[SimRun]) -> list[float]:
    by_step: dict[int, float] = {}
    for r in runs:
        by_step[r.step] = r.end - r.start
    return [by_step[k] for k in sorted(by_step)]


def test_backfill_sizes_batch_steps_to_the_online_target() -> None:
    # Without a target a step takes at most DEFAULT_PRIORITY_STEP_S (0.25 s): all ten share one.
    unsized = run(SchedulerConfig("po", enable_priority=True), batch_backlog())
    assert len(step_times(unsized)) == 1  # all ten share one forward: 250 tokens, 0.25 s
    slo = 0.2
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=slo)
    runs = run(cfg, batch_backlog())
    steps = step_times(runs)
    assert len(runs) == 10 and len(steps) > 1
    assert max(steps) <= slo * BACKFILL_SLO_SHARE + 1e-9
    # An online call arriving during the batch work waits for one step at most.
    online = req(1, 30)
    mixed = run(cfg, [*batch_backlog(), (0.01, online)])
    o = next(r for r in mixed if r.rid == 10)
    assert o.start - o.arrival <= slo * BACKFILL_SLO_SHARE
    # The most urgent class's steps are never trimmed: the target limits less urgent work only.
    online_batch = [(0.0, req(200 + i, 20, None, prefix=ids(8, 50))) for i in range(10)]
    assert len(step_times(run(cfg, online_batch))) == 1


def test_budget_is_the_target_minus_what_online_calls_take() -> None:
    b = BackfillBudget(1.0, window=4)
    assert b.budget_s == BACKFILL_SLO_SHARE  # nothing measured yet
    b.step_done(0.0, 0.6, batch=False, online_arrivals=[0.0])  # 0.6 s alone
    assert b.budget_s == pytest.approx(0.3)  # half of it, within the target's 0.4 s
    # A call that waited 0.5 s on a batch step took 0.2 s of its own: the wait is not counted.
    b.step_done(1.0, 1.5, batch=True, online_arrivals=[])
    b.step_done(1.5, 1.7, batch=False, online_arrivals=[1.0])
    assert b.budget_s == pytest.approx(0.3)  # the slowest own time of the window is still 0.6
    # Online calls that take the whole target leave batch steps their floor; fast ones, half of
    # their own time (their P99 within 1.5x of it).
    b.step_done(2.0, 3.2, batch=False, online_arrivals=[2.0])
    assert b.budget_s == pytest.approx(BACKFILL_SHARE_BOUNDS[0])
    for t in range(4):  # the window moves on: the slow call is forgotten
        b.step_done(10.0 + t, 10.1 + t, batch=False, online_arrivals=[10.0 + t])
    assert b.budget_s == pytest.approx(BACKFILL_ALONE_SHARE * 0.1)
    b.forget_online()  # a more urgent class appeared: back to the initial share
    assert b.budget_s == BACKFILL_SLO_SHARE
    with pytest.raises(ValueError, match="target"):
        BackfillBudget(0.0)


def test_without_a_target_steps_have_a_default_bound() -> None:
    b = BackfillBudget(None, window=4)
    assert b.budget_s == DEFAULT_PRIORITY_STEP_S  # nothing measured yet
    b.step_done(0.0, 0.1, batch=False, online_arrivals=[0.0])
    assert b.budget_s == pytest.approx(BACKFILL_ALONE_SHARE * 0.1)
    # A class that queues behind itself (a backlog at the most urgent priority) cannot grow it.
    b.step_done(0.0, 30.0, batch=False, online_arrivals=[0.0])
    assert b.budget_s == DEFAULT_PRIORITY_STEP_S


def test_budget_shrinks_by_how_much_batch_steps_overrun_their_prediction() -> None:
    b = BackfillBudget(1.0, window=8)
    b.step_done(0.0, 0.6, batch=False, online_arrivals=[0.0])
    assert b.budget_s == pytest.approx(0.3) and b.overrun == 1.0
    b.step_done(1.0, 1.2, batch=True, online_arrivals=[], predicted=0.4)  # faster than priced
    assert b.overrun == 1.0 and b.budget_s == pytest.approx(0.3)  # no credit for over-pricing
    b.step_done(2.0, 2.5, batch=True, online_arrivals=[], predicted=0.25)  # twice as slow
    assert b.overrun == pytest.approx(2.0) and b.budget_s == pytest.approx(0.15)
    b.step_done(3.0, 3.3, batch=True, online_arrivals=[])  # no prediction: not counted
    assert b.overrun == pytest.approx(2.0)
    for t in range(8):  # priced right again: the overrun leaves with the window
        b.step_done(10.0 + t, 10.5 + t, batch=True, online_arrivals=[], predicted=0.5)
    assert b.overrun == 1.0 and b.budget_s == pytest.approx(0.3)


def mixed_trace(online_tokens: int) -> list[tuple[float, ScoreRequest]]:
    """A batch backlog of four 600-token requests and online calls spaced so that they never
    queue behind each other, one of them first."""
    batch = [(0.0, req(50 + i, 600, -1)) for i in range(4)]
    arrivals = [0.0, 0.5, 1.13, 1.71, 2.37, 2.9]
    return [*batch, *((t, req(300 + k, online_tokens)) for k, t in enumerate(arrivals))]


def test_batch_steps_follow_the_measured_online_latency() -> None:
    """Online calls of 0.28 s and a 0.4 s target: a batch step may take 0.12 s, not the initial
    half of the target (0.2 s), after which a call arriving during one would take 0.48 s."""
    slo = 0.4
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=slo)
    runs = run(cfg, mixed_trace(280))
    online = [r for r in runs if r.rid >= 4]
    assert max(r.end - r.arrival for r in online) <= slo + 1e-9
    first = min(r.end for r in online)
    batch_steps = {r.step: r.end - r.start for r in runs if r.rid < 4 and r.start >= first}
    assert len([r for r in runs if r.rid < 4]) == 4  # the backlog finished
    assert batch_steps and max(batch_steps.values()) <= slo - 0.28 + 1e-9
    # Short online calls (0.02 s) shrink the batch steps to half of that, down to the floor of
    # MIN_PREFIX_STEP tokens a step: an online call waits for one such step at most.
    runs = run(cfg, mixed_trace(20))
    assert len([r for r in runs if r.rid < 4]) == 4  # the backlog still finished
    floor = JCT.predict(MIN_PREFIX_STEP, 0)
    assert max(r.start - r.arrival for r in runs if r.rid >= 4) <= floor + 1e-9


def saturated(share: float) -> list[SimRun]:
    """100 online calls of one step each and one batch request, all queued at once."""
    online = [(0.0, req(1000 + k, 100)) for k in range(100)]
    return run(
        SchedulerConfig("po", enable_priority=True, batch_min_share=share), [(0.0, req(1, 100, -5)), *online]
    )


def test_batch_credit_prevents_starvation() -> None:
    strict = saturated(0.0)
    assert order(strict)[-1] == 0  # strict priority: the batch request waits for the whole stream
    runs = saturated(0.1)
    batch = next(r for r in runs if r.rid == 0)
    online_before = [r for r in runs if r.rid != 0 and r.end <= batch.start]
    # It ran on its credit while online work still waited, after the online steps that earned it:
    # 0.1 s of credit at 10% of 0.1 s per online step.
    assert any(r.start >= batch.end for r in runs if r.rid != 0)
    assert len(online_before) == 10


@pytest.mark.parametrize("values", [1, 5, 20])
def test_less_urgent_classes_share_one_minimum_share(values: int) -> None:
    """200 urgent calls (priority 1) and 40 less urgent requests spread over 1, 5 or 20 priority
    values, all of one step of 0.1 s, queued at once: while urgent calls wait, the less urgent ones
    get the one 5% share together (one step in 21), however many values they use."""
    urgent = [(0.0, req(1000 + k, 100, 1)) for k in range(200)]
    low = [(0.0, req(10 + k, 100, -1 - k % values)) for k in range(40)]
    runs = run(SchedulerConfig("po", enable_priority=True, batch_min_share=0.05), [*low, *urgent])
    last_urgent = max(r.start for r in runs if r.rid >= 40)
    during = sorted(r.step for r in runs if r.rid < 40 and r.start < last_urgent)
    # One step after every 20 urgent ones (steps 20, 41, ..., 188): each earns 5% of its 0.1 s.
    assert during == list(range(20, 200, 21))
    assert len([r for r in runs if r.rid < 40]) == 40  # and all of them finish


def test_credit_serves_the_longest_waiting_class() -> None:
    """Three classes: a stream of urgent calls, a middle class that keeps arriving, and one
    least urgent request queued first: the shared credit goes to the longest-waiting best
    request, so the least urgent one runs first, before either stream is done."""
    urgent = [(0.0, req(1000 + k, 100, 1)) for k in range(100)]
    middle = [(0.05 + 0.01 * k, req(3000 + k, 100, 0)) for k in range(100)]
    runs = run(
        SchedulerConfig("po", enable_priority=True, batch_min_share=0.1),
        [(0.0, req(1, 100, -5)), *urgent, *middle],
    )
    low = next(r for r in runs if r.rid == 0)
    first_middle = min(r.start for r in runs if r.rid > 100)
    assert low.start < first_middle
    later = [r for r in runs if r.start >= low.end]
    assert any(r.rid <= 100 for r in later), "the urgent stream was not done"
    assert sum(r.end <= low.start for r in runs) >= 10  # after the urgent steps that earned it


# ---- a live server ---------------------------------------------------------------------------

ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/generate", {"text": "a cat video", "sampling_params": {"max_new_tokens": 0}}),
    ("/v1/completions", {"prompt": "a cat video", "max_tokens": 0}),
    ("/v1/score", {"query": "User: cats\n", "items": ["a cat", "a dog"], "label_token_ids": [5, 6]}),
    ("/generative_scoring", {"query": "User: cats\n", "items": ["a cat"], "label_token_ids": [5, 6]}),
    ("/v1/classify", {"input": ["a cat video", "tax news"]}),
    ("/v1/classify", {"prompt": "a cat video. Answer:", "labels": ["yes", "no"]}),
    ("/v1/classify_labels", {"prompt": ["a cat video. Answer:"], "labels": ["yes", "no"]}),
    ("/v1/rerank", {"query": "cats", "documents": ["a cat", "tax news"]}),
    ("/rerank", {"query": "cats", "documents": ["a cat", "tax news"]}),
    ("/v2/rerank", {"query": "cats", "documents": ["a cat"]}),
]


@pytest.fixture(scope="module")
def url(tokenized_llama: Path) -> Iterator[str]:
    flags = ["--model-path", str(tokenized_llama), "--dtype", "fp32", "--max-input-len", "256"]
    flags += ["--enable-priority-scheduling", "--online-slo-ms", "600000", "--classify-labels", "yes,no"]
    proc = ServerProcess(flags).start()
    try:
        yield proc.wait_ready().url
    finally:
        proc.stop()


SKIP = {"meta_info", "id", "created", "usage", "cached_tokens"}  # timings, call ids, cache state


def close(a: Any, b: Any, path: str = "") -> bool:
    """Equal JSON answers, floats to fp32 tolerance, call ids and timings aside."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) - SKIP
        return keys == set(b) - SKIP and all(close(a[k], b[k]) for k in keys)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-4, abs=1e-6)
    return bool(a == b)


def class_count(url: str, cls: str) -> float:
    return metric(url, f'po_class_queue_time_seconds_count{{priority_class="{cls}"}}', default=0.0)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[f"{p} {sorted(b)[0]}" for p, b in ROUTES])
def test_priority_on_every_route(url: str, path: str, body: dict[str, Any]) -> None:
    before = class_count(url, "batch"), class_count(url, "online")
    low = httpx.post(url + path, json={**body, "priority": -1}, timeout=120.0)
    assert low.status_code == 200, low.text
    after_low = class_count(url, "batch"), class_count(url, "online")
    assert after_low[0] > before[0] and after_low[1] == before[1]  # counted as batch work
    high = httpx.post(url + path, json={**body, "priority": 3}, timeout=120.0)
    assert high.status_code == 200, high.text
    assert class_count(url, "online") > after_low[1]
    # Same prompts, same answers, whatever the priority (the second may read the first's cache).
    assert close(low.json(), high.json())
    bad = httpx.post(url + path, json={**body, "priority": "high"}, timeout=60.0)
    assert bad.status_code in (400, 422) and "priority" in bad.text


@pytest.mark.slow
def test_priority_settings_and_metrics(url: str) -> None:
    info = httpx.get(url + "/server_info", timeout=30.0).json()
    assert info["enable_priority_scheduling"] is True
    assert info["schedule_low_priority_values_first"] is False
    assert info["online_slo_ms"] == 600000
    text = httpx.get(url + "/metrics", timeout=30.0).text
    for series in (
        'po_class_queue_length{priority_class="online"}',
        'po_class_queue_length{priority_class="batch"}',
        "po_online_slo_attainment",
        "po_batch_step_budget_seconds",
        "sglang:queue_time_seconds_count",
    ):
        assert series in text, series
    httpx.post(
        url + "/generate", json={"text": "a dog", "sampling_params": {"max_new_tokens": 0}}, timeout=60.0
    )
    assert metric(url, 'po_online_slo_calls_total{met="true"}', default=0.0) >= 1
    assert metric(url, "po_online_slo_attainment") == 1.0  # a 10-minute target: every call met it
    big = httpx.post(url + "/generate", json={"text": "x", "priority": 2**70}, timeout=60.0)
    assert big.status_code == 400 and "priority" in big.text


# ---- in process and clients ------------------------------------------------------------------


@pytest.mark.parametrize(("low_first", "sent"), [(False, -1), (True, 1)])
def test_remote_low_priority_follows_the_server_order(low_first: bool, sent: int) -> None:
    bodies: list[dict[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json={"schedule_low_priority_values_first": low_first})
        body = json.loads(request.content)
        bodies.append(body)
        item = {"meta_info": {"output_token_ids_logprobs": [[[-0.5, 5, None]]], "prompt_tokens": 3}}
        return httpx.Response(200, json=[item] * len(body["input_ids"]))

    remote = po.Remote("http://po.test", transport=httpx.MockTransport(server), priority="low")
    remote.score([LabelRequest((1, 2, 3), (5,))])
    remote.score([LabelRequest((1, 2, 4), (5,))])
    assert [b["priority"] for b in bodies] == [sent, sent]
    plain = po.Remote("http://po.test", transport=httpx.MockTransport(server))
    plain.score([LabelRequest((1, 2, 3), (5,))])
    assert "priority" not in bodies[-1]
    with pytest.raises(ValueError, match="priority"):
        po.Remote("http://po.test", priority="high")  # type: ignore[arg-type]


def test_label_cli_priority_flag() -> None:
    common = ["rows.jsonl", "--labels", "a,b", "--server", "http://x"]
    assert parse_args(common).priority == "low"
    assert parse_args([*common, "--priority", "-7"]).priority == -7
    with pytest.raises(SystemExit):
        parse_args([*common, "--priority", "high"])


def spy(loop: Any, seen: list[ScoreRequest], monkeypatch: pytest.MonkeyPatch) -> None:
    submit = loop.submit_many

    def record(reqs: Sequence[ScoreRequest]) -> Any:
        seen.extend(reqs)
        return submit(reqs)

    monkeypatch.setattr(loop, "submit_many", record)


def test_in_process_priority(tokenized_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local = po.Local(str(tokenized_llama), priority=-2, dtype="fp32", enable_priority_scheduling=True)
    seen: list[ScoreRequest] = []
    spy(local.loop, seen, monkeypatch)
    (out,) = local.score([LabelRequest((1, 2, 3), (5,))])
    assert not isinstance(out, Exception) and [r.priority for r in seen] == [-2]
    engine = SGLangEngine.from_engine(local.engine, enable_priority_scheduling=True)
    try:
        spy(engine.runtime.loop, seen, monkeypatch)
        engine.score(query=[1, 2], items=[[3], [4]], label_token_ids=[5], priority=4)
        assert [r.priority for r in seen[1:]] == [4, 4]
        assert engine.get_server_info()["enable_priority_scheduling"] is True
    finally:
        engine.shutdown()
        local.close()


def test_batch_prefixes_do_not_evict_online_profiles() -> None:
    """With priority classes, the cache evicts a batch job's prefixes before the online profiles
    its users come back to, even when the batch ones are newer: the online calls after the
    backlog still read their profiles. Without classes (one class: plain LRU), they do not. The
    pool holds both profiles and one batch request's prefix steps (the engine's tree,
    `RadixLRU`: the batch prefix is read back by its own steps, yet goes first)."""
    pool = 200 + 150
    profile = {u: ids(10 + u, 100) for u in (1, 2)}
    online = [req(20 + k, 10, None, profile[1 + k % 2]) for k in range(4)]
    batch = [req(30 + k, 50, -1, ids(40 + k, 100)) for k in range(3)]
    trace = [(0.0, online[0]), (0.0, online[1]), *((0.0, b) for b in batch)]
    trace += [(5.0, online[2]), (5.0, online[3])]
    for enable, hits in ((True, [100, 100]), (False, [0, 0])):
        runs = sorted(
            run(SchedulerConfig("po", enable_priority=enable), trace, pool=pool), key=lambda r: r.rid
        )
        assert all(r.end <= 5.0 for r in runs[:5]), "the backlog ends before the online calls return"
        assert [r.cached for r in runs[5:]] == hits


def test_prefix_lru_gives_a_read_its_class_before_the_step_stores() -> None:
    """As in the engine (every request's prefix is matched before any is stored), a request's
    read gives the prefix it hit its class, not a prefix a batch-mate stored in the same step:
    here an online mate's store evicts the profile a batch request read, and the online prefix
    it stored keeps the online class."""
    profile, other = ids(1, 100), ids(2, 100)
    cache = PrefixLRU(100)
    cache.step([req(3, 5, None, profile)], [0])
    reader, writer = ScoreRequest(profile + ids(4, 5), (1,), priority=-1), req(5, 5, None, other)
    assert cache.step([writer, reader], [0, 1]) == [0, 100]
    assert cache._keys == [other] and cache._rank == [0]


def test_prefix_steps_keep_their_progress_within_the_room_the_online_profiles_leave() -> None:
    """A long batch request's prefix steps keep what they computed until its last step (each
    locks what the last ones cached), but only as far as the pool has room beside the profiles the online
    calls stored lately (`Scheduler.prefix_room`): beyond it they would push those profiles out,
    and each would be recomputed in a long step while the other online calls wait. Its last step
    reads that prefix at the batch class's rank, so it goes before online profiles from then on."""
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=0.2)  # ~100-token batch steps
    profile = {u: ids(10 + u, 100) for u in (1, 2)}
    long = req(1, 300, -1)
    trace = [(0.0, req(20 + u, 10, None, profile[u])) for u in (1, 2)] + [(0.0, long)]
    for capacity, room in ((420, 220), (250, 50)):
        cache = PrefixLRU(capacity)
        runs = sorted(simulate(cfg, JCT, trace, cache), key=lambda r: r.rid)
        assert set(profile.values()) <= set(cache._keys), "the online profiles stayed"
        if room < 64:  # no room for a prefix step: the request ran whole, right after the calls
            assert runs[2].step == 2 and runs[2].cached == 0
            continue
        assert runs[2].step >= 3 and 150 <= runs[2].cached <= room, "it read back its prefix steps"
        hit = [
            i for i, k in enumerate(cache._keys) if len(k) == runs[2].cached and long.input_ids[: len(k)] == k
        ]
        assert len(hit) == 1 and cache._rank[hit[0]] == 1


def test_long_batch_request_runs_in_prefix_steps() -> None:
    """A batch request longer than the sized step computes its prompt over several steps (each
    caching its leading tokens for the next), so an online call waits for one short step."""
    slo = 0.2  # batch steps of at most 0.1 s = 100 tokens at 1 ms per token
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=slo)
    long = req(1, 450, -1)
    runs = run(cfg, [(0.0, long), (0.35, req(2, 30))])
    batch, online = sorted(runs, key=lambda r: r.rid)
    assert online.start - online.arrival <= slo * BACKFILL_SLO_SHARE + 1e-9
    assert batch.step >= 4  # at least 4 prefix steps before its own
    assert batch.cached >= 300 and batch.end - batch.start <= slo * BACKFILL_SLO_SHARE + 1e-9
    # A pool that cannot keep the prefix: it still runs, whole, after a bounded number of tries.
    tiny = run(cfg, [(0.0, long)], pool=10)
    assert len(tiny) == 1 and tiny[0].cached == 0
    # ... and stops trying once a prefix step left nothing cached for it to read (no cache, or
    # too small a one): one wasted step, not one per MIN_PREFIX_STEP tokens.
    assert tiny[0].step <= 1
    # Without a target, a step takes at most DEFAULT_PRIORITY_STEP_S (250 tokens here).
    default = run(SchedulerConfig("po", enable_priority=True), [(0.0, long)])
    assert default[0].step == 1 and default[0].end - default[0].start <= DEFAULT_PRIORITY_STEP_S


def test_prefix_steps_on_the_engine_equal_one_forward(tiny_model: Any) -> None:
    from po_backend.engine.engine import Engine
    from po_backend.serving.loop import EngineLoop

    engine = Engine.from_pretrained(tiny_model("llama")[0], dtype="fp32")
    prompt = ScoreRequest(tuple(3 + (7 * k) % 200 for k in range(300)), (5, 6), priority=-1)
    cold = engine.step([prompt])[0]
    engine.flush_cache()
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=0.2)  # 100 tokens per step
    with EngineLoop(engine, scheduler=cfg, jct=JCT) as loop:
        res = loop.submit(prompt).result()
        steps = loop.step_log()
        assert loop.stats().completed == 1
    assert len(steps) >= 3 and max(n for s in steps for n, _ in s.items) <= 300
    # The first step is sized before any calibration: at most the budget's 100 tokens of the 300.
    (first,) = steps[0].items
    assert first[0] - first[1] <= 100
    assert res.cached_tokens >= 200
    # The loop tells the cache the request's class: what it stored is kept as batch's.
    assert engine.cache is not None
    assert {n.rank for n in engine.cache._nodes() if n is not engine.cache.root} == {1}
    assert res.logprobs == pytest.approx(cold.logprobs, abs=1e-4)


def test_a_prefix_step_counts_its_request_once(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While a prefix step computes a long batch request's first tokens, the request stays in the
    scheduler's queue for its next step; the loop's counts show it once, as running, so queued +
    running stays the number of requests accepted and unanswered."""
    from po_backend.engine.engine import Engine
    from po_backend.serving.loop import EngineLoop

    engine = Engine.from_pretrained(tiny_model("llama")[0], dtype="fp32")
    prompt = ScoreRequest(tuple(3 + (7 * k) % 200 for k in range(300)), (5, 6), priority=-1)
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=0.2)  # 100 tokens per step
    real_step, seen = engine.step, []

    def step(reqs: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> Any:
        seen.append(loop.stats())  # the step runs outside the loop's lock
        return real_step(reqs, ranks)

    monkeypatch.setattr(engine, "step", step)
    with EngineLoop(engine, scheduler=cfg, jct=JCT) as loop:
        loop.submit(prompt).result(60)
    assert len(seen) >= 3, "the request ran in prefix steps"
    assert [(s.queued, s.running, s.queued_by_class["batch"]) for s in seen] == [(0, 1, 0)] * len(seen)


@pytest.mark.parametrize("online_read", [False, True])
def test_cancelled_batch_request_leaves_its_prefix_to_the_batch_class(
    tiny_model: Any, monkeypatch: pytest.MonkeyPatch, online_read: bool
) -> None:
    """A long batch request cancelled between its prefix steps: what they cached is left in the
    batch class (`SchedulerConfig.cache_rank`), as its last step would have left it, not kept
    like an online profile. Where an online call read the step's first tokens meanwhile, those
    stay the online class's (a batch prefix an online call reads is kept as online)."""
    from concurrent.futures import CancelledError as FutureCancelled

    from po_backend.engine.engine import Engine
    from po_backend.serving.loop import EngineLoop

    engine = Engine.from_pretrained(tiny_model("llama")[0], dtype="fp32")
    prompt = ScoreRequest(tuple(3 + (7 * k) % 200 for k in range(300)), (5, 6), priority=-1)
    shared = prompt.input_ids[:48] if online_read else ()
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=0.2)  # 100 tokens per step
    real_step, futs = engine.step, []

    def step(reqs: Sequence[ScoreRequest], ranks: Sequence[int] | None = None) -> Any:
        out = real_step(reqs, ranks)
        if shared:  # the online call reads the step's first tokens
            real_step([ScoreRequest((*shared, 250), (5,), cache_prefix_len=len(shared))], [0])
        futs[0].cancel()  # the request still waits for its next step: cancelling it succeeds
        return out

    monkeypatch.setattr(engine, "step", step)
    with EngineLoop(engine, scheduler=cfg, jct=JCT, start=False) as loop:
        futs.append(loop.submit(prompt))
        loop.start()
        with pytest.raises(FutureCancelled):
            futs[0].result(30)
        loop.call(lambda e: None).result(30)  # anything the cancellation left for the worker ran
    stats = loop.stats()
    assert stats.cancelled == 1 and stats.completed == 0 and stats.steps == 1
    cache = engine.cache
    assert cache is not None
    node, pos, read = cache.root, 0, []
    while pos < len(shared):  # the nodes the online call read
        node = node.children[shared[pos]]
        pos += len(node.key)
        read.append(node)
    rest = [n for n in cache._nodes() if n is not cache.root and n not in read]
    assert sum(len(n.key) for n in (*read, *rest)) >= 64, "the prefix step cached its tokens"
    assert pos == len(shared) and {n.rank for n in read} <= {0}, "what the online call read stays online"
    assert {n.rank for n in rest if n.key[0] != 250} == {1}, "the rest stays the batch class's"
    cache.check_integrity()


@pytest.mark.parametrize("ranks", [[1, 0, 1], [0, 1, 1]])
def test_a_prefix_read_by_both_classes_in_one_step_is_kept_as_online(
    tiny_model: Any, ranks: list[int]
) -> None:
    """A step with items of both classes (a batch head on its credit with online batch-mates):
    the prefix the online call read or stored in it is kept as the online class's, whatever order
    the others stored and read it in (all read it in the same forward)."""
    from po_backend.engine.engine import Engine

    engine = Engine.from_pretrained(tiny_model("llama")[0], dtype="fp32")
    prefix = tuple(3 + (7 * k) % 200 for k in range(80))
    step = [ScoreRequest(prefix + (10 + k, 20 + k), (5,), cache_prefix_len=len(prefix) + 2) for k in range(3)]
    engine.step(step, ranks)  # the first computes the prefix, the others read it from it
    cache = engine.cache
    assert cache is not None and cache.match_len(prefix) == len(prefix)
    node, pos, path = cache.root, 0, []
    while pos < len(prefix):  # the prefix's nodes, read-only
        node = node.children[prefix[pos]]
        pos += len(node.key)
        path.append(node.rank)
    assert pos == len(prefix) and path == [0] * len(path)
    tails = [n.rank for n in cache._nodes() if n is not cache.root and n.parent is node]
    assert sorted(tails) == [0, 1, 1], "each request's own tail keeps its own class"


# ---- a full queue admits a more urgent call ----------------------------------------------------


def test_full_queue_aborts_the_least_urgent_queued_call_over_http() -> None:
    """--max-queue 3 full of priority -1, -2, -1 calls (the loop not started, so they stay queued):
    a priority 5 call aborts the least urgent (-2), the next one the newest -1, each aborted call
    answered 503 with SGLang's message; a call no more urgent than what waits gets the plain full-
    queue 503 and aborts nothing. Then everything admitted is answered."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from po_backend.server import ServerArgs, Settings, create_app
    from po_backend.server.service import LoopService
    from po_backend.serving.loop import ABORTED_BY_PRIORITY, EngineLoop
    from tests.server_utils import error_message, poll_until

    cfg = SchedulerConfig("fcfs", enable_priority=True)
    loop = EngineLoop(FakeScorer(), scheduler=cfg, jct=JCT, max_queue=3, start=False)  # type: ignore[arg-type]
    app = create_app(
        LoopService(FakeScorer(), loop, max_input_len=64), ServerArgs(engine=Settings(model_path="m"))
    )

    def call(client: TestClient, tag: int, priority: int) -> httpx.Response:
        return client.post("/generate", json={"input_ids": [tag, 2, 3], "priority": priority})

    with TestClient(app, raise_server_exceptions=False) as client, ThreadPoolExecutor(8) as pool:
        queued = []
        for n, p in enumerate((-1, -2, -1)):
            queued.append(pool.submit(call, client, 10 + n, p))
            poll_until(lambda n=n: loop.stats().queued == n + 1, f"call {n} queued")
        urgent = [pool.submit(call, client, 20, 5)]
        aborted = queued[1].result(TIMEOUT_S)
        assert aborted.status_code == 503 and ABORTED_BY_PRIORITY in error_message(aborted)
        assert aborted.headers.get("retry-after")
        urgent.append(pool.submit(call, client, 21, 5))
        aborted = queued[2].result(TIMEOUT_S)  # the newer of the two -1 calls
        assert aborted.status_code == 503 and ABORTED_BY_PRIORITY in error_message(aborted)
        # Full of calls at least as urgent as these: refused, nothing aborted.
        for p in (-1, -5):
            full = call(client, 30, p)
            assert full.status_code == 503 and "queue is full" in error_message(full)
        assert not queued[0].done() and loop.stats().queued == 3
        loop.start()
        assert [f.result(TIMEOUT_S).status_code for f in [queued[0], *urgent]] == [200, 200, 200]
    loop.shutdown()
    assert loop.stats().rejected == 4


def test_abort_takes_a_whole_call_and_only_less_urgent_ones() -> None:
    from po_backend.core.errors import OverloadedError
    from po_backend.serving.loop import ABORTED_BY_PRIORITY, EngineLoop

    cfg = SchedulerConfig("fcfs", enable_priority=True)
    loop = EngineLoop(FakeScorer(), scheduler=cfg, jct=JCT, max_queue=4, start=False)  # type: ignore[arg-type]
    batch = loop.submit_many([req(1, 5, -3), req(2, 5, -3)])  # one call of two
    other = [loop.submit(req(3, 5, -1)), loop.submit(req(4, 5, 0))]
    admitted = loop.submit(req(5, 5, 1))  # one place needed: the whole -3 call goes
    for f in batch:
        with pytest.raises(OverloadedError, match=ABORTED_BY_PRIORITY):
            f.result(0)
    assert loop.stats().queued == 3
    with pytest.raises(OverloadedError, match="queue is full"):  # needs two: only one is less urgent
        loop.submit_many([req(6, 5, 0), req(7, 5, 0), req(8, 5, 0)])
    off = EngineLoop(FakeScorer(), scheduler=SchedulerConfig("fcfs"), max_queue=1, start=False)  # type: ignore[arg-type]
    off.submit(req(8, 5, -3))
    with pytest.raises(OverloadedError, match="queue is full"):  # priority scheduling off: no abort
        off.submit(req(9, 5, 9))
    loop.start()
    assert all(f.result(TIMEOUT_S) for f in [*other, admitted])
    loop.shutdown()
    off.shutdown()


@pytest.mark.parametrize("batch_priority", [0, -1])
@pytest.mark.parametrize("slo", [None, 0.2])
def test_a_backlog_queued_before_the_first_online_call_is_sized_for_it(
    batch_priority: int, slo: float | None
) -> None:
    """16 prompts of 1,300 tokens (1.3 s each in one step) queued at t=0, at the default priority
    or below, then 8 short calls at priority 10, 50 ms apart, from t=0.45 (mid-step): the step each
    arrives behind was sized before it came (at most DEFAULT_PRIORITY_STEP_S, or half the target),
    and once the first is measured, at most half of what it takes alone, down to the floor of
    MIN_PREFIX_STEP tokens. The backlog still finishes."""
    batch = [(0.0, req(50 + i, 1300, batch_priority)) for i in range(16)]
    online = [(0.45 + 0.05 * k, req(300 + k, 30, 10)) for k in range(8)]
    runs = run(SchedulerConfig("po", enable_priority=True, online_slo_s=slo), [*batch, *online])
    waits = [r.start - r.arrival for r in sorted(runs, key=lambda r: r.rid) if r.rid >= 16]
    first = DEFAULT_PRIORITY_STEP_S if slo is None else slo * BACKFILL_SLO_SHARE
    alone = JCT.predict(30, 0)
    assert 0 < waits[0] <= first + 1e-9  # it arrived during a sized step
    assert max(waits[1:]) <= max(alone * BACKFILL_ALONE_SHARE, JCT.predict(MIN_PREFIX_STEP, 0)) + 1e-9
    if slo is not None:
        assert max(w + alone for w in waits) <= slo
    assert len([r for r in runs if r.rid < 16]) == 16


def test_prefix_steps_stay_within_the_room_the_most_urgent_class_leaves() -> None:
    """Online calls at priority 10 (more urgent than the default) and a long request at the
    default priority, in a pool that cannot hold the three profiles and its whole prefix: its
    prefix steps go as far as the room the profiles leave (150 tokens), and it reads them back
    instead of running whole in one long step."""
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=0.2)  # ~100-token steps
    profile = {u: ids(10 + u, 100) for u in (1, 2, 3)}
    long = req(1, 300, 0)
    trace = [(0.0, req(20 + u, 10, 10, profile[u])) for u in (1, 2, 3)] + [(0.0, long)]
    trace += [(0.05 * k, req(30 + k, 10, 10, profile[1 + k % 3])) for k in range(1, 12)]
    runs = sorted(simulate(cfg, JCT, trace, RadixLRU(450)), key=lambda r: r.rid)
    assert 100 <= runs[3].cached <= 150, "the long request read back its prefix steps"
    # its last step computes the rest beyond the room: over the step budget, under the whole request
    assert 0.2 * BACKFILL_SLO_SHARE < runs[3].end - runs[3].start < JCT.predict(300, 0) - 0.05


def backlog_in_a_small_pool(
    seed: int,
    target: bool,
    batch_priority: int = 0,
    online_priority: int = 10,
    batch_tokens: tuple[int, int] = (1200, 1400),
    n_batch: int = 16,
) -> dict[str, float]:
    """The issue's trace on the simulator (a CPU's measured step fit): 16 batch prompts of
    1,200-1,400 tokens at the default priority queued at t=0, then 30 online calls at priority
    10 (3 users x 10 posts of 40 tokens on ~300-token profiles, interleaved, Poisson at half their
    capacity), in a pool of 2.2 profiles plus one batch item (bench_mixed's). Returns the online
    P99 over the online calls' P99 alone, batch items/s over batch alone, the batch answered, and
    the longest step of a batch item that ended after the first online call arrived."""
    import random

    import numpy as np

    from po_backend.sim.cluster import LinearStepModel, poisson_arrivals

    model = LinearStepModel((0.038, 0.0, 0.79, 0.36, 0.047))
    rng = random.Random(seed)

    def tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(49152) for _ in range(n))

    profiles = [tokens(rng.randint(263, 337)) for _ in range(3)]
    online = [
        ScoreRequest(p + tokens(40), (1, 2), cache_prefix_len=len(p), priority=online_priority)
        for p in profiles
        for _ in range(10)
    ]
    rng.shuffle(online)
    batch = [
        ScoreRequest(tokens(rng.randint(*batch_tokens)), (1, 2), priority=batch_priority)
        for _ in range(n_batch)
    ]
    pool = int(2.2 * 300) + max(len(r.input_ids) for r in batch)

    def run(cfg: SchedulerConfig, trace: list[tuple[float, ScoreRequest]]) -> list[SimRun]:
        return sorted(simulate(cfg, model, trace, RadixLRU(pool, 16384)), key=lambda r: r.rid)

    iso = run(SchedulerConfig("fcfs"), [(1e6 * i, r) for i, r in enumerate(online)])
    rate = 0.5 / (sum(r.end - r.arrival for r in iso) / len(iso))
    trace = [(t / rate, r) for t, r in zip(poisson_arrivals(len(online), rng), online, strict=True)]
    alone = np.percentile([r.end - r.arrival for r in run(SchedulerConfig("po"), trace)], 99)
    batch_alone = len(batch) / max(r.end for r in run(SchedulerConfig("po"), [(0.0, r) for r in batch]))
    cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=1.5 * alone if target else None)
    runs = run(cfg, [(0.0, r) for r in batch] + trace)
    done = [r for r in runs if r.rid < len(batch)]
    first = min(t for t, _ in trace)
    return {
        "online_p99_vs_alone": float(
            np.percentile([r.end - r.arrival for r in runs if r.rid >= len(batch)], 99) / alone
        ),
        "batch_vs_alone": len(done) / max(r.end for r in done) / batch_alone,
        "batch_answered": len(done),
        "longest_batch_step_s": max(r.end - r.start for r in done if r.end > first),
    }


@pytest.mark.parametrize("target", [True, False])
@pytest.mark.parametrize("shape", ["issue", "bench_mixed"])
def test_online_calls_behind_a_default_priority_backlog_in_a_small_pool(target: bool, shape: str) -> None:
    """With priorities, with or without a latency target, the online calls' P99 stays within
    1.5x of theirs alone and the backlog keeps progressing in steps that stay short. In a pool
    too small for the online profiles and a batch item's prefix steps together (the engine's
    tree, `RadixLRU`), the prefix steps stop at the room the profiles leave, and the item's
    prefix goes before them once its last step has read it. `bench_mixed`: its default trace's
    classes and lengths (10 items of 600-900 tokens at -1, online calls at the default)."""
    kw: dict[str, Any] = {}
    if shape == "bench_mixed":
        kw = {"batch_priority": -1, "online_priority": 0, "batch_tokens": (600, 900), "n_batch": 10}
    for seed in range(12):  # bench_mixed's shape without a target on seed 9: 2.11x before the room
        got = backlog_in_a_small_pool(seed, target, **kw)
        assert got["batch_answered"] == kw.get("n_batch", 16), got
        assert got["batch_vs_alone"] >= 0.5, got
        assert got["longest_batch_step_s"] <= 0.6, got  # the budget, never a whole 1.2k-token item
        assert got["online_p99_vs_alone"] <= 1.5, got


def test_the_most_urgent_class_is_split_only_while_it_is_the_default() -> None:
    """A call too long for the step budget runs in prefix-only steps unless its class is the most
    urgent submitted and more urgent than the default priority: a backlog at the default priority
    queued before any urgent call is still sized for the calls that come after it."""
    from po_backend.sched.scheduler import Scheduler

    s = Scheduler(SchedulerConfig("po", enable_priority=True), JCT)
    assert s.splits(0), "nothing more urgent than the default yet: the default class is split"
    s.add(0, ScoreRequest(ids(1, 8), priority=10))
    assert s.urgent_rank == -10
    assert not s.splits(-10) and s.splits(0) and s.splits(1)


def test_the_default_class_is_not_split_behind_a_less_urgent_backlog() -> None:
    """Online calls at the default priority behind a backlog at -1 (bench_mixed's default trace):
    once a less urgent class was submitted, the default one is the online class, and its calls
    run whole, each in one step. Split into prefix-only steps, a cold profile's call paid a
    step's overhead per piece and waited for the other online calls (shorter, so first) between
    its pieces: online calls at 2-3x their latency alone."""
    from po_backend.sched.scheduler import Scheduler
    from po_backend.sim.cluster import LinearStepModel

    s = Scheduler(SchedulerConfig("po", enable_priority=True), JCT)
    s.add(0, ScoreRequest(ids(1, 8), priority=0))
    assert s.splits(0), "the default class alone is a backlog that may yet be overtaken"
    s.add(1, ScoreRequest(ids(2, 8), priority=-1))
    assert not s.splits(0) and s.splits(1)

    model = LinearStepModel((0.038, 0.0, 0.79, 0.36, 0.047))
    batch = [(0.0, req(100 + i, 800, -1)) for i in range(6)]
    online = [(0.05 + 1.5 * k, req(200 + k, 450, 0)) for k in range(3)]  # unrelated, cold
    for slo in (0.9, None):
        cfg = SchedulerConfig("po", enable_priority=True, online_slo_s=slo)
        runs = sorted(simulate(cfg, model, batch + online, RadixLRU(2000, 16384)), key=lambda r: r.rid)
        assert len(runs) == 9
        one_step = model.predict_items([(450, 0)])
        for r in runs[6:]:
            assert r.cached == 0, f"online call {r.rid} read its own prefix steps back: it was split"
            assert r.end - r.start == pytest.approx(one_step)
