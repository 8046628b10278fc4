"""The simulation's judge (simulation.judge): each of its checks fails where the ranks' records
differ in what it checks, for any rank of the group, and passes where they agree. A verdict that
could not fail would pass every seed whatever the ranks did."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import pytest
import simulation as sim

RUN = ("EXTEND", ("s00",), 8)
DECODE = ("DECODE", ("s00",), 0)
VOTE: sim.Collective = ("all_reduce", "tp", "MAX", (8,), "int64")


def _record(**changes: Any) -> dict[str, Any]:
    """One rank's record of a seed that ran two iterations, one collective each."""
    record = sim.RankRecord(
        iterations=[RUN, DECODE],
        collectives=[[VOTE], [VOTE]],
        votes=2,
    )
    return asdict(record) | changes


def _group(ranks: int, **rank_2_changes: Any) -> dict[int, dict[str, Any]]:
    """The records of a group of `ranks`, the last rank's changed as given."""
    group = {rank: _record() for rank in range(ranks)}
    group[ranks - 1] = _record(**rank_2_changes)
    return group


@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_that_ran_alike_pass(ranks: int) -> None:
    verdict = sim.judge(7, _group(ranks))
    assert verdict.failures == ()
    assert (verdict.iterations, verdict.collectives) == (2, 2)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"iterations": [RUN, ("DECODE", (), 0)]}, "iteration 2: rank 0 ran"),
        ({"iterations": [RUN]}, "iterations run: rank 0 2"),
        ({"collectives": [[VOTE], []]}, "iteration 2: rank 0's collectives"),
        ({"credited_steps": 1}, "credited decode steps: rank 0 0"),
        ({"grammar_timeouts": 1}, "grammars timed out: rank 0 0"),
        ({"divergences": 1}, "diverged rounds read: rank 0 0"),
        ({"unfinished": ["s00"]}, "requests never finished"),
        ({"leaks": ["a slot"]}, "leaked once idle"),
        ({"failure": "iteration 2: RuntimeError: gloo"}, "raised at iteration 2"),
    ],
)
def test_the_last_rank_differing_in_what_a_check_reads_fails_it(
    ranks: int, changes: dict[str, Any], named: str
) -> None:
    """Every check, with the difference on the last rank (rank 1 of two, rank 2 of three)."""
    failures = sim.judge(7, _group(ranks, **changes)).failures
    assert any(named in failure and f"rank {ranks - 1}" in failure for failure in failures), failures


@pytest.mark.parametrize("ranks", [2, 3])
def test_every_rank_stopping_by_the_same_name_at_the_same_vote_is_the_safety_net(ranks: int) -> None:
    stopped = "iteration 2: PrefillRankDivergence: the ranks admitted different batches"
    group = {rank: _record(failure=stopped) for rank in range(ranks)}
    verdict = sim.judge(7, group)
    assert verdict.stopped_by_name and verdict.failures == ()
    group[ranks - 1] = _record(failure=stopped, votes=3)  # one rank stopped a vote later
    assert not sim.judge(7, group).stopped_by_name
    group[ranks - 1] = _record()  # one rank stopped alone
    assert sim.judge(7, group).failures
