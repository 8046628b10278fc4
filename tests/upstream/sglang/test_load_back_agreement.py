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
    run_two_ranks,
)

NAME = "tp_load_back_misses_on_one_rank"
Ranks = dict[int, dict[str, Any]]


def _tree_state(h: sh.Harness) -> dict[str, int]:
    cache = h.tree_cache
    return {"evictable": cache.evictable_size(), "protected": cache.protected_size()}


def _load_back_misses_on_one_rank(h: sh.Harness, rank: int) -> dict[str, Any]:
    sched = h.scheduler
    h.put_prefix_on_host(PREFIX)
    h.add_request([*PREFIX, 7, 8, 9])
    names: dict[Any, str] = {}
    with contextlib.ExitStack() as stack:
        if rank == 1:
            _after_the_agreement_before_admission(sched, stack, lambda: stack.enter_context(_cotenant(h, 8)))
        batch = h.run_round()
        first = {
            "batch": _rids(batch),
            "prefix": None if batch is None else [sh.prefix_len(r) for r in batch.reqs],
            "loads": _h2d_loads(h),
            "divergences": sched.num_prefill_divergences,
            "state": _load_state(h, names),
        }
    if batch is not None:
        for req in batch.reqs:
            h.finish_request(req)
    # The co-tenant left: a round admits by the free space the last vote agreed (the miss's: the
    # co-tenant's), the next by what the vote of the one before saw, and runs.
    retries: list[Any] = []
    for _ in range(3):
        h.prepare_next_round()
        retry = h.run_round()
        retries.append(_rids(retry))
        if retry is not None:
            for req in retry.reqs:
                h.finish_request(req)
            break
    for _ in range(2):
        h.prepare_next_round()
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
