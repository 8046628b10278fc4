"""Series entry 'Scheduler: a decode step's retraction is the vote's, not one rank's reading'.

With pools whose free space is per rank, a decode step used to check its own pool first
(`check_decode_mem`, the agreed ledger) and retract where it did not fit, before any vote. The
ledger is alike on every rank only while each rank's own reading moves by its own calls alone;
a pool that breaks that promise lowers the reading on one rank between two votes (kvcached's did
under a quarantine of pages or a shrink on one GPU, before its reading counted from its virtual
size). That rank then retracts where its peer decodes, and the
ranks part: they stop by name (DecodeRankDivergence, RankVotesParted) or, where their next
collectives differ, hang.

Here, on SGLang's real event loops, two gloo ranks, upstream's rank-consensus checker on: two
requests decode, and rank 1's own reading drops for two iterations to one free token. With the
entry no rank reads its own pool before the step: the step allocates, misses on rank 1, both ranks
retract the same request on the vote's word and try again, and every request finishes on both
ranks with the same output. Without it both ranks stop.
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

PROMPT_TOKENS = 40
MAX_NEW_TOKENS = 12
# The iterations the requests decode before rank 1's reading drops, and how long it stays down.
ITERATIONS_BEFORE_THE_DROP = 4
ITERATIONS_DOWN = 2


def _rank_1_reading_drops_while_decoding(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    h.physical.take(0)
    reqs = [_queue(h, i, PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS) for i in range(2)]
    down = range(ITERATIONS_BEFORE_THE_DROP, ITERATIONS_BEFORE_THE_DROP + ITERATIONS_DOWN)
    stopped = None
    try:
        with sim.strict_idle_check_off():
            driver.run(ITERATIONS_BEFORE_THE_DROP)
            if rank == 1:
                # All its free space but one token, while the drop lasts.
                quarantined = h.physical.uniform() - 1
                h.physical.part_own_reading(lambda: quarantined if len(driver.iterations) in down else 0)
            driver.run_until(lambda: all(req.finished() for req in reqs), max_iterations=80)
    except Exception as error:  # the scheduler stopping, or its loop stuck in a collective
        stopped = type(error).__name__
    sched = h.scheduler
    return {
        "stopped": stopped,
        "outputs": {req.rid: list(req.output_ids) for req in reqs},
        "decode_misses": sched.num_decode_allocation_misses,
        "votes": sched._prefill_agreement.votes,
    }


SCENARIOS = {
    f"drop_{loop}": functools.partial(_rank_1_reading_drops_while_decoding, loop=loop) for loop in LOOPS
}
CONFIGS = {f"drop_{loop}": LOOPS[loop][1] for loop in LOOPS}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    # Rank 1's reading differs on purpose: where the ranks part, upstream's checker may see it too.
    return run_two_ranks(list(SCENARIOS), SCENARIOS, {}, CONFIGS, divergence_expected=set(SCENARIOS))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_reading_that_drops_on_one_rank_retracts_alike_on_the_votes_word(
    two_ranks: TwoRanks, loop: str
) -> None:
    ranks = two_ranks.scenario(f"drop_{loop}")
    assert ranks[0] == ranks[1], ranks
    r = ranks[0]
    assert r["stopped"] is None, ranks
    assert all(len(output) == MAX_NEW_TOKENS for output in r["outputs"].values()), r
    # The drop was met by the vote: the step missed on rank 1, and both ranks counted it.
    assert r["decode_misses"] >= 1, r
