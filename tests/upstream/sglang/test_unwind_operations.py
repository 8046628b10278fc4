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
import types
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
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

SCHEDULER_LOGGER = "sglang.srt.managers.scheduler"
MAMBA: dict[str, Any] = {"mamba": True}
# Back-offs of 5, 10, 20 and 40 ms pass 50 ms: the fifth miss in a row aborts.
DEADLINE_S = 0.05
MISSES_TO_ABORT = 5
BACKOFFS_S = [0.005, 0.01, 0.02, 0.04]


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
            mock.patch.object(h.scheduler, "_agree_on_prefill_round", side_effect=peer_missed),
        ):
            assert h.run_round() is None
        assert [req.kv_rotation_base for req in reqs] == [None, None]
        assert h.free_counts() == before


def test_an_abort_under_pd_disaggregation_releases_the_prefill_side() -> None:
    """On a PD-disaggregation prefill server, a request aborted after its retries is released
    as a queued one is (release_aborted_prefill_waiting_req): its KV sender is told, its
    metadata buffer goes back, and nothing else is held."""
    from sglang.srt.disaggregation.utils import DisaggregationMode

    with envs.SGLANG_PREFILL_UNWIND_DEADLINE_S.override(0.0), sh.build_harness() as h:
        sched = h.scheduler
        released: list[str] = []
        real = type(sched).release_aborted_prefill_waiting_req

        class Sender:
            def abort(self) -> None:
                released.append("sender")

        class MetadataBuffers:
            def free(self, index: int) -> None:
                released.append(f"metadata {index}")

        sched.req_to_metadata_buffer_idx_allocator = MetadataBuffers()
        sched.clear_pending_chunk_send = lambda req: released.append("chunk sends")
        req = h.add_request(_prompt(0))
        sched.disaggregation_mode = DisaggregationMode.PREFILL  # after queueing: no bootstrap
        req.disagg_kv_sender = Sender()
        req.metadata_buffer_index = 3
        with (
            mock.patch.object(
                type(sched), "release_aborted_prefill_waiting_req", autospec=True, side_effect=real
            ) as release,
            h.arm_miss("token_slots"),
        ):
            assert h.run_round() is None
        assert [call.args[1] for call in release.call_args_list] == [req]
        assert released == ["chunk sends", "sender", "metadata 3"]
        assert _holds_nothing(req) and req.finished()


def test_pipeline_parallel_refuses_a_peer_stage_miss_too() -> None:
    """Under PP the refusal does not depend on which rank missed: a rank that allocated but is
    told a peer missed stops too, naming the mode, and gives nothing back first."""
    from sglang.srt.managers.scheduler import PrefillRound

    with runtime_context.get_parallel().override(pp_size=2), sh.build_harness() as h:
        h.add_request(_prompt(0))
        with (
            mock.patch.object(h.scheduler, "_agree_on_prefill_round", return_value=PrefillRound.MISSED),
            pytest.raises(RuntimeError, match=r"pipeline parallelism \(pp_size=2\)"),
        ):
            h.run_round()
        assert sh.num_prefill_unwinds(h) == 0


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
class FakeClock:
    """The scheduler's back-off sleeps, recorded instead of slept."""

    def __init__(self) -> None:
        self.sleeps: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


@pytest.fixture
def deadline() -> Any:
    with envs.SGLANG_PREFILL_UNWIND_DEADLINE_S.override(DEADLINE_S):
        yield DEADLINE_S


def _fake_clock(h: sh.Harness) -> FakeClock:
    clock = FakeClock()
    h.scheduler._prefill_unwind_sleep = clock.sleep
    return clock


def _abort_outputs(h: sh.Harness) -> list[Any]:
    return list(h.scheduler.ipc_channels.send_to_tokenizer.outputs)


def test_persistent_miss_aborts_the_request(deadline: float, caplog: pytest.LogCaptureFixture) -> None:
    """The head request misses every round. With nothing running, the scheduler backs off between
    attempts (5, 10, 20, 40 ms: doubling), and once the head has been backed off for the deadline
    it is aborted through the normal abort path (the client gets a 503 with the reason, through
    `send_abort_output`), holding nothing. The request behind it then runs. One warning line for
    the whole run of unwinds; every unwind and the abort are counted, also in Prometheus."""
    with sh.build_harness(**MAMBA) as h:
        metrics = h.enable_metrics()
        clock = _fake_clock(h)
        caplog.set_level(logging.WARNING, logger=SCHEDULER_LOGGER)
        head = h.add_request(_prompt(0))
        behind = h.add_request(_prompt(1))
        rounds = 0
        with (
            h.arm_miss("token_slots"),
            mock.patch.object(
                h.scheduler, "send_abort_output", wraps=h.scheduler.send_abort_output
            ) as send_abort_output,
        ):
            while head in h.scheduler.waiting_queue and rounds < 20:
                assert h.run_round() is None
                rounds += 1
        assert rounds == MISSES_TO_ABORT
        assert clock.sleeps == BACKOFFS_S and sum(clock.sleeps) >= deadline
        [abort] = _abort_outputs(h)
        assert send_abort_output.call_count == 1  # the path the Rust server also reads
        assert abort.rid == head.rid
        assert abort.finished_reason["status_code"] == HTTPStatus.SERVICE_UNAVAILABLE
        assert f"SGLANG_PREFILL_UNWIND_DEADLINE_S={deadline}" in abort.finished_reason["message"]
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
        assert behind.consecutive_prefill_unwinds == 0 and behind.prefill_unwind_backoff_s == 0.0
        h.finish_request(behind)
        h.prepare_next_round()
        assert h.idle_leak_report() == []


