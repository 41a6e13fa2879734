"""The engine loop on a tiny random model: same answers as `engine.run`, thread safety,
cancellation, overload, shutdown, step errors and the asyncio wrapper. Nothing here depends on
how fast the machine is: waits are on futures and events, with generous timeouts."""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import CancelledError as FutureCancelled
from concurrent.futures import Future, wait

import pytest

from po_backend import Engine, OverloadedError, ScoreRequest
from po_backend.core.errors import CancelledError, EmptyPromptError, InvalidTokenError
from po_backend.sched.jct import CalibratedJCT, JCTModel, JCTSample
from po_backend.serving import jct_profile as jct_mod
from po_backend.serving import jct_store
from po_backend.serving.jct_profile import ProfileGrid
from po_backend.serving.loop import EngineLoop, LoopClosedError

LABELS = (3, 17, 101)
TOL = 1e-5
TIMEOUT = 30.0  # only hit when something hangs
JCT = JCTModel.proxy(1.0, 0.1)


@pytest.fixture(scope="module")
def model_path(tiny_model):
    return tiny_model("llama")[0]


@pytest.fixture(scope="module")
def shared_engine(model_path) -> Engine:
    # One engine for the module (building one costs seconds, mostly its profile run); each test
    # gets it with an empty cache and must shut its loops down.
    return Engine.from_pretrained(model_path, dtype="fp32", chunk_size=32, max_input_len=512)


@pytest.fixture
def eng(shared_engine: Engine):
    shared_engine.flush_cache()
    yield shared_engine
    assert shared_engine.cache is not None
    shared_engine.cache.check_integrity()
    assert shared_engine.cache.protected_size() == 0, "a prefix lock leaked"


def _rand(n: int, rng: random.Random) -> tuple[int, ...]:
    return tuple(rng.randrange(300) for _ in range(n))


def _workload(seed: int = 0, users: int = 3, items: int = 4) -> list[ScoreRequest]:
    """Users x items with a shared per-user prefix, shuffled like arrivals."""
    rng = random.Random(seed)
    reqs = []
    for _ in range(users):
        prefix = _rand(rng.randint(40, 120), rng)
        reqs += [
            ScoreRequest(
                prefix + _rand(rng.randint(5, 30), rng), LABELS, top_k=2, cache_prefix_len=len(prefix)
            )
            for _ in range(items)
        ]
    reqs.append(ScoreRequest(_rand(60, rng), LABELS, top_k=2))
    rng.shuffle(reqs)
    return reqs


