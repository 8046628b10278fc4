"""The single-rank prefill unwind in operation: where it refuses, what it counts, and what it
costs a deployment without elastic pools (series entry "Scheduler: unwind a prefill batch whose
allocation misses instead of dying", sgl-project/sglang#34676).

Single-process tests on the real scheduler (scheduler_harness.py); the ranks' agreement is in
test_rank_agreement.py, the bounded retries in test_unwind_retries.py. A miss is a real pool whose
alloc reports None (`arm_miss`).

Expected: these tests FAIL without the unwind (every miss stops the scheduler) and PASS with it.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
import torch
from sglang.srt import runtime_context
from sglang.srt.managers.schedule_policy import PrefillAdder

SCHEDULER_LOGGER = "sglang.srt.managers.scheduler"
MAMBA: dict[str, Any] = {"mamba": True}


def _prompt(i: int, length: int = 20) -> list[int]:
    return list(range(1000 + 300 * i, 1000 + 300 * i + length))


def _holds_nothing(req: Any) -> bool:
    return not req.kv.holds_kv and not req.kv.holds_mamba and req.kv.mamba_ping_pong_track_buffer is None


# --------------------------------------------------------------------------------------------
# Modes where the unwind refuses: the miss stops the scheduler, as on 0.5.20, and says why
# --------------------------------------------------------------------------------------------
def test_pipeline_parallel_miss_stops_with_a_clear_error() -> None:
    """Each pipeline stage admits on its own pools and nothing agrees across stages: a stage
    that unwound while the others ran the batch would hang the pipeline. So under PP the miss is
    re-raised, naming the mode, before anything is released."""
    # The override encloses the harness: the harness restores the runtime context it found.
    with runtime_context.get_parallel().override(pp_size=2), sh.build_harness(**MAMBA) as h:
        reqs = [h.add_request(_prompt(i)) for i in range(2)]
        with (
            h.arm_miss("token_slots"),
            pytest.raises(RuntimeError, match=r"pipeline parallelism \(pp_size=2\)"),
        ):
            h.run_round()
        assert sh.num_prefill_unwinds(h) == 0
        assert h.scheduler.waiting_queue == []  # not requeued: the scheduler is stopping
        assert all(req.kv.holds_kv is False for req in reqs)  # the failed call took nothing


def _lmcache(h: sh.Harness) -> None:
    h.scheduler.enable_lmcache = True


def _hisparse(h: sh.Harness) -> None:
    h.scheduler.enable_hisparse = True


def _dsv4(h: sh.Harness) -> None:
    h.token_to_kv_pool_allocator.c128_attn_allocator = object()


REFUSED_MODES = {
    "LMCache": _lmcache,
    "HiSparse": _hisparse,
    "DeepSeek-V4's C128 KV allocator": _dsv4,
}


@pytest.mark.parametrize("mode", sorted(REFUSED_MODES))
def test_modes_whose_allocation_cannot_be_given_back_stop_by_name(mode: str) -> None:
    """LMCache (its loads are not awaited, its Mamba values are shared with its load flow),
    HiSparse (speculative scratch) and DeepSeek-V4 (the C128 bundle) allocate what the unwind
    cannot give back: a miss there stops the scheduler, naming the mode, before anything is
    released or requeued."""
    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator

    if mode == "HiSparse" and not hasattr(HiSparseCoordinator, "allocate_spec_scratch"):
        pytest.skip("this line's HiSparse takes no speculative scratch at allocation")
    with sh.build_harness() as h:
        REFUSED_MODES[mode](h)
        h.add_request(_prompt(0))
        with h.arm_miss("token_slots"), pytest.raises(RuntimeError, match=f"not unwound with {mode}"):
            h.run_round()
        assert sh.num_prefill_unwinds(h) == 0
        assert h.scheduler.waiting_queue == []  # not requeued: the scheduler is stopping


def test_a_peer_miss_gives_back_the_rotation_base_this_rank_stamped() -> None:
    """A page-interleaved pool stamps each request's rotation base during the allocation. When a
    peer rank missed, this rank gives its allocation back: the stamp goes too, or the retry's
    tree insert would record a base for pages the request no longer holds."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import PrefillRound

    with sh.build_harness() as h:
        reqs = [h.add_request(_prompt(i)) for i in range(2)]
        if not hasattr(reqs[0], "kv_rotation_base"):
            pytest.skip("this line stamps no rotation base")
        before = h.free_counts()
        real_allocate = ScheduleBatch.allocate_for_extend

        def allocate_and_stamp(batch: Any) -> Any:
            allocation = real_allocate(batch)
            for req in batch.reqs:
                req.kv_rotation_base = 3
            return allocation

        def peer_missed(batch: Any, allocated: bool) -> Any:
            h.scheduler.prefill_unwind_admit_cap = 1  # what the agreement sets on a miss
            return PrefillRound.MISSED

        with (
            mock.patch.object(ScheduleBatch, "allocate_for_extend", allocate_and_stamp),
            mock.patch.object(h.scheduler, "_settle_prefill_round", side_effect=peer_missed),
        ):
            assert h.run_round() is None
        assert [req.kv_rotation_base for req in reqs] == [None, None]
        assert h.free_counts() == before


def _pipeline_parallel(h: sh.Harness) -> None:
    """Nothing to set on the harness: the test's runtime context says pp_size=2."""


REFUSED_ON_A_PEER_MISS = {
    r"pipeline parallelism \(pp_size=2\)": _pipeline_parallel,
    **{f"not unwound with {mode}": set_mode for mode, set_mode in REFUSED_MODES.items()},
}


