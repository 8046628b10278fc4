"""Decode steps the ranks of one group agreed no rank can miss run without a vote (series entry
"Scheduler: decode steps the ranks agreed no rank can miss run without a vote",
sgl-project/sglang#34676).

The entry before it makes the ranks vote on every decode step's allocation, since a co-tenant can
take the memory a step needs on one rank. A step that fits in memory every rank already holds
mapped cannot miss: the pool says how much (`guaranteed_available_size`, kvcached's free blocks on
its mapped pages), each vote carries the least reading and the most rows a step can have, and the
steps that covers run without a vote, the same steps on every rank. Two forked gloo ranks with
distinct group objects; rank 1's co-tenant holds every page it has not mapped, drifting at every
reading, and the ranks hold different amounts mapped.

Expected: these tests FAIL without the entry (every step votes) and PASS with it; a credit from
one rank's own reading instead of the least hangs them, and one that leaves out the rows a step
or a joining prefill batch adds makes rank 1 miss in a step no rank voted on.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import scheduler_harness as sh
import torch
from event_loop_driver import EventLoopDriver
from sglang.srt.managers.schedule_batch import ScheduleBatch
from test_decode_agreement import _prefilled_batch
from test_prefill_unwind import _prompt
from test_rank_agreement import (
    MISSING_RANK,
    MultiRoundScenario,
    TwoRanks,
    _drifting,
    agrees_by_deficit,
    ballot_fields_per_pool,
    ballot_head_fields,
    run_two_ranks,
)


def _count_votes(h: sh.Harness) -> list[int]:
    """Each all-reduce the scheduler makes over its groups, by its length (a decode vote: 5 with a
    decode credit), on this rank."""
    made: list[int] = []
    real = h.tree_cache._all_reduce_attn_groups

    def all_reduce_attn_groups(tensor: torch.Tensor, op: Any) -> None:
        made.append(tensor.numel())
        real(tensor, op)

    h.tree_cache._all_reduce_attn_groups = all_reduce_attn_groups
    return made


def _decode_steps(h: sh.Harness, batch: ScheduleBatch, steps: int, votes: list[int]) -> list[dict[str, Any]]:
    """Run `steps` decode steps, each as the event loop does (its tokens appended after it ran),
    noting per step the all-reduces it made, what it kept, and the misses so far."""
    sched = h.scheduler
    seen: list[dict[str, Any]] = []
    for _ in range(steps):
        before = len(votes)
        stepped = sched.update_running_batch(batch)
        kept = [] if stepped is None else [r.rid for r in stepped.reqs]
        for req in batch.reqs:
            req.output_ids.append(7)
        misses = sched.num_decode_allocation_misses
        seen.append({"votes": len(votes) - before, "kept": kept, "misses": misses})
    return seen


def _by_deficit(h: sh.Harness) -> bool:
    """The tree carries RankAgreement: every vote, a decode step's too, agrees the ledger (on the
    deficit) and the credit (in tokens, counted against each step's own rows), whatever its
    outcome. Before it, only a prefill round that ran alike agreed the ledger, and a credit in
    steps from a bound on the rows."""
    return agrees_by_deficit(h.scheduler)


def _no_step_missed_without_a_vote(steps: list[dict[str, Any]]) -> None:
    misses = 0
    for step in steps:
        assert step["misses"] == misses or step["votes"] > 0, steps
        misses = step["misses"]


def _three_decoding_on_mapped_memory(
    h: sh.Harness, rank: int, rank_1_holds: int
) -> tuple[ScheduleBatch, list[int]]:
    """Three requests decode; rank 0 holds 60 free tokens mapped, rank 1 `rank_1_holds`, and a
    co-tenant takes all rank 1's other memory, drifting at every reading. Returns the batch and
    the all-reduces counted from here."""
    batch = _prefilled_batch(h, 3)
    assert h.physical is not None
    votes = _count_votes(h)
    h.physical.hold_mapped(60 if rank == 0 else rank_1_holds)
    if rank == MISSING_RANK:
        h.physical.drift(_drifting(h.physical.uniform()))
    return batch, votes


def _decode_on_a_credit(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Three requests decode. Rank 0 holds 60 free tokens mapped, rank 1 thirteen, and a
    co-tenant takes all rank 1's other memory, drifting at every reading. The first step votes:
    rank 1 holds 10 after it, the least, so the next 3 steps (3 rows each) run without a vote, on
    both ranks. Rank 1 then holds 1 token: the next step votes, misses there, and both ranks
    retract alike."""
    batch, votes = _three_decoding_on_mapped_memory(h, rank, rank_1_holds=13)
    steps = _decode_steps(h, batch, 6, votes)
    return {
        "steps": steps,
        "vote_sizes": sorted(set(votes)),
        "by_deficit": _by_deficit(h),
        "decode_fit_voted": hasattr(h.scheduler, "_decode_fits"),
    }


def _decode_credit_after_a_prefill(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The first decode step agrees a credit of 3 steps (rank 1 holds 11 tokens mapped after it).
    A prefill round then admits a 5-token request on rank 1's mapped memory, and its batch joins:
    the old credit no longer holds. The round's own vote agrees a new one after its allocation:
    rank 1 holds 6 tokens for 4 rows, one step (two, were the joining request's row left out).
    That step runs without a vote; the next votes and misses on rank 1, alike on both ranks,
    instead of missing on rank 1 alone in a step run without a vote."""
    batch, votes = _three_decoding_on_mapped_memory(h, rank, rank_1_holds=14)
    first = _decode_steps(h, batch, 1, votes)
    h.add_request(_prompt(100, 5))
    joined = h.run_round()
    h.prepare_next_round()
    if joined is not None:
        assert len(joined.reqs) == 1
        joined.reqs[0].output_ids.append(7)
        batch.merge_batch(joined)
        h.scheduler.running_batch = batch
    steps = first + _decode_steps(h, batch, 3, votes)
    return {"steps": steps, "joined": joined is not None, "by_deficit": _by_deficit(h)}


def _decode_credit_after_a_put_back_round(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The first decode step agrees a credit of 3 steps (rank 1 holds 11 tokens mapped after it).
    A prefill round then admits a 5-token request; rank 0's allocation misses, so the round is put
    back on both ranks, and rank 1 gives back what it allocated, which it no longer holds mapped
    (kvcached unmaps a page emptied before a reading once that reading is taken, as the round's
    vote takes it): 6 tokens. A round put back agrees no credit, so the next step votes, and its
    credit covers one step; the step after votes and misses on rank 1, alike on both ranks. (Had
    the put-back round left the old credit, rank 1 would miss alone in the third step after it,
    which no rank voted on.)"""
    batch, votes = _three_decoding_on_mapped_memory(h, rank, rank_1_holds=14)
    first = _decode_steps(h, batch, 1, votes)
    h.add_request(_prompt(100, 5))
    with h.arm_miss("token_slots") if rank == 0 else contextlib.nullcontext():
        assert h.run_round() is None
    h.prepare_next_round()
    unwinds = sh.num_prefill_unwinds(h)
    steps = first + _decode_steps(h, batch, 3, votes)
    return {"steps": steps, "unwinds": unwinds, "by_deficit": _by_deficit(h)}


def _idle_after_decoding_on_a_credit(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Two requests run to their end through the real loop (event_loop_normal's iteration), their
    decode steps on a credit (both ranks hold 60 free tokens mapped, beside the co-tenants' drift),
    then the co-tenants leave and the loop goes idle.
    Going idle ends the credit and reads the pool once more: kvcached unmaps the pages it kept
    mapped for the credit when that reading is taken, so a server left idle gives them back to its
    co-tenants (without the reading they stay mapped until the next request)."""
    driver = EventLoopDriver(h)
    assert h.physical is not None
    h.physical.hold_mapped(60)
    reqs = [h.make_req(_prompt(i, 5 + 7 * i), rid=f"r{i}", max_new_tokens=6) for i in range(2)]
    for req in reqs:
        h.scheduler._add_request_to_queue(req)
    driver.run_until(lambda: all(req.finished() for req in reqs), max_iterations=20)
    h.physical.take(0)  # the co-tenants leave: the idle leak check compares the pool with its total
    before = h.physical.guaranteed_readings
    driver.run_until_idle(max_iterations=5)
    agreement = h.scheduler._prefill_agreement
    credit = getattr(agreement, "decode_credit", None)
    return {
        "iterations": [(it.forward_mode, it.rids) for it in driver.iterations],
        "readings_while_idle": h.physical.guaranteed_readings - before,
        "steps_left_once_idle": credit.take_step() if credit is not None else agreement.covers_decode_step(1),
    }


CREDIT_SCENARIOS: dict[str, MultiRoundScenario] = {
    "tp_decode_credit": _decode_on_a_credit,
    "tp_decode_credit_prefill": _decode_credit_after_a_prefill,
    "tp_decode_credit_put_back": _decode_credit_after_a_put_back_round,
    "tp_decode_credit_idle": _idle_after_decoding_on_a_credit,
}
CONFIGS = {"tp_decode_credit_idle": {"enable_overlap": False}}  # event_loop_normal's mode


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    return run_two_ranks(list(CREDIT_SCENARIOS), CREDIT_SCENARIOS, {}, CONFIGS)


def test_steps_the_ranks_agreed_no_rank_can_miss_run_without_a_vote(two_ranks: TwoRanks) -> None:
    """The credit is the least of the ranks' readings: both skip the same three votes, and the
    step after them votes and retracts alike where rank 1 misses."""
    ranks = two_ranks.scenario("tp_decode_credit")
    assert ranks[0] == ranks[1]
    steps = ranks[0]["steps"]
    assert [s["votes"] for s in steps[:4]] == [1, 0, 0, 0]
    assert [s["misses"] for s in steps[:4]] == [0, 0, 0, 0]
    assert len(steps[4]["kept"]) == 2
    _no_step_missed_without_a_vote(steps)
    if ranks[0]["by_deficit"] and not ranks[0]["decode_fit_voted"]:
        # The first step's vote agreed rank 1's deficit too: the step after the credit retracts
        # by the ledger before it allocates, alike on both ranks, instead of missing.
        assert steps[4]["misses"] == 0 and steps[4]["votes"] == 1
    elif ranks[0]["by_deficit"]:
        # From series entry 'a decode step's retraction is the vote's' on, no rank reads its own
        # ledger before the step: the step allocates, misses on rank 1, and both retract alike.
        assert steps[4]["misses"] == 1 and steps[4]["votes"] == 2
    if ranks[0]["by_deficit"]:
        # The ballot's head fields, the KV pool's fields, the guaranteed reading.
        assert ranks[0]["vote_sizes"] == [ballot_head_fields() + ballot_fields_per_pool() + 1]
    else:
        assert steps[4]["misses"] == 1 and steps[4]["votes"] == 2  # the miss, then the retry
        assert ranks[0]["vote_sizes"] == [5]


def test_a_prefill_round_agrees_the_credit_afresh(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_decode_credit_prefill")
    assert ranks[0] == ranks[1]
    steps = ranks[0]["steps"]
    _no_step_missed_without_a_vote(steps)
    if ranks[0]["by_deficit"]:
        # The first step's vote agreed rank 1's deficit: the ledger admits nothing it cannot map.
        assert not ranks[0]["joined"]
        return
    assert ranks[0]["joined"]
    assert [s["votes"] for s in steps] == [1, 0, 2, 1]
    assert [s["misses"] for s in steps] == [0, 0, 1, 1]


def test_a_prefill_round_put_back_ends_the_credit(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_decode_credit_put_back")
    assert ranks[0] == ranks[1]
    steps = ranks[0]["steps"]
    _no_step_missed_without_a_vote(steps)
    if ranks[0]["by_deficit"]:
        return
    assert ranks[0]["unwinds"] == 1
    assert [s["votes"] for s in steps] == [1, 1, 0, 2]
    assert [s["misses"] for s in steps] == [0, 0, 0, 1]


def test_going_idle_ends_the_credit_and_reads_the_pool(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_decode_credit_idle")
    assert ranks[0]["iterations"] == ranks[1]["iterations"]
    assert ranks[0]["iterations"][-1] == (None, ())  # on_idle ran
    for rank, seen in ranks.items():
        assert seen["readings_while_idle"] == 1, rank
        assert seen["steps_left_once_idle"] is False, rank