def test_the_bound_is_time_not_rounds(deadline: float) -> None:
    """A longer deadline takes more attempts, and the back-off stops doubling at its ceiling:
    with a 1 s deadline the head is retried until 1 s of back-off (capped at 250 ms) is spent."""
    with envs.SGLANG_PREFILL_UNWIND_DEADLINE_S.override(1.0), sh.build_harness() as h:
        clock = _fake_clock(h)
        head = h.add_request(_prompt(0))
        with h.arm_miss("token_slots"):
            for _ in range(50):
                if head not in h.scheduler.waiting_queue:
                    break
                assert h.run_round() is None
        assert [a.rid for a in _abort_outputs(h)] == [head.rid]
        assert max(clock.sleeps) == 0.25 and 1.0 <= sum(clock.sleeps) < 1.25
        assert len(clock.sleeps) == 9  # 5 ... 160 ms, then 250 ms three times


def test_no_sleep_while_requests_run(deadline: float) -> None:
    """With requests running, their decode steps space the attempts: the scheduler does not
    sleep, and the same count of misses still aborts (the bound does not depend on who slept)."""
    with sh.build_harness(req_rows=8) as h:
        clock = _fake_clock(h)
        running = h.add_request(_prompt(0))
        batch = h.run_round()
        assert batch is not None
        h.scheduler.running_batch = batch
        head = h.add_request(_prompt(1))
        rounds = 0
        with h.arm_miss("token_slots"):
            while head in h.scheduler.waiting_queue and rounds < 20:
                assert h.run_round() is None
                rounds += 1
        assert rounds == MISSES_TO_ABORT and clock.sleeps == []
        assert [a.rid for a in _abort_outputs(h)] == [head.rid]
        assert not running.finished()


@pytest.mark.parametrize("config", [MAMBA, {}], ids=["mamba", "no-mamba"])
def test_persistent_miss_aborts_a_continuing_chunked_request(deadline: float, config: dict[str, Any]) -> None:
    """A continuing chunked request is admitted before the back-off cap, so without a bound its
    next chunk would be retried forever. Past the deadline it is aborted and gives back its row,
    the KV of its earlier chunks, its lock and (with Mamba) its Mamba slot: each on its own, so
    a request without a Mamba slot is released as fully."""
    with sh.build_harness(**config, chunked_prefill_size=64) as h:
        _fake_clock(h)
        long = h.add_request(_prompt(0, 200))
        first = h.run_round()
        assert first is not None and h.scheduler.chunked_req is long
        h.prepare_next_round()
        rounds = 0
        with h.arm_miss("token_slots"):
            while h.scheduler.chunked_req is long and rounds < 20:
                assert h.run_round() is None
                rounds += 1
        assert rounds == MISSES_TO_ABORT
        assert [a.rid for a in _abort_outputs(h)] == [long.rid]
        assert _holds_nothing(long) and long.finished()
        assert h.scheduler.chunked_req is None and h.scheduler.waiting_queue == []
        h.prepare_next_round()
        assert h.tree_cache.protected_size() == 0
        assert h.idle_leak_report() == []


def test_a_round_that_allocates_resets_the_count(deadline: float) -> None:
    """Only unwinds in a row count: a request that ran in between starts again from zero."""
    with sh.build_harness() as h:
        _fake_clock(h)
        reqs = [h.add_request(_prompt(i)) for i in range(2)]
        with h.arm_miss("token_slots"):
            for _ in range(MISSES_TO_ABORT - 1):
                assert h.run_round() is None
        assert [r.consecutive_prefill_unwinds for r in reqs] == [MISSES_TO_ABORT - 1, 1]
        batch = h.run_round()
        assert batch is not None and batch.reqs == reqs[:1]
        assert reqs[0].consecutive_prefill_unwinds == 0 and reqs[0].prefill_unwind_backoff_s == 0.0
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


# Every pool the agreement consults, each of which turns it on alone.
CONSULTED_POOLS: dict[str, Any] = {
    "allocator": lambda h: h.token_to_kv_pool_allocator,
    "kv_cache": lambda h: h.token_to_kv_pool_allocator.get_kvcache(),
    "request_pool": lambda h: h.req_to_token_pool,
    "mamba_pool": lambda h: h.req_to_token_pool.mamba_pool,
    "mamba_slots": lambda h: getattr(h.req_to_token_pool, "mamba_allocator", None),
}


