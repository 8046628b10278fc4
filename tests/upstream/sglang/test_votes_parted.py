"""Series entry 'Scheduler: ranks that meet in different votes stop alike, by name'.

The ranks of a group agree through one vote kind at a time (a bare agreement, a prefill round, a
decode step), each one all-reduce of the same shape. Where the ranks' states have parted, one rank
can be in a decode step's vote while its peer is in a prefill round's, and each reads the other's
ballot as its own vote's: found by the simulation (a one-rank quarantine, seed 13 with
CARRY_SIM_QUARANTINE=1, where rank 1's own decode check retracted a batch rank 0 decoded; series
entry 'a decode step's retraction is the vote's' removed that cause). Here, on SGLang's real event
loops, two gloo ranks, upstream's rank-consensus checker on, rank 1 alone decides for one iteration
that its decode step does not fit (standing for any decision a rank makes from its own state) and
retracts its whole batch, while rank 0 decodes it and votes: without the entry rank 0 stops with
DecodeRankDivergence, and rank 1, which met that ballot in its next prefill round's vote, reads one
DIVERGED round and goes on into a collective no peer makes. With the entry every ballot names its
vote's kind, and both ranks stop at that vote with RankVotesParted.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
import simulation as sim
from event_loop_driver import EventLoopDriver
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from test_event_loop_driver import LOOPS, _queue
from test_rank_agreement import TwoRanks, run_two_ranks

# The decoding requests' prompt and output lengths, and the iterations they decode before rank 1's
# reading drops.
PROMPT_TOKENS = 40
MAX_NEW_TOKENS = 30
ITERATIONS_BEFORE_THE_DROP = 4
ITERATIONS_AFTER_THE_DROP = 6


def _rank_1_retracts_alone(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    h.physical.take(0)
    reqs = [_queue(h, i, PROMPT_TOKENS, max_new_tokens=MAX_NEW_TOKENS) for i in range(2)]
    stopped = None
    try:
        with sim.strict_idle_check_off():
            driver.run(ITERATIONS_BEFORE_THE_DROP)
            with _decode_does_not_fit() if rank == 1 else contextlib.nullcontext():
                driver.run(1)
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


@contextlib.contextmanager
def _decode_does_not_fit() -> Iterator[None]:
    """This rank reads its decode step as not fitting, and every request as not fitting alone (so
    it retracts them all), wherever the tree reads it."""
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(ScheduleBatch, "check_decode_mem", return_value=False))
        if hasattr(Scheduler, "_decode_fits"):
            patches.enter_context(mock.patch.object(Scheduler, "_decode_fits", return_value=False))
        yield


SCENARIOS = {f"parted_{loop}": functools.partial(_rank_1_retracts_alone, loop=loop) for loop in LOOPS}
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
