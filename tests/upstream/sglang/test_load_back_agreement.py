"""A HiCache load-back whose allocation misses on one rank loads on no rank (series entry "HiCache:
the ranks agree on each load-back's allocation from a rank-local pool", sgl-project/sglang#34676).

Found by the randomized two-rank simulation (test_simulation.py): with HiCache on and a co-tenant
on one rank, the H->D load of a request's host prefix allocated its device rows from the elastic
pool on one rank and missed on the other. The rank that loaded admitted the request with the
prefix, its peer without: the round diverged, and the loaded prefix stayed on one rank's device,
so the ranks' trees parted and admitted differently from then on (PrefillRankDivergence after
three rounds), or a load stayed in one rank's lockstep ack queue and its nodes locked once idle.
Seven of 200 seeds failed so, on both event loops.

Scenario (two forked gloo ranks with distinct group objects, TP; Mamba, an elastic KV pool,
HiCache, loads pending until synchronized, as RANK_SCENARIOS["tp_hicache_host"]): both ranks have
PREFIX on host. Right after the ranks agree on their free space before the first admission, a
co-tenant maps away all but 8 tokens of rank 1's memory. The request [*PREFIX, 7, 8, 9] is a host
hit on both: admission (by the agreed ledger, alike) loads the prefix back; rank 1's allocation
misses, rank 0's does not. Then the co-tenant leaves, and the request runs a round or two later.

Expected: FAILS without the entry (rank 0 loads the prefix and rank 1 does not: the round diverges
and the ranks' trees differ after it) and PASSES with it (rank 0 takes its load back: no rank loads,
the rounds and the trees are alike on both ranks).
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from test_diverged_round_loads import HICACHE, _h2d_loads, _load_state, _rids
from test_prefill_unwind import PREFIX
from test_rank_agreement import (
    MultiRoundScenario,
    _after_the_agreement_before_admission,
    _cotenant,
    _loop,
    run_two_ranks,
)

NAME = "tp_load_back_misses_on_one_rank"
Ranks = dict[int, dict[str, Any]]


def _tree_state(h: sh.Harness) -> dict[str, int]:
    cache = h.tree_cache
    return {"evictable": cache.evictable_size(), "protected": cache.protected_size()}


def _own_reading(pool: Any) -> int:
    """A pool's free space from its own allocations and frees alone (alike on ranks that
    allocated alike; a co-tenant does not move it)."""
    return int(getattr(pool, "uniform_available_size", pool.available_size)())


def _take_back_state(h: sh.Harness) -> dict[str, int]:
    """What a load taken back must leave as if it was never queued: the controller's load queue
    and the next operation id (which the ranks' later loads are numbered from), the device rows of
    the full-attention pool and the side pool's (Mamba) slots it allocated."""
    from sglang.srt.managers.cache_controller import CacheOperation

    controller = h.tree_cache.cache_controller
    assert controller is not None, "built without hicache"
    # The Mamba slots' allocator (0.5.23: mamba_allocator; before: the pool allocates itself).
    req_to_token_pool = h.scheduler.req_to_token_pool
    mamba_slots = getattr(req_to_token_pool, "mamba_allocator", None) or getattr(
        req_to_token_pool, "mamba_pool", None
    )
    return {
        "queued_loads": len(controller.load_queue),
        "next_operation_id": CacheOperation.counter,
        "kv_free": _own_reading(h.token_to_kv_pool_allocator),
        "mamba_free": -1 if mamba_slots is None else _own_reading(mamba_slots),
    }


def _load_back_misses_on_one_rank(h: sh.Harness, rank: int) -> dict[str, Any]:
    """On SGLang's real event loop (the configuration's: event_loop_overlap): a request whose
    prefix is on host only; right after the ranks agree before admission, a co-tenant takes rank
    1's memory, so its load-back allocation misses there alone."""
    sched = h.scheduler
    driver = _loop(h)
    h.put_prefix_on_host(PREFIX)
    h.add_request([*PREFIX, 7, 8, 9], max_new_tokens=1)
    names: dict[Any, str] = {}
    with contextlib.ExitStack() as stack:
        if rank == 1:
            _after_the_agreement_before_admission(sched, stack, lambda: stack.enter_context(_cotenant(h, 8)))
        ran = driver.step()
        batch = sched.last_batch if ran.forward_mode is not None else None
        first = {
            "take_back": _take_back_state(h),
            "batch": _rids(batch),
            "prefix": None if batch is None else [sh.prefix_len(r) for r in batch.reqs],
            "loads": _h2d_loads(h),
            "divergences": sched.num_prefill_divergences,
            "state": _load_state(h, names),
        }
    # The co-tenant left: a round admits by the free space the last vote agreed (the miss's: the
    # co-tenant's), the next by what the vote of the one before saw, and runs.
    retries: list[Any] = []
    for _ in range(3):
        retry = driver.step()
        retries.append(list(retry.rids) if retry.forward_mode is not None else None)
        if retry.forward_mode is not None:
            break
    driver.run(2)  # the loop polls the copies (and processes the last result)
    return {
        "first": first,
        "retries": retries,
        "loads_after": _h2d_loads(h),
        "tree": _tree_state(h),
        "divergences": sched.num_prefill_divergences,
    }


SCENARIOS: dict[str, MultiRoundScenario] = {NAME: _load_back_misses_on_one_rank}


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    real = sh.build_harness

    def build_with_hicache(cfg: sh.HarnessConfig | None = None, **overrides: Any) -> sh.Harness:
        return real(cfg, **{**overrides, **HICACHE})

    with mock.patch.object(sh, "build_harness", build_with_hicache):
        return run_two_ranks([NAME], SCENARIOS, {}).scenario(NAME)


def test_a_load_back_that_misses_on_one_rank_loads_on_none(ranks: Ranks) -> None:
    first = [ranks[rank]["first"] for rank in (0, 1)]
    assert first[0] == first[1], first
    assert first[0]["loads"] == 0 and first[0]["divergences"] == 0, first


def test_the_ranks_trees_stay_alike_after_it(ranks: Ranks) -> None:
    assert ranks[0] == ranks[1]
    assert ranks[0]["divergences"] == 0
    assert ranks[0]["retries"][-1] == ["r0"]  # the request ran, on both ranks alike


def test_the_load_taken_back_leaves_what_a_load_never_queued_leaves(ranks: Ranks) -> None:
    """Rank 0's allocation succeeded and it queued the load; rank 1's missed. Rank 0 takes its load
    back: out of the queue, its operation id given back (the ranks number their later loads
    alike), its device rows and its Mamba slots freed, as on rank 1, which never queued one."""
    taken_back = [ranks[rank]["first"]["take_back"] for rank in (0, 1)]
    assert taken_back[0] == taken_back[1], taken_back
    assert taken_back[0]["queued_loads"] == 0, taken_back
    assert taken_back[0]["mamba_free"] >= 0, "the scenario's pool has no Mamba side pool to check"