@pytest.mark.parametrize("pool", sorted(CONSULTED_POOLS))
def test_a_rank_local_pool_turns_the_agreement_on(pool: str) -> None:
    """A pool that declares `rank_local_capacity` (kvcached's elastic pools do) turns the
    agreement on, whichever of the consulted pools it is: a round with requests to admit first
    agrees on the free space of the pools that report one, then votes once after allocating,
    through the tree cache's own all-reduce over the attention groups. A round with nothing to
    admit (nothing queued, no chunk) makes no collective: no rank can admit in it."""
    with sh.build_harness(**MAMBA) as h:
        declaring = CONSULTED_POOLS[pool](h)
        if declaring is None:
            pytest.skip(f"this line has no {pool}")
        declaring.rank_local_capacity = True
        votes: list[list[int]] = []
        real = h.tree_cache._all_reduce_attn_groups

        def all_reduce_attn_groups(tensor: torch.Tensor, op: Any) -> None:
            votes.append(tensor.tolist())
            real(tensor, op)

        with mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", all_reduce_attn_groups):
            h.add_request(_prompt(0))
            assert h.run_round() is not None
            per_admitting_round = len(votes)
            assert h.run_round() is None
        free_space = votes[:-1]
        # One reading per pool that reports free space (a KV cache, a Mamba state pool: none).
        assert len(free_space) == int(callable(getattr(declaring, "available_size", None)))
        assert all(free < 0 for free in (free_space or [[-1]])[0])  # MIN as MAX of negatives
        missed, fingerprint, neg_fingerprint, batch_size = votes[-1]
        assert (missed, batch_size) == (0, 1) and fingerprint == -neg_fingerprint != 0
        assert len(votes) == per_admitting_round  # the empty round made no collective


def test_a_rank_local_pool_without_an_agreement_helper_stops_never_unwinds_alone() -> None:
    """Across TP ranks, a pool whose free space is per rank under a tree cache with no agreement
    helper (FlexKV's): a miss on one rank cannot be put back on the others, so it stops the
    scheduler, naming why; a round that allocates runs, with no collective."""
    with sh.build_harness() as h:
        h.token_to_kv_pool_allocator.rank_local_capacity = True
        h.scheduler.tp_cpu_group = object()
        with (
            mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", None),
            mock.patch.object(torch.distributed, "get_world_size", return_value=2),
            mock.patch.object(torch.distributed, "all_reduce", side_effect=AssertionError("collective")),
        ):
            h.add_request(_prompt(0))
            assert h.run_round() is not None
            h.add_request(_prompt(1))
            with h.arm_miss("token_slots"), pytest.raises(RuntimeError, match="no cross-rank agreement"):
                h.run_round()
        assert sh.num_prefill_unwinds(h) == 0


def test_a_kvcached_attribute_alone_turns_nothing_on() -> None:
    """The capability is declared, not guessed from kvcached's own attribute names."""
    with sh.build_harness() as h:
        h.token_to_kv_pool_allocator.kvcached_allocator = object()
        with mock.patch.object(h.tree_cache, "_all_reduce_attn_groups", side_effect=AssertionError("agreed")):
            h.add_request(_prompt(0))
            assert h.run_round() is not None


def test_a_composite_pool_answers_for_its_parts() -> None:
    """A hybrid-SWA allocator reads its free space from its full and SWA sub-allocators, which
    kvcached makes elastic: it reports rank-local capacity when one of them does, and the pools
    whose readings the agreement adjusts are the sub-allocators (never both levels)."""
    from sglang.srt.mem_cache.allocator.base import has_rank_local_capacity, rank_local_pools

    full = TokenToKVPoolAllocator(64, torch.float16, "cpu", None, False)
    swa = TokenToKVPoolAllocator(32, torch.float16, "cpu", None, False)
    composite = SWATokenToKVPoolAllocator.__new__(SWATokenToKVPoolAllocator)
    composite.full_attn_allocator, composite.swa_attn_allocator = full, swa
    assert not has_rank_local_capacity(composite) and rank_local_pools(composite) == []
    swa.rank_local_capacity = True
    assert has_rank_local_capacity(composite)
    assert rank_local_pools(composite) == [swa]
    composite.rank_local_capacity = True  # declared on the composite itself too
    assert rank_local_pools(composite) == [swa]

    # The hybrid-SWA KV pool, likewise (kvcached makes its full and SWA pools elastic).
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    kv_pool = SWAKVPool.__new__(SWAKVPool)
    static, elastic = types.SimpleNamespace(), types.SimpleNamespace(rank_local_capacity=True)
    kv_pool.full_kv_pool, kv_pool.swa_kv_pool = static, elastic
    assert has_rank_local_capacity(kv_pool) and rank_local_pools(kv_pool) == [elastic]


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
