"""A prefill round that admits nothing beside running requests makes no collective (series entry
"Scheduler: a prefill round that admits nothing makes no collective", sgl-project/sglang#34676).

Before the entry every loop iteration with a request waiting made the prefill vote, also where no
rank admitted anything (the IDLE vote): a server at its running-request limit, its queue never
empty, paid one CPU collective per decode step on top of the decode vote the credit skips. The
ranks read the same ledger and the same trees (load-backs are agreed), so a round that admits
nothing does so on every rank, and the entry drops that vote. Where nothing runs either, a round
that admits nothing with requests queued agrees afresh (every rank alike) where the ranks agreed a
deficit: no decode vote would refresh a ledger that a co-tenant's returned memory made stale, and
the queue would wait for ever; with no deficit agreed, or only a grammar waiting, it makes none.

Two forked gloo ranks with distinct group objects run the real event loop (both loops), rank 1's
readings drifting at every reading (co-tenants). Three requests arrive; the pool has two request
rows, so the third waits while the first two decode on a credit (both ranks hold ample memory
mapped).

A second scenario: a request runs while co-tenants hold part of rank 1's memory (a deficit
agreed), then only a request waiting for its grammar is left, for eight iterations.

Expected: FAILS without the entry (a vote with no batch in every iteration the third request
waits; an agreement in every iteration the grammar waits) and PASSES with it.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
import simulation as sim
from event_loop_driver import EventLoopDriver
from test_event_loop_driver import LOOPS, _queue
from test_rank_agreement import TwoRanks, _drifting, ballot_fields_per_pool, run_two_ranks


def _third_request_waits(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    h.physical.hold_mapped(400)
    if rank == 1:
        _cotenants_drift(h, leave_free=300)
    agreement = h.scheduler._prefill_agreement
    votes: list[dict[str, Any]] = []
    real_vote = agreement.vote

    def vote(ballot: Any) -> Any:
        running = h.scheduler.running_batch
        votes.append(
            {
                "iteration": len(driver.iterations) + 1,
                "with_a_batch": ballot.fingerprint != 0,
                "beside_running": running is not None and not running.is_empty(),
            }
        )
        return real_vote(ballot)

    agreement.vote = vote
    reqs = [_queue(h, i, 6 + i, max_new_tokens=12) for i in range(3)]
    driver.run_until(lambda: all(req.finished() for req in reqs), max_iterations=60)
    waited = [
        i + 1 for i, it in enumerate(driver.iterations) if it.forward_mode == "DECODE" and "r2" not in it.rids
    ]
    return {
        "iterations": [(it.forward_mode, it.rids) for it in driver.iterations],
        "votes": votes,
        "decode_steps_r2_waited": waited,
        "finished": [req.finished() for req in reqs],
    }


def _cotenants_drift(h: sh.Harness, leave_free: int) -> None:
    """Co-tenants hold this rank's GPU memory until about `leave_free` tokens of its pool can still
    be mapped, a few tokens more or less at every reading (kvcached's cached physical reading)."""
    assert h.physical is not None
    h.physical.drift(_drifting(h.physical.uniform() - leave_free))


def _only_a_grammar_waits(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    """A request runs while co-tenants hold part of rank 1's memory: its vote agrees that deficit.
    Then nothing is queued or running and one request waits for its grammar to compile (the
    grammar backend is the I/O boundary: it answers that a grammar waits and that none is ready)
    for eight iterations: a round that can admit nothing, which makes no agreement."""
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    h.physical.hold_mapped(400)
    sched = h.scheduler
    agreement = sched._prefill_agreement
    votes = [0]  # every vote, agree()'s among them
    real_vote = agreement.vote

    def vote(ballot: Any) -> Any:
        votes[0] += 1
        return real_vote(ballot)

    agreement.vote = vote
    if rank == 1:
        _cotenants_drift(h, leave_free=300)
    # Upstream's strict idle check reads the co-tenants' memory as a leak (kvcached's integration
    # turns it off), so it is off here.
    with sim.strict_idle_check_off():
        first = _queue(h, 0, 6, max_new_tokens=4)
        driver.run_until_idle(max_iterations=30)
        votes_before = votes[0]
        grammars = sched.grammar_manager
        with (
            mock.patch.object(grammars, "has_waiting_grammars", return_value=True),
            mock.patch.object(grammars, "get_ready_grammar_requests", return_value=[]),
        ):
            driver.run(8)
    return {
        "first_finished": first.finished(),
        "votes_while_the_grammar_waited": votes[0] - votes_before,
    }


def _one_rank_admits_nothing(h: sh.Harness, rank: int, loop: str) -> dict[str, Any]:
    """Rank 1's own reading of its free space (its uniform one) is lower than rank 0's by most of
    its pool, as a pool that breaks the interface's promise makes it: in every round one rank
    admits the request and its peer nothing. DIVERGED is the safety net, and every rank must reach
    it alike: both put the round back, both count it, and the third such round stops both with
    PrefillRankDivergence, by name. A rank that votes only where it admitted leaves its peer alone
    in the vote, or a divergence seen by one rank only, and the ranks part (a hang).

    From series entry 'the ranks agree on the least free space' on, every vote agrees the least
    reading, so a reading that stays lower no longer parts the ranks' admissions: there it drops
    after every other vote and comes back after the next, each time after the ranks agreed."""
    driver: EventLoopDriver = LOOPS[loop][0](h)
    assert h.physical is not None
    if rank == 1:
        agreement = h.scheduler._prefill_agreement
        drop = h.cfg.kv_tokens - 16
        if ballot_fields_per_pool() > 1:
            h.physical.part_own_reading(lambda: drop if agreement.votes % 2 else 0)
        else:
            h.physical.part_own_reading(lambda: drop)
    _queue(h, 0, 64, max_new_tokens=4)
    stopped = None
    try:
        with sim.strict_idle_check_off():
            driver.run(6)
    except Exception as error:  # the scheduler stopping
        stopped = type(error).__name__
    return {
        "stopped": stopped,
        "iterations": len(driver.iterations),
        "divergences": h.scheduler.num_prefill_divergences,
    }


SCENARIOS = {
    **{f"third_waits_{loop}": functools.partial(_third_request_waits, loop=loop) for loop in LOOPS},
    **{f"grammar_waits_{loop}": functools.partial(_only_a_grammar_waits, loop=loop) for loop in LOOPS},
    **{f"admits_apart_{loop}": functools.partial(_one_rank_admits_nothing, loop=loop) for loop in LOOPS},
}
CONFIGS = {
    **{f"third_waits_{loop}": {**LOOPS[loop][1], "req_rows": 2} for loop in LOOPS},
    **{f"grammar_waits_{loop}": LOOPS[loop][1] for loop in LOOPS},
    **{f"admits_apart_{loop}": LOOPS[loop][1] for loop in LOOPS},
}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    return run_two_ranks(list(SCENARIOS), SCENARIOS, {}, CONFIGS)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_round_that_admits_nothing_beside_running_requests_makes_no_vote(
    two_ranks: TwoRanks, loop: str
) -> None:
    ranks = two_ranks.scenario(f"third_waits_{loop}")
    assert ranks[0] == ranks[1]
    r = ranks[0]
    assert all(r["finished"]), r
    assert len(r["decode_steps_r2_waited"]) >= 5, r  # the third request waited while two decoded
    empty_votes_beside_running = [v for v in r["votes"] if not v["with_a_batch"] and v["beside_running"]]
    assert empty_votes_beside_running == [], r
    waited = set(r["decode_steps_r2_waited"])
    # In the steps the third request waited, the credit covered the decode votes too: no vote.
    assert [v for v in r["votes"] if v["iteration"] in waited] == [], r


@pytest.mark.parametrize("loop", LOOPS)
def test_a_round_whose_only_work_is_a_grammar_votes_alike(two_ranks: TwoRanks, loop: str) -> None:
    """A round whose only work is a grammar compiling can admit a request on every rank once the
    grammar is ready (the ranks learn that together), so it is settled: every rank votes in
    every such round, IDLE on both, nothing run and nothing put back."""
    ranks = two_ranks.scenario(f"grammar_waits_{loop}")
    assert ranks[0] == ranks[1]
    assert ranks[0] == {"first_finished": True, "votes_while_the_grammar_waited": 8}


@pytest.mark.parametrize("loop", LOOPS)
def test_ranks_that_admit_apart_read_the_divergence_alike_and_stop_by_name(
    two_ranks: TwoRanks, loop: str
) -> None:
    ranks = two_ranks.scenario(f"admits_apart_{loop}")
    assert ranks[0] == ranks[1], ranks
    assert ranks[0]["stopped"] == "PrefillRankDivergence" and ranks[0]["divergences"] == 3, ranks
    # Upstream's rank-consensus checker (on for every two-rank scenario) does not see it: the
    # ranks' @rank_consensus calls are alike; only their admission differs, which the vote sees.
    assert two_ranks.checker_fired(f"admits_apart_{loop}") == {0: False, 1: False}
