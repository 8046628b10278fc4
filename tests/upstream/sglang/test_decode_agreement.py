"""The ranks of one group agree on each decode step's allocation (series entry "Scheduler: the
ranks agree on each decode step's allocation, and retract alike where it missed",
sgl-project/sglang#34676).

With a pool whose free space is decided on each rank (kvcached's elastic pools), every decision
reads the agreed ledger, so the ranks retract alike; but a co-tenant can take the physical memory
the ledger counts, and then a decode step's allocation misses on that rank only: upstream stops
that rank while its peers wait in the forward. With the patch every rank allocates the step, then
the ranks vote (one all-reduce per decode step, only with such a pool); where any rank missed,
each gives its step back, all retract the same request and try again. The vote also carries the
batch's requests: ranks about to run different decode batches stop rather than run them. Two
forked gloo ranks with distinct group objects; rank 1's physical reading drifts at every read.

Expected: these tests FAIL without the patch (rank 1 dies of the miss while rank 0 runs the step;
different batches run) and PASS with it, except the plain-pool case of
`test_a_decode_step_makes_one_collective_with_a_rank_local_pool`, which pins what the patch must
leave alone (no collective in a default deployment's decode step).
"""

from __future__ import annotations

import contextlib
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from test_prefill_unwind import _prompt
from test_rank_agreement import (
    MISSING_RANK,
    MultiRoundScenario,
    TwoRanks,
    _drifting,
    _reads_the_ledger,
    agrees_by_deficit,
    run_two_ranks,
)

PROMPT_TOKENS = 40


def _prefilled_batch(h: sh.Harness, requests: int) -> ScheduleBatch:
    """A prefill round that runs alike on both ranks, each request with its first output token,
    made the running batch (what the event loop does after the prefill's result)."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    for i in range(requests):
        h.add_request(_prompt(i, PROMPT_TOKENS)).sampling_params.frequency_penalty = 0.5
    batch = h.run_round()
    assert batch is not None and len(batch.reqs) == requests
    for req in batch.reqs:
        req.output_ids.append(7)
    h.prepare_next_round()
    sched.running_batch = batch
    return batch


def _lose_memory_for_one_step(h: sh.Harness, batch: ScheduleBatch) -> None:
    """A co-tenant takes this rank's physical memory until one token short of the batch's next
    decode step, drifting at every reading (kvcached's TTL-cached reading); retracting any one
    request gives back more than the step needs."""
    assert h.physical is not None
    h.physical.drift(_drifting(h.physical.uniform() - (len(batch.reqs) - 1)))


def _count_penalty_steps(stack: contextlib.ExitStack) -> list[int]:
    """How often a decode step's output tokens are added to the penalizers (the requests have a
    frequency penalty), with the batch size each time."""
    counted: list[int] = []
    real = ScheduleBatch.cumulate_penalty_output_tokens

    def cumulate(batch: ScheduleBatch) -> None:
        counted.append(len(batch.reqs))
        real(batch)

    stack.enter_context(mock.patch.object(ScheduleBatch, "cumulate_penalty_output_tokens", cumulate))
    return counted


def _decode_step(h: sh.Harness, batch: ScheduleBatch) -> dict[str, Any]:
    sched = h.scheduler
    running = [r.rid for r in batch.reqs]
    with contextlib.ExitStack() as stack:
        penalty_steps = _count_penalty_steps(stack)
        stepped = sched.update_running_batch(batch)
    kept = [] if stepped is None else [r.rid for r in stepped.reqs]
    step_slots = None if stepped is None or stepped.out_cache_loc is None else len(stepped.out_cache_loc)
    return {
        "kept": kept,
        "retracted": sorted(set(running) - set(kept)),
        "queue": [r.rid for r in sched.waiting_queue],
        "step_slots": step_slots,
        "uniform_free": h.token_to_kv_pool_allocator.uniform_available_size(),
        "kv_lens": [r.kv.kv_allocated_len for r in batch.reqs],
        "penalty_steps": penalty_steps,
        "misses": getattr(sched, "num_decode_allocation_misses", 0),
        # After a miss the ledger holds what the co-tenant took: before RankAgreement the next
        # prefill round agrees on the real readings afresh; from it on the miss's vote agreed it.
        "agreement_current": _reads_the_ledger(sched),
        "agreed_by_every_vote": agrees_by_deficit(sched),
    }


def _decode_miss_on_one_rank(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Five requests decode; before their next step a co-tenant takes rank 1's memory (its
    reading drifting). Both ranks must retract the same request and run the same four."""
    batch = _prefilled_batch(h, 5)
    if rank == MISSING_RANK:
        _lose_memory_for_one_step(h, batch)
    return _decode_step(h, batch)


