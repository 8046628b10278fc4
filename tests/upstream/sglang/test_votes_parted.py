"""Series entry 'Scheduler: ranks that meet in different votes stop alike, by name'.

The ranks of a group agree through one vote kind at a time (a bare agreement, a prefill round, a
decode step), each one all-reduce of the same shape. Where the ranks' states have parted, one rank
can be in a decode step's vote while its peer is in a prefill round's, and each reads the other's
ballot as its own vote's: found by the simulation (a one-rank quarantine, seed 13 with
CARRY_SIM_QUARANTINE=1), here on SGLang's real event loops, two gloo ranks, upstream's
rank-consensus checker on. Rank 1's uniform reading drops below what its running batch needs (as
kvcached's quarantine of pages on one GPU makes it), so its own decode check retracts the batch
while rank 0 decodes it and votes: rank 0 stops with DecodeRankDivergence, and rank 1, which met
that ballot in its next prefill round's vote, reads one DIVERGED round and goes on into a
collective no peer makes. With the entry every ballot names its vote's kind, and both ranks stop at
that vote with RankVotesParted.
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

# The decoding requests' prompt and output lengths, and the iterations they decode before rank 1's
# reading drops.
PROMPT_TOKENS = 40
MAX_NEW_TOKENS = 30
ITERATIONS_BEFORE_THE_DROP = 4
ITERATIONS_AFTER_THE_DROP = 6


def _rank_1_reading_drops_while_decoding(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    h.physical.take(0)
    reqs = [_queue(h, i, PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS) for i in range(2)]
    stopped = None
    try:
        with sim.strict_idle_check_off():
            driver.run(ITERATIONS_BEFORE_THE_DROP)
            if rank == 1:
                h.physical.quarantine(lambda: h.cfg.kv_tokens - 8)
            _queue(h, 2, PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS)
            driver.run(ITERATIONS_AFTER_THE_DROP)
    except Exception as error:  # the scheduler stopping, or its loop stuck in a collective
        stopped = type(error).__name__
    return {
        "stopped": stopped,
        # The votes each rank took part in: the ranks parted an iteration apart (rank 1 retracted
        # without a vote), and must stop at the same vote.
        "votes": h.scheduler._prefill_agreement.votes,
        "decoded_before_the_drop": all(len(req.output_ids) > 1 for req in reqs),
    }


SCENARIOS = {
    f"parted_{loop}": functools.partial(_rank_1_reading_drops_while_decoding, loop=loop) for loop in LOOPS
}
CONFIGS = {f"parted_{loop}": LOOPS[loop][1] for loop in LOOPS}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    # The ranks' admissions and retractions differ on purpose: upstream's checker may see it too.
    return run_two_ranks(list(SCENARIOS), SCENARIOS, {}, CONFIGS, divergence_expected=set(SCENARIOS))


@pytest.mark.parametrize("loop", LOOPS)
def test_ranks_in_different_votes_both_stop_by_name(two_ranks: TwoRanks, loop: str) -> None:
    ranks = two_ranks.scenario(f"parted_{loop}")
    assert ranks[0]["decoded_before_the_drop"] and ranks[1]["decoded_before_the_drop"], ranks
    assert ranks[0]["stopped"] == ranks[1]["stopped"] == "RankVotesParted", ranks
    assert ranks[0]["votes"] == ranks[1]["votes"], ranks
