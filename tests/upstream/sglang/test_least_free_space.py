"""Series entry 'Scheduler: the ranks agree on the least free space, not only the largest deficit'.

The ranks' ledger was each pool's uniform reading (its free space counted from its own calls)
less the largest deficit any rank had (uniform minus real): alike on every rank only while the
ranks' uniform readings are. Where a pool's own reading is lower on one rank (kvcached's was,
under a quarantine of pages or a shrink on one GPU, before it counted from its virtual size),
that rank admits less than its peers in every round, every round is DIVERGED, and the third
stops every rank (PrefillRankDivergence): one such pool would stop the server.

Here, on SGLang's real event loops, two gloo ranks, upstream's rank-consensus checker on: rank 1's
uniform reading is half its pool lower than rank 0's for the whole run, while eight requests need
more than that half. With the entry each ballot also carries what the rank had free before it
allocated, each rank's pools take the deficit that brings them to the least of those, and both
ranks read the same free space from the first vote on: they admit the same batches (as much as
rank 1 holds at a time) and serve every request. Without it both stop.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import scheduler_harness as sh
import simulation as sim
from event_loop_driver import EventLoopDriver
from test_event_loop_driver import LOOPS, _queue
from test_rank_agreement import TwoRanks, run_two_ranks

REQUESTS = 8
PROMPT_TOKENS = 48
MAX_NEW_TOKENS = 6
MAX_ITERATIONS = 120


def _rank_1_reads_half_its_pool_less(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    h.physical.take(0)
    if rank == 1:
        h.physical.part_own_reading(lambda: h.cfg.kv_tokens // 2)
    reqs = [_queue(h, i, PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS) for i in range(REQUESTS)]
    readings: list[int] = []
    stopped = None
    try:
        with sim.strict_idle_check_off():
            while not all(req.finished() for req in reqs) and len(driver.iterations) < MAX_ITERATIONS:
                driver.run(1)
                readings.append(h.token_to_kv_pool_allocator.available_size())
    except Exception as error:  # the scheduler stopping, or its loop stuck in a collective
        stopped = type(error).__name__
    sched = h.scheduler
    return {
        "stopped": stopped,
        "outputs": {req.rid: list(req.output_ids) for req in reqs},
        "batches": [(it.forward_mode, it.rids) for it in driver.iterations],
        "readings": readings,
        "divergences": sched.num_prefill_divergences,
    }


SCENARIOS = {f"half_{loop}": functools.partial(_rank_1_reads_half_its_pool_less, loop=loop) for loop in LOOPS}
CONFIGS = {f"half_{loop}": LOOPS[loop][1] for loop in LOOPS}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    # Rank 1's reading differs on purpose: where the ranks part, upstream's checker may see it too.
    return run_two_ranks(list(SCENARIOS), SCENARIOS, {}, CONFIGS, divergence_expected=set(SCENARIOS))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_rank_that_reads_less_free_space_for_good_is_served_alike(two_ranks: TwoRanks, loop: str) -> None:
    ranks = two_ranks.scenario(f"half_{loop}")
    # The same batches, the same free space read after every iteration, the same outputs.
    assert ranks[0] == ranks[1], ranks
    r = ranks[0]
    assert r["stopped"] is None and r["divergences"] == 0, r
    assert all(len(output) == MAX_NEW_TOKENS for output in r["outputs"].values()), r
    # The group admitted by rank 1's half: never all eight requests at once.
    assert max(len(rids) for _, rids in r["batches"]) < REQUESTS, r
    assert two_ranks.checker_fired(f"half_{loop}") == {0: False, 1: False}
