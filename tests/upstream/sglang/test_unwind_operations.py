"""The prefill unwind in operation: where it refuses, what it counts, when it gives up, and what it
costs a deployment without elastic pools.

Single-process tests on the real scheduler (scheduler_harness.py); the two-rank behaviour is in
test_prefill_unwind.py. A miss is a real pool whose alloc reports None (`arm_miss`).

Expected: these tests FAIL on pristine 0.5.20 (it has no unwind: every miss stops the scheduler)
and PASS with the series, except `test_decode_miss_still_stops_with_its_diagnostics`, which pins
behaviour the series keeps as 0.5.20 has it.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
import torch
from sglang.srt import runtime_context
from sglang.srt.environ import envs
from sglang.srt.managers.schedule_policy import PrefillAdder
from sglang.srt.mem_cache import allocation

SCHEDULER_LOGGER = "sglang.srt.managers.scheduler"
MAMBA: dict[str, Any] = {"mamba": True}
RETRY_LIMIT = 3


def _prompt(i: int, length: int = 20) -> list[int]:
    return list(range(1000 + 300 * i, 1000 + 300 * i + length))


def _holds_nothing(req: Any) -> bool:
    return not req.kv.holds_kv and not req.kv.holds_mamba and req.kv.mamba_ping_pong_track_buffer is None


def _warnings(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == SCHEDULER_LOGGER and r.levelno == logging.WARNING and text in r.getMessage()
    ]


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
# Bounded retries: a request that keeps missing is aborted, and operators can see it
# --------------------------------------------------------------------------------------------
@pytest.fixture
def retry_limit() -> Any:
    with envs.SGLANG_PREFILL_UNWIND_RETRY_LIMIT.override(RETRY_LIMIT):
        yield RETRY_LIMIT


def _abort_outputs(h: sh.Harness) -> list[Any]:
    return list(h.scheduler.ipc_channels.send_to_tokenizer.outputs)


def test_persistent_miss_aborts_the_request(retry_limit: int, caplog: pytest.LogCaptureFixture) -> None:
    """The head request misses every round: it is requeued `limit` times, then aborted through
    the normal abort path (the client gets a 503 with the reason), holding nothing. The request
    behind it then runs. One warning line for the whole run of unwinds; every unwind and the
    abort are counted, also in the Prometheus counters."""
    with sh.build_harness(**MAMBA) as h:
        metrics = h.enable_metrics()
        caplog.set_level(logging.WARNING, logger=SCHEDULER_LOGGER)
        head = h.add_request(_prompt(0))
        behind = h.add_request(_prompt(1))
        rounds = 0
        with h.arm_miss("token_slots"):
            while head in h.scheduler.waiting_queue and rounds < 10:
                assert h.run_round() is None
                rounds += 1
        assert rounds == retry_limit + 1
        [abort] = _abort_outputs(h)
        assert abort.rid == head.rid
        assert abort.finished_reason["status_code"] == HTTPStatus.SERVICE_UNAVAILABLE
        assert f"SGLANG_PREFILL_UNWIND_RETRY_LIMIT={retry_limit}" in abort.finished_reason["message"]
        assert _holds_nothing(head) and head.finished()
        assert h.scheduler.waiting_queue == [behind]
        assert h.scheduler.num_prefill_unwinds == rounds
        assert h.scheduler.num_prefill_unwind_aborts == 1
        assert metrics["sglang:num_prefill_unwinds_total"].total == rounds
        assert metrics["sglang:num_prefill_unwind_aborted_requests_total"].total == 1
        assert len(_warnings(caplog, "unwound")) == 1  # rate-limited
        assert len(_warnings(caplog, f"Aborting request {head.rid}")) == 1

        batch = h.run_round()  # nothing armed: the request behind runs, with a fresh count
        assert batch is not None and batch.reqs == [behind]
        assert behind.consecutive_prefill_unwinds == 0
        h.finish_request(behind)
        h.prepare_next_round()
        assert h.idle_leak_report() == []


def test_persistent_miss_aborts_a_continuing_chunked_request(retry_limit: int) -> None:
    """A continuing chunked request is admitted before the back-off cap, so without a bound its
    next chunk would be retried forever. Past the limit it is aborted and gives back its row, the
    KV of its earlier chunks, its lock and its Mamba slot."""
    with sh.build_harness(**MAMBA, chunked_prefill_size=64) as h:
        long = h.add_request(_prompt(0, 200))
        first = h.run_round()
        assert first is not None and h.scheduler.chunked_req is long
        h.prepare_next_round()
        rounds = 0
        with h.arm_miss("token_slots"):
            while h.scheduler.chunked_req is long and rounds < 10:
                assert h.run_round() is None
                rounds += 1
        assert rounds == retry_limit + 1
        assert [a.rid for a in _abort_outputs(h)] == [long.rid]
        assert _holds_nothing(long) and long.finished()
        assert h.scheduler.chunked_req is None and h.scheduler.waiting_queue == []
        h.prepare_next_round()
        assert h.tree_cache.protected_size() == 0
        assert h.idle_leak_report() == []


def test_a_round_that_allocates_resets_the_count(retry_limit: int) -> None:
    """Only unwinds in a row count: a request that ran in between starts again from zero."""
    with sh.build_harness() as h:
        reqs = [h.add_request(_prompt(i)) for i in range(2)]
        with h.arm_miss("token_slots"):
            for _ in range(retry_limit):
                assert h.run_round() is None
        assert [r.consecutive_prefill_unwinds for r in reqs] == [retry_limit, 1]
        batch = h.run_round()
        assert batch is not None and batch.reqs == reqs[:1]
        assert reqs[0].consecutive_prefill_unwinds == 0
        assert _abort_outputs(h) == []


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
    """Pools whose free space every rank computes alike miss alike on every rank: a round makes
    no collective, whether it allocates, misses or admits nothing, and a round that allocates
    never waits. Any collective, or the tree cache's agreement helper, fails the test."""
    with sh.build_harness(hicache=True) as h:
        collectives: list[str] = []

        def spy(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> None:
                collectives.append(name)
                raise AssertionError(f"{name} called")

            return call

        with (
            mock.patch.object(torch.distributed, "all_reduce", spy("all_reduce")),
            mock.patch.object(torch.distributed, "get_world_size", spy("get_world_size")),
            mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", spy("_all_reduce_attn_groups")),
            h.spy_releases(),
        ):
            h.add_request(_prompt(0))
            assert h.run_round() is not None
            assert h.run_round() is None  # nothing queued
            h.add_request(_prompt(1))
            with h.arm_miss("token_slots"):
                assert h.run_round() is None
        assert collectives == []
        assert [op for op, _ in h.device_log.entries if op == "synchronize"] == []


def test_a_kvcached_pool_turns_the_agreement_on() -> None:
    """kvcached's elastic allocators carry `kvcached_allocator`; with one, every prefill round
    (one that admits nothing included) agrees through the tree cache's own all-reduce over the
    attention groups, once."""
    with sh.build_harness() as h:
        h.token_to_kv_pool_allocator.kvcached_allocator = object()
        votes: list[list[int]] = []
        real = h.tree_cache._all_reduce_attn_groups

        def all_reduce_attn_groups(tensor: torch.Tensor, op: Any) -> None:
            votes.append(tensor.tolist())
            real(tensor, op)

        with mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", all_reduce_attn_groups):
            h.add_request(_prompt(0))
            assert h.run_round() is not None
            assert h.run_round() is None
        assert len(votes) == 2
        assert votes[1] == [0, 0, 0, 0]  # the round that admitted nothing still voted


# --------------------------------------------------------------------------------------------
# Scope: misses the series does not unwind still stop the scheduler, with their diagnostics
# --------------------------------------------------------------------------------------------
def test_decode_miss_still_stops_with_its_diagnostics(caplog: pytest.LogCaptureFixture) -> None:
    """Decode allocates through `alloc_token_slots` (alloc_for_decode). Its miss is not unwound:
    it raises a RuntimeError (AllocationMiss is one) after logging the error and printing the
    tree, as 0.5.20 does."""
    with sh.build_harness() as h:
        caplog.set_level(logging.ERROR)
        with (
            mock.patch.object(h.token_to_kv_pool_allocator, "alloc", return_value=None),
            mock.patch.object(h.tree_cache, "pretty_print") as pretty_print,
            pytest.raises(RuntimeError, match="Out of memory"),
        ):
            allocation.alloc_token_slots(h.tree_cache, 8)
        pretty_print.assert_called_once()
        assert any(
            "Try to allocate 8 tokens" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR
        )