@pytest.mark.parametrize("policy", ["po", "fcfs", "srjf", "lpm"])
def test_results_equal_engine_run(eng: Engine, policy: str) -> None:
    reqs = _workload()
    expected = eng.run(reqs)
    eng.flush_cache()
    with EngineLoop(eng, policy=policy, jct=JCT, start=False) as loop:
        futs = loop.submit_many(reqs)
        loop.start()
        got = [f.result(TIMEOUT) for f in futs]
    for a, b in zip(got, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOL
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    st = loop.stats()
    assert st.completed == len(reqs) and st.queued == 0 and st.running == 0 and st.failed == 0
    if policy == "po":
        # All queued at once: each user's prefix is computed once, its other items ride on it.
        assert st.steps < len(reqs) and st.mean_batch_items > 1
        assert sum(r.cached_tokens > 0 for r in got) >= 9
    assert 0 < st.cache_hit_rate < 1 and st.jct_calibration > 0


def test_undeclared_shared_prefixes_are_computed_once(eng: Engine) -> None:
    """/generate traffic declares no prefix. Each user's profile, shared by their waiting requests,
    is computed once: one multi-item step per user, the others read it from the first item. The
    few template tokens every prompt starts with never group different users into one step."""
    rng = random.Random(5)
    template = (1, 2, 3)  # "User: ": shared by everyone, far below min_shared_prefix
    users, items = 4, 5
    profiles = [template + _rand(100, rng) for _ in range(users)]
    reqs = [
        ScoreRequest(p + _rand(rng.randint(8, 20), rng), LABELS, top_k=2)
        for p in profiles
        for _ in range(items)
    ]
    order = list(range(len(reqs)))
    rng.shuffle(order)
    expected = []
    for r in reqs:  # cold, one at a time
        eng.flush_cache()
        expected.append(eng.run([r])[0])
    eng.flush_cache()
    with EngineLoop(eng, policy="po", jct=JCT, start=False) as loop:
        futs = dict(zip(order, loop.submit_many([reqs[i] for i in order]), strict=True))
        loop.start()
        got = [futs[i].result(TIMEOUT) for i in range(len(reqs))]
    for a, b in zip(got, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOL
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
    assert loop.stats().steps == users
    for u in range(users):
        cached = sorted(r.cached_tokens for r in got[u * items : (u + 1) * items])
        # The first computes the profile (after at most the template, cached by another user).
        assert cached[0] <= len(template) and all(c >= len(profiles[u]) for c in cached[1:]), (u, cached)


def test_many_threads_submit_and_cancel(eng: Engine) -> None:
    loop = EngineLoop(eng, policy="po", jct=JCT, max_queue=10_000)
    futures: list[Future] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(15):
                batch = [
                    ScoreRequest(
                        _rand(rng.randint(2, 80), rng), LABELS, cache_prefix_len=rng.choice([None, 1])
                    )
                    for _ in range(rng.randint(1, 3))
                ]
                futs = loop.submit_many(batch)
                for f in futs:
                    if rng.random() < 0.4:
                        (f.cancel if rng.random() < 0.5 else lambda f=f: loop.cancel(f))()
                with lock:
                    futures.extend(futs)
        except BaseException as e:  # surfaced below: a thread's exception is otherwise lost
            errors.append(e)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
        assert not t.is_alive(), "a submitting thread hung"
    assert not errors, errors
    done, not_done = wait(futures, timeout=TIMEOUT)
    assert not not_done, f"{len(not_done)} futures never completed"
    n_cancelled = sum(f.cancelled() for f in futures)
    results = [f.result() for f in futures if not f.cancelled()]
    assert all(len(r.logprobs) == len(LABELS) for r in results)
    loop.shutdown(drain=True, timeout=TIMEOUT)
    st = loop.stats()
    assert st.submitted == len(futures)
    assert st.completed == len(results) and st.cancelled == n_cancelled and st.failed == 0
    assert st.queued == 0 and st.running == 0


def test_overload_is_a_clear_error(eng: Engine) -> None:
    loop = EngineLoop(eng, jct=JCT, max_queue=3, start=False)
    reqs = [ScoreRequest(tuple(range(10 + k, 30 + k)), LABELS) for k in range(5)]
    futs = [loop.submit(reqs[0]), loop.submit(reqs[1])]
    with pytest.raises(OverloadedError, match="max_queue=3"):
        loop.submit_many(reqs[2:4])  # all or nothing: two do not fit
    futs.append(loop.submit(reqs[2]))
    with pytest.raises(OverloadedError):
        loop.submit(reqs[3])
    assert futs[0].cancel()  # a cancelled request frees its place
    futs.append(loop.submit(reqs[3]))
    assert loop.stats().rejected == 3 and loop.stats().queued == 3
    loop.start()
    assert all(len(f.result(TIMEOUT).logprobs) == 3 for f in futs[1:])
    loop.shutdown()


def test_invalid_requests_raise_at_submit(eng: Engine) -> None:
    loop = EngineLoop(eng, jct=JCT, start=False)
    with pytest.raises(EmptyPromptError):
        loop.submit(ScoreRequest((), LABELS))
    with pytest.raises(InvalidTokenError):
        loop.submit_many([ScoreRequest((1, 2), LABELS), ScoreRequest((1, 999), LABELS)])
    assert loop.stats().queued == 0 and loop.stats().submitted == 0
    loop.shutdown()


def test_shutdown_without_drain_fails_queued_requests(eng: Engine) -> None:
    loop = EngineLoop(eng, jct=JCT, start=False)
    futs = loop.submit_many([ScoreRequest(tuple(range(5, 25 + k)), LABELS) for k in range(4)])
    loop.shutdown(drain=False)
    for f in futs:
        with pytest.raises(CancelledError, match="shut down"):
            f.result(TIMEOUT)
    with pytest.raises(LoopClosedError):
        loop.submit(ScoreRequest((1, 2, 3), LABELS))
    assert loop.stats().cancelled == 4


def test_shutdown_with_drain_finishes_everything(eng: Engine) -> None:
    loop = EngineLoop(eng, jct=JCT, start=False)
    futs = loop.submit_many(_workload(seed=2))
    loop.shutdown(drain=True)
    assert all(f.done() and not f.cancelled() and f.exception() is None for f in futs)
    assert not loop._thread.is_alive()


def test_running_step_completes_when_shutdown_does_not_drain(eng: Engine, monkeypatch) -> None:
    real_step, entered, release = eng.step, threading.Event(), threading.Event()

    def blocking_step(reqs, ranks=None):
        entered.set()
        assert release.wait(TIMEOUT), "test never released the step"
        return real_step(reqs, ranks)

    monkeypatch.setattr(eng, "step", blocking_step)
    loop = EngineLoop(eng, policy="fcfs", jct=JCT)
    first = loop.submit(ScoreRequest(tuple(range(5, 40)), LABELS))
    assert entered.wait(TIMEOUT)
    queued = loop.submit(ScoreRequest(tuple(range(50, 90)), LABELS))
    assert not first.cancel(), "a running request cannot be cancelled"
    stopper = threading.Thread(target=loop.shutdown, kwargs={"drain": False})
    stopper.start()
    with pytest.raises(CancelledError):
        queued.result(TIMEOUT)  # failed while the step is still running
    release.set()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    assert len(first.result(TIMEOUT).logprobs) == 3


def test_step_error_reaches_every_request_of_the_step(eng: Engine, monkeypatch) -> None:
    real_step = eng.step
    poison = 299

    def step(reqs, ranks=None):
        if any(r.input_ids[-1] == poison for r in reqs):
            raise RuntimeError("boom")
        return real_step(reqs, ranks)

    monkeypatch.setattr(eng, "step", step)
    prefix = tuple(range(100, 160))
    warm = ScoreRequest(prefix + (1, 2), LABELS, cache_prefix_len=len(prefix))
    items = [
        ScoreRequest(prefix + (7, k, poison if k == 2 else 9), LABELS, cache_prefix_len=60) for k in range(4)
    ]
    other = ScoreRequest(tuple(range(200, 290)), LABELS)
    loop = EngineLoop(eng, policy="po", jct=JCT)
    loop.submit(warm).result(TIMEOUT)  # caches the prefix: the items then share one step
    loop.shutdown()
    loop = EngineLoop(eng, policy="po", jct=JCT, start=False)
    futs = loop.submit_many([*items, other])
    loop.start()
    for f in futs[:4]:
        with pytest.raises(RuntimeError, match="boom"):
            f.result(TIMEOUT)
    assert len(futs[4].result(TIMEOUT).logprobs) == 3  # the loop goes on
    after = loop.submit(ScoreRequest(prefix + (5,), LABELS)).result(TIMEOUT)
    assert after.cached_tokens == len(prefix)
    st = loop.stats()
    assert st.failed == 4 and st.completed == 2
    loop.shutdown()


def test_asyncio_wrapper(eng: Engine) -> None:
    loop = EngineLoop(eng, jct=JCT, start=False)
    reqs = _workload(seed=3, users=2, items=2)

    async def main() -> None:
        task = asyncio.ensure_future(loop.score(reqs[0]))
        await asyncio.sleep(0)  # submitted, waiting (the worker is not started)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert loop.stats().queued == 0 and loop.stats().cancelled == 1
        loop.start()
        results = await asyncio.gather(*(loop.score(r) for r in reqs))
        assert all(len(r.logprobs) == 3 for r in results)
        many = await loop.score_many(reqs[:2])
        assert [r.prompt_tokens for r in many] == [len(r.input_ids) for r in reqs[:2]]

    asyncio.run(main())
    loop.shutdown()


def test_flush_cache_and_call_run_on_the_worker(eng: Engine) -> None:
    with EngineLoop(eng, jct=JCT) as loop:
        prefix = tuple(range(10, 80))
        loop.submit(ScoreRequest(prefix + (1,), LABELS, cache_prefix_len=70)).result(TIMEOUT)
        assert loop.call(lambda e: e.cached_len(ScoreRequest(prefix + (2,), LABELS))).result(TIMEOUT) == 70
        loop.flush_cache(TIMEOUT)
        assert loop.call(lambda e: e.cached_len(ScoreRequest(prefix + (2,), LABELS))).result(TIMEOUT) == 0
        with pytest.raises(ZeroDivisionError):
            loop.call(lambda e: 1 / 0).result(TIMEOUT)


def test_default_jct_is_profiled_once_and_persisted(eng: Engine, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PREFILLONLY_JCT_CACHE", str(tmp_path / "jct"))
    real_profile = jct_mod.profile

    def profile(engine, grid):
        # Run the real profiler on a small grid (it must work on this engine) but fit on clean
        # synthetic times: a tiny model's timings are noise and must pass the persistence bar.
        samples = real_profile(
            engine,
            ProfileGrid(lengths=(32, 64), cached_fractions=(0.5,), batches=((2, 32, 16),), long_points=0),
        )
        assert len(samples) == 6
        return [JCTSample(s.items, 1e-3 + 1e-4 * sum(n - c for n, c in s.items)) for s in samples]

    monkeypatch.setattr(jct_mod, "profile", profile)
    loop = EngineLoop(eng, jct=jct_mod.startup_jct(eng, "po"), start=False)
    q = loop.stats()
    assert q.jct_fit_r == q.jct_fit_r and len(list((tmp_path / "jct").glob("*.json"))) == 1
    loop.shutdown()
    again = EngineLoop(eng, jct=jct_mod.startup_jct(eng, "po"), start=False)
    assert again.jct.model == loop.jct.model
    again.shutdown()


def test_constructing_a_loop_measures_nothing(eng: Engine, monkeypatch) -> None:
    """The JCT model is built before the loop (the runtime factory does it): a policy that needs
    one and gets none is a ValueError, not a profile run behind the constructor's back."""

    def no_profile(*a, **k):
        raise AssertionError("a loop's constructor may not time anything")

    monkeypatch.setattr(jct_mod, "profile", no_profile)
    monkeypatch.setattr(jct_mod, "startup_jct", no_profile)
    for policy in ("po", "srjf"):
        with pytest.raises(ValueError, match="needs a JCT model"):
            EngineLoop(eng, policy=policy, start=False)


def test_cancelled_future_is_not_an_error(eng: Engine) -> None:
    loop = EngineLoop(eng, jct=JCT, start=False)
    f = loop.submit(ScoreRequest((1, 2, 3), LABELS))
    assert loop.cancel(f)
    with pytest.raises(FutureCancelled):
        f.result(0)
    loop.shutdown()
    assert loop.stats().cancelled == 1 and loop.stats().failed == 0


def test_calibration_carries_over_to_the_next_loop(eng: Engine) -> None:
    """A CalibratedJCT handed to a loop is used as is: what one loop learned, the next starts from."""
    cal = CalibratedJCT(JCT)
    reqs = _workload(users=1, items=3)
    with EngineLoop(eng, policy="fcfs", jct=cal) as loop:
        for r in reqs:
            loop.submit(r).result()  # one at a time: one step each
        assert loop.jct is cal
    learned = (cal.observations, cal.factor)
    assert learned[0] == len(reqs) and learned[1] != 1.0
    with EngineLoop(eng, policy="fcfs", jct=cal) as loop:
        assert loop.jct is cal and loop.stats().jct_calibration == learned[1]


def test_fcfs_and_lpm_loops_run_no_profile(eng: Engine, monkeypatch) -> None:
    def no_profile(*a, **k):
        raise AssertionError("fcfs and lpm need no JCT model: nothing may be profiled")

    monkeypatch.setattr(jct_mod, "profile", no_profile)
    monkeypatch.setattr(jct_store, "load_jct_model", no_profile)
    reqs = _workload(users=2, items=2)
    for policy in ("fcfs", "lpm"):
        with EngineLoop(eng, policy=policy) as loop:
            results = [f.result(TIMEOUT) for f in loop.submit_many(reqs)]
            stats = loop.stats()
        assert loop.jct is None and len(results) == len(reqs)
        assert stats.completed == len(reqs) and stats.jct_calibration != stats.jct_calibration  # nan


def test_the_transformers_baseline_runs_in_the_same_loop(model_path) -> None:
    """HFScorer is a Scorer: EngineLoop (fcfs) serves it, one request per step, with the answers
    of its own offline `run`."""
    from po_backend.engine.hf_scorer import HFScorer

    hf = HFScorer.from_pretrained(model_path, dtype="fp32", device="cpu", max_input_len=512)
    reqs = _workload(seed=3, users=2, items=3)
    expected = hf.run(reqs)
    with EngineLoop(hf, policy="fcfs") as loop:
        got = [f.result(TIMEOUT) for f in loop.submit_many(reqs)]
        with pytest.raises(EmptyPromptError):
            loop.submit(ScoreRequest((), LABELS))
        steps = loop.step_log()
    for a, b in zip(got, expected, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) <= TOL
        assert a.top_logprobs == b.top_logprobs and a.cached_tokens == 0
    assert [len(s.items) for s in steps] == [1] * len(reqs)
    assert hf.stats().requests == 2 * len(reqs)
    with pytest.raises(ValueError, match="needs a JCT model"):
        EngineLoop(hf, policy="po", start=False)