def _decode_miss_on_the_last_request(h: sh.Harness, rank: int) -> dict[str, Any]:
    """One request decodes and its step misses on rank 1: it goes back to the queue on both
    ranks (upstream keeps the last request, which would miss again at every step)."""
    batch = _prefilled_batch(h, 1)
    if rank == MISSING_RANK:
        _lose_memory_for_one_step(h, batch)
        assert h.physical is not None
        h.physical.drift(_drifting(h.physical.uniform()))
    return _decode_step(h, batch)


def _decode_batches_differ(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The ranks' running batches differ (rank 0 lost a request its peer still decodes): no
    capacity reading can cause it, and a forward over different batches hangs or mixes outputs.
    Both ranks must stop, naming it, before the step runs."""
    batch = _prefilled_batch(h, 3)
    if rank == 0:
        assert h.physical is not None
        h.physical.drift(_drifting(0))
        batch.filter_batch(keep_indices=[0, 1])
    try:
        h.scheduler.update_running_batch(batch)
    except Exception as error:  # the scheduler stopping
        return {"stopped": type(error).__name__}
    return {"stopped": None}


DECODE_SCENARIOS: dict[str, MultiRoundScenario] = {
    "tp_decode_miss": _decode_miss_on_one_rank,
    "tp_decode_miss_last": _decode_miss_on_the_last_request,
    "tp_decode_batches_differ": _decode_batches_differ,
}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    return run_two_ranks(list(DECODE_SCENARIOS), DECODE_SCENARIOS, {})


def test_a_decode_miss_on_one_rank_retracts_alike(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_decode_miss")
    assert ranks[0] == ranks[1]  # kept, retracted, queue, free space, KV lengths: all alike
    r = ranks[0]
    assert len(r["retracted"]) == 1 and r["queue"] == r["retracted"]
    assert r["step_slots"] == len(r["kept"]) == 4  # the step runs, one slot per kept request
    assert r["misses"] == 1 and r["agreement_current"] == r["agreed_by_every_vote"]
    assert r["penalty_steps"] == [4]  # the step's tokens counted once, not once per try


def test_a_decode_miss_on_the_last_request_puts_it_back(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_decode_miss_last")
    assert ranks[0] == ranks[1]
    r = ranks[0]
    assert r["kept"] == [] and r["queue"] == r["retracted"] != []
    assert r["penalty_steps"] == []


def test_ranks_about_to_decode_different_batches_stop(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_decode_batches_differ")
    assert ranks[0] == ranks[1] == {"stopped": "DecodeRankDivergence"}


@pytest.mark.parametrize("rank_local", [True, False], ids=["rank-local", "plain"])
def test_a_decode_step_makes_one_collective_with_a_rank_local_pool(rank_local: bool) -> None:
    """With a rank-local pool a decode step makes one all-reduce (the vote); without, none."""
    with sh.build_harness(elastic=rank_local) as h:
        collectives: list[list[int]] = []

        def all_reduce_attn_groups(tensor: torch.Tensor, op: Any) -> None:
            collectives.append(tensor.tolist())

        h.tree_cache._all_reduce_attn_groups = all_reduce_attn_groups
        batch = _prefilled_batch(h, 2)
        collectives.clear()
        assert h.scheduler.update_running_batch(batch) is batch
        assert len(collectives) == (1 if rank_local else 0)
