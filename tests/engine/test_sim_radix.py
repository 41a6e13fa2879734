"""The simulator's prefix pool (`sim.radix.RadixLRU`) keeps and evicts what the engine's radix
cache does, on the same steps: the engine itself (a tiny random-weight Llama, `Engine.step` with
ranks, as the serving loop drives it) and the simulator's pool run one sequence of steps, and after
each the cached paths, the eviction order and every request's cached length must agree."""

from __future__ import annotations

import random

import pytest

from po_backend.core.request import ScoreRequest
from po_backend.engine.cache.radix import Node, RadixCache
from po_backend.engine.engine import Engine
from po_backend.sim.radix import RadixLRU
from po_backend.sim.simulator import PrefixLRU

POOL = 160


def engine_paths(cache: RadixCache) -> set[tuple[int, ...]]:
    out: set[tuple[int, ...]] = set()
    stack: list[tuple[Node, tuple[int, ...]]] = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        path = path + tuple(int(t) for t in node.key)
        if not node.children and node is not cache.root:
            out.add(path)
        stack.extend((c, path) for c in node.children.values())
    return out


def workload(seed: int, n_steps: int) -> list[tuple[list[ScoreRequest], list[int]]]:
    """Steps as the serving loop sends them: online calls on a few profiles (declared prefixes
    sharing a template's first tokens), a long batch item's prefix steps (each prefix extending
    the last, kept at the urgent class less one) and then its whole step, unrelated calls; batches
    of one to three, mixed classes."""
    rng = random.Random(seed)
    template = [7, 8, 9]
    profiles = [template + [rng.randrange(10, 290) for _ in range(rng.randint(20, 45))] for _ in range(4)]
    items = [[5] + [rng.randrange(10, 290) for _ in range(rng.randint(90, 140))] for _ in range(3)]
    progress = [0] * len(items)
    steps = []
    for _ in range(n_steps):
        kind = rng.random()
        if kind < 0.3:  # a batch item's next prefix step, or its last (whole) step
            j = rng.randrange(len(items))
            item = items[j]
            progress[j] += rng.randint(20, 50)
            if progress[j] < len(item) - 10:
                ids = item[: progress[j]]
                steps.append(([ScoreRequest(tuple(ids), (1,), cache_prefix_len=len(ids))], [-1]))
            else:
                progress[j] = 0
                steps.append(([ScoreRequest(tuple(item), (1,))], [1]))
            continue
        reqs, ranks = [], []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.8:
                p = rng.choice(profiles)
                ids = p + [rng.randrange(10, 290) for _ in range(rng.randint(3, 8))]
                reqs.append(ScoreRequest(tuple(ids), (1,), cache_prefix_len=len(p)))
            else:
                ids = [rng.randrange(10, 290) for _ in range(rng.randint(5, 30))]
                reqs.append(
                    ScoreRequest(tuple(ids), (1,), cache_prefix_len=rng.choice([None, len(ids) // 2]))
                )
            ranks.append(rng.choice([0, 0, 1]))
        steps.append((reqs, ranks))
    return steps


def replay(pool_cls: type, engine: Engine, seed: int, n_steps: int = 120) -> int:
    """Run the workload on both; assert they agree after every step; return the evictions seen."""
    assert engine.cache is not None
    engine.flush_cache()
    sim = pool_cls(POOL, engine.config.batch_tokens)
    probes: list[ScoreRequest] = []
    for reqs, ranks in workload(seed, n_steps):
        engine.step(reqs, ranks)
        sim.step(reqs, ranks)
        probes += reqs
        assert engine_paths(engine.cache) == set(_paths(sim)), "cached paths differ"
        assert engine.cache.pool.num_free == sim.free_tokens()
        want = [(v.key, v.start) for v in engine.cache.eviction_order()]
        assert [(v.key, v.start) for v in sim.eviction_order()] == want, "eviction order differs"
        for r in probes[-40:]:
            assert sim.cached_len(r) == engine.cached_len(r)
    engine.cache.check_integrity()
    return engine.cache.evicted_tokens_total


def _paths(sim: RadixLRU | PrefixLRU) -> set[tuple[int, ...]]:
    if isinstance(sim, RadixLRU):
        return sim.paths()
    return set(sim._keys)  # the whole-prefix model's entries


@pytest.fixture(scope="module")
def engine(tiny_model) -> Engine:
    path, _ = tiny_model("llama")
    return Engine.from_pretrained(
        path, dtype="fp32", max_input_len=256, prefix_pool_tokens=POOL, cache_policy="declared"
    )


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_simulators_pool_keeps_and_evicts_what_the_engine_does(engine: Engine, seed: int) -> None:
    evicted = replay(RadixLRU, engine, seed)
    assert evicted > 3 * POOL, "the sequence must evict, many times over"


def test_the_whole_prefix_model_does_not(engine: Engine) -> None:
    """The comparison can fail: the simulator's former pool (whole declared prefixes, evicted
    whole, a template held once per prefix) disagrees with the engine on the same steps."""
    with pytest.raises(AssertionError):
        replay(PrefixLRU, engine, 0)