@pytest.mark.parametrize("refusal", sorted(REFUSED_ON_A_PEER_MISS))
def test_a_refused_mode_stops_on_a_peer_miss_and_gives_nothing_back_first(refusal: str) -> None:
    """The refusal does not depend on which rank missed: a rank that allocated but is told a
    peer missed stops too, naming the mode, and gives nothing back first (the refusal comes before
    the give-back: the scheduler stops with the batch's allocation held, as 0.5.20 stops at a
    miss, rather than free pages an LMCache load or a HiSparse scratch may still use)."""
    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.scheduler import PrefillRound

    if "HiSparse" in refusal and not hasattr(HiSparseCoordinator, "allocate_spec_scratch"):
        pytest.skip("this line's HiSparse takes no speculative scratch at allocation")
    pp_size = 2 if "pipeline" in refusal else 1
    with runtime_context.get_parallel().override(pp_size=pp_size), sh.build_harness() as h:
        REFUSED_ON_A_PEER_MISS[refusal](h)
        h.add_request(_prompt(0))
        before = h.free_counts()
        give_backs: list[Any] = []
        real_give_back = ScheduleBatch.give_back_extend

        def give_back(batch: Any, allocation: Any) -> None:
            give_backs.append(batch)
            real_give_back(batch, allocation)

        with (
            mock.patch.object(h.scheduler, "_settle_prefill_round", return_value=PrefillRound.MISSED),
            mock.patch.object(ScheduleBatch, "give_back_extend", give_back),
            pytest.raises(RuntimeError, match=refusal),
        ):
            h.run_round()
        assert sh.num_prefill_unwinds(h) == 0
        assert give_backs == []
        assert h.free_counts()["kv_tokens"] == before["kv_tokens"] - len(_prompt(0))


# --------------------------------------------------------------------------------------------
# Metrics: the queue time ends at the round that really runs the request
# --------------------------------------------------------------------------------------------
def test_forward_entry_time_is_recorded_only_for_a_batch_that_allocated() -> None:
    with sh.build_harness() as h:
        reqs = [h.add_request(_prompt(i)) for i in range(2)]
        with h.arm_miss("token_slots"):
            assert h.run_round() is None
        assert [r.time_stats.forward_entry_time for r in reqs] == [0.0, 0.0]
        batch = h.run_round()
        assert batch is not None and batch.reqs == reqs[:1]
        assert reqs[0].time_stats.forward_entry_time > 0.0
        assert reqs[1].time_stats.forward_entry_time == 0.0  # still queued behind the cap


# --------------------------------------------------------------------------------------------
# Priority preemption: no running work is evicted while backing off
# --------------------------------------------------------------------------------------------
def test_no_preemption_while_backing_off() -> None:
    """Every row is held by running requests; a new request can only be admitted by preempting
    one (`preempt_to_schedule`, answered "committed" here without retracting, so the row
    allocation then misses). After that unwind, the next rounds must not preempt again for a
    batch that may not run: preemption waits until a round allocates."""
    with sh.build_harness(req_rows=4) as h:
        sched = h.scheduler
        running = [h.add_request(_prompt(i)) for i in range(4)]
        batch = h.run_round()
        assert batch is not None and batch.reqs == running
        sched.running_batch = batch  # the loop merges the prefill batch into the running batch
        sched.enable_priority_preemption = True
        newcomer = h.add_request(_prompt(9))
        calls: list[str] = []

        def preempt_to_schedule(adder: PrefillAdder, req: Any) -> bool:
            calls.append(req.rid)
            return True

        with mock.patch.object(PrefillAdder, "preempt_to_schedule", preempt_to_schedule):
            assert h.run_round() is None  # admitted by "preemption", then its row misses
            assert calls == [newcomer.rid]
            assert sched.waiting_queue == [newcomer] and sched.prefill_unwind_admit_cap == 1
            for _ in range(3):
                assert h.run_round() is None
        assert calls == [newcomer.rid]  # not once more while the cap is on


# --------------------------------------------------------------------------------------------
# Cost: without a pool that can miss on one rank, nothing is agreed and nothing waits
# --------------------------------------------------------------------------------------------
def test_no_collective_and_no_wait_without_an_elastic_pool() -> None:
    """Pools whose free space every rank computes alike miss alike on every rank: a round that
    allocates or admits nothing makes no collective and never waits. A missed round (which every
    rank reaches alike) makes one, through the tree cache's helper: how long its requests have
    been missing, the most any rank measured (its wall-clock deadline). Any other collective
    fails the test."""
    with sh.build_harness(hicache=True) as h:
        collectives: list[str] = []
        agreed_in: list[str] = []
        round_name = ["allocates"]

        def spy(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> None:
                collectives.append(name)
                raise AssertionError(f"{name} called")

            return call

        def agreement_helper(tensor: torch.Tensor, op: Any) -> None:
            agreed_in.append(round_name[0])

        with (
            mock.patch.object(torch.distributed, "all_reduce", spy("all_reduce")),
            mock.patch.object(torch.distributed, "get_world_size", spy("get_world_size")),
            mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", agreement_helper),
            h.spy_releases(),
        ):
            h.add_request(_prompt(0))
            assert h.run_round() is not None
            round_name[0] = "nothing queued"
            assert h.run_round() is None
            h.add_request(_prompt(1))
            round_name[0] = "missed"
            with h.arm_miss("token_slots"):
                assert h.run_round() is None
        assert collectives == []
        wall_clock_deadline = getattr(h.scheduler, "_prefill_unwind_clock", None) is not None
        assert agreed_in == (["missed"] if wall_clock_deadline else [])
        assert [op for op, _ in h.device_log.entries if op == "synchronize"] == []
