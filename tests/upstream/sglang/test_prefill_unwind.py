"""The prefill allocation-miss unwind (series entry "Scheduler: unwind a prefill batch whose
allocation misses instead of dying", sgl-project/sglang#34676).

When `prepare_for_extend` cannot allocate although admission said yes (an elastic kvcached pool, an
undersized Mamba pool), 0.5.20 raises out of `Scheduler._get_new_batch_prefill_raw` and the
scheduler process dies. With the patch the round returns None and the batch goes back to the head
of the waiting queue with nothing held. Everything below the scheduler is the real upstream code
(see scheduler_harness.py); a miss is a real pool whose alloc reports None (`arm_miss`).

Expected: these tests FAIL on pristine 0.5.20 and PASS with the patch. Tests named `*_bug_*` pin
defects found in earlier versions of the patch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple
from unittest import mock

import forked_ranks
import pytest
import scheduler_harness as sh
import torch.distributed as dist
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import EvictParams

SCHEDULER_LOGGER = "sglang.srt.managers.scheduler"
PREFIX = list(range(100, 132))  # 32 tokens: whole pages for page_size 1 and 4
MAMBA: dict[str, Any] = {"mamba": True}
PING_PONG: dict[str, Any] = {"mamba": True, "ping_pong": True}


def _prompt(i: int, length: int = 20) -> list[int]:
    """Token ids that share no prefix with another `_prompt(j)` nor with PREFIX."""
    return list(range(1000 + 300 * i, 1000 + 300 * i + length))


def _unwind_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == SCHEDULER_LOGGER and "unwound" in r.getMessage()]


def _holds_nothing(req: Req) -> bool:
    """No row, no Mamba state slot, no ping-pong track slots: what a queued request holds."""
    return (
        not req.kv.holds_kv
        and not req.kv.holds_mamba
        and req.kv.mamba_ping_pong_track_buffer is None
        and req.kv.mamba_cow_src_index is None
    )


def _drain(h: sh.Harness, max_rounds: int = 50) -> list[str]:
    """Run rounds (no miss armed) until nothing is queued or chunked, finishing each request
    once its last chunk is scheduled. Returns the rids in the order they finished."""
    finished: list[str] = []
    for _ in range(max_rounds):
        sched = h.scheduler
        if not sched.waiting_queue and sched.chunked_req is None:
            return finished
        h.prepare_next_round()
        batch = h.run_round()
        assert batch is not None, "a round with work queued and nothing armed must schedule"
        for req in batch.reqs:
            if req is not sched.chunked_req:
                h.finish_request(req)
                finished.append(req.rid)
    raise AssertionError(f"queue not drained after {max_rounds} rounds")


# --------------------------------------------------------------------------------------------
# Every miss site: requeue at the head, release everything, back off, then schedule
# --------------------------------------------------------------------------------------------
class SiteCase(NamedTuple):
    config: dict[str, Any]
    site: sh.MissSite
    after: int  # matching allocations inside alloc_for_extend that still succeed
    prefix: Literal["none", "device", "host"]  # what the batch's first request hits


SITE_CASES = {
    "req_rows": SiteCase({}, "req_rows", 0, "none"),
    "token_slots": SiteCase({}, "token_slots", 0, "none"),
    "paged_extend": SiteCase({"page_size": 4}, "paged_extend", 0, "none"),
    "mamba_req_rows": SiteCase(MAMBA, "req_rows", 0, "none"),
    # after=1: the first request's state slot is taken in the failing call, the second misses.
    "mamba_slot": SiteCase(MAMBA, "mamba_slot", 1, "none"),
    "mamba_token_slots": SiteCase(MAMBA, "token_slots", 0, "none"),
    # after=1: the first request's ping-pong pair is taken in the failing call.
    "ping_pong": SiteCase(PING_PONG, "ping_pong", 1, "none"),
    "ping_pong_token_slots": SiteCase(PING_PONG, "token_slots", 0, "none"),
    "ping_pong_paged_extend": SiteCase({**PING_PONG, "page_size": 4}, "paged_extend", 0, "none"),
    # A device prefix hit: admission locks the prefix (schedule_policy.py:1092-1094).
    "device_prefix_token_slots": SiteCase({}, "token_slots", 0, "device"),
    "device_prefix_paged_extend": SiteCase({"page_size": 4}, "paged_extend", 0, "device"),
    "device_prefix_mamba_slot": SiteCase(MAMBA, "mamba_slot", 0, "device"),
    # A host hit: admission loads the prefix back and the round starts the H2D load.
    "host_prefix_token_slots": SiteCase({"hicache": True}, "token_slots", 0, "host"),
    "host_prefix_paged_extend": SiteCase({"hicache": True, "page_size": 4}, "paged_extend", 0, "host"),
    "host_prefix_ping_pong": SiteCase({"hicache": True, **PING_PONG}, "ping_pong", 1, "host"),
}
# --prefill-max-requests 4: four requests are admitted, a fifth stays queued behind them. (Filling
# the rows instead would also set running_batch.batch_is_full; see test_bug_unwind_leaves_batch_full.)
ADMITTED = 4


@pytest.mark.parametrize("case", SITE_CASES.values(), ids=SITE_CASES.keys())
def test_miss_unwinds_the_batch(case: SiteCase, caplog: pytest.LogCaptureFixture) -> None:
    with sh.build_harness(**case.config, prefill_max_requests=ADMITTED) as h:
        sched = h.scheduler
        prefix_len = 0
        if case.prefix == "device":
            h.cache_prefix(PREFIX)
        elif case.prefix == "host":
            h.put_prefix_on_host(PREFIX)
        if case.prefix != "none":
            prefix_len = len(PREFIX)
            first = h.add_request([*PREFIX, 7, 8, 9, 10])
            reqs = [first] + [h.add_request(_prompt(i)) for i in range(ADMITTED - 1)]
        else:
            reqs = [h.add_request(_prompt(i)) for i in range(ADMITTED)]
        behind = h.add_request(_prompt(9))  # not admitted this round
        before = h.free_counts()
        caplog.set_level(logging.WARNING, logger=SCHEDULER_LOGGER)

        with h.arm_miss(case.site, after=case.after) as reported:
            batch = h.run_round()

        assert batch is None  # the round schedules nothing ...
        assert reported == [case.site]
        # ... and the batch is back at the head of the queue, in its order, ahead of `behind`.
        assert sched.waiting_queue == [*reqs, behind]
        assert all(_holds_nothing(r) for r in reqs)
        assert sched.chunked_req is None
        assert sh.num_prefill_unwinds(h) == 1
        assert len(_unwind_records(caplog)) == 1
        assert sched.prefill_unwind_admit_cap == ADMITTED // 2
        after = h.free_counts()
        if case.prefix == "host":
            # The loaded prefix now lives on device in the tree (load_back gave it KV and, with
            # Mamba, a node slot); the batch itself holds nothing. Its nodes stay locked by the
            # ongoing load until the loop's loading_check sees the load land.
            tree_took = {"kv_tokens": prefix_len, "mamba_slots": 1 if h.cfg.mamba else 0}
            assert after == {k: v - tree_took.get(k, 0) for k, v in before.items()}
            h.prepare_next_round()
        else:
            assert after == before
        assert h.tree_cache.protected_size() == 0  # every admission lock released

        # Back-off: the next round admits at most half of the unwound batch, then the cap lifts.
        retry = h.run_round()
        assert retry is not None and retry.reqs == reqs[: ADMITTED // 2]
        assert sched.prefill_unwind_admit_cap is None
        assert sh.prefix_len(retry.reqs[0]) == prefix_len  # the hit is still a hit
        for req in retry.reqs:
            h.finish_request(req)
        assert _drain(h) == [r.rid for r in reqs[ADMITTED // 2 :]] + [behind.rid]
        assert sh.num_prefill_unwinds(h) == 1
        assert h.idle_leak_report() == []


@pytest.mark.parametrize("site", ["mamba_slot", "ping_pong"])
def test_mamba_miss_takes_nothing_in_the_failing_call(site: sh.MissSite) -> None:
    """HybridReqToTokenPool.alloc, when its Mamba (or ping-pong) allocation misses, gives back the
    rows and state slots that same call already took: None means nothing taken."""
    with sh.build_harness(**PING_PONG) as h:
        reqs = [h.add_request(_prompt(i)) for i in range(3)]
        pool = h.req_to_token_pool
        real_alloc = pool.alloc
        seen: list[tuple[dict[str, int], Any, dict[str, int]]] = []

        def alloc(batch_reqs: list[Req]) -> Any:
            free_before = h.free_counts()
            result = real_alloc(batch_reqs)
            seen.append((free_before, result, h.free_counts()))
            return result

        with mock.patch.object(pool, "alloc", alloc), h.arm_miss(site, after=1):
            assert h.run_round() is None

        [(free_before, result, free_after)] = seen
        assert result is None
        assert free_after == free_before  # the first request's row and slots are back
        assert all(_holds_nothing(r) for r in reqs)


def test_bug_unwind_leaves_batch_full() -> None:
    """Admission sets running_batch.batch_is_full when the batch takes the last rows (or runs out
    of tokens) (scheduler.py:3884-3888, :3943-3950 at 0.5.20). The unwind does not restore it, and
    with nothing running nothing clears it (no last batch to filter, :3626-3630; no decode step
    for an empty batch, :3677): every later round returns None at :3772-3775 and the requeued
    requests are never scheduled. One request keeps running: from 0.5.23 on, upstream clears the
    flag of an EMPTY running batch itself, which would hide a missing restore."""
    with sh.build_harness(req_rows=ADMITTED + 1) as h:
        running = h.add_request(_prompt(9))
        first = h.run_round()
        assert first is not None and first.reqs == [running]
        h.scheduler.running_batch = first  # the loop merges it into the running batch
        reqs = [h.add_request(_prompt(i)) for i in range(ADMITTED + 1)]
        with h.arm_miss("token_slots"):
            assert h.run_round() is None
        assert h.scheduler.waiting_queue == reqs

        assert h.scheduler.running_batch.batch_is_full is False
        retry = h.run_round()
        assert retry is not None and retry.reqs == reqs[: ADMITTED // 2]


# --------------------------------------------------------------------------------------------
# Chunked prefill
# --------------------------------------------------------------------------------------------
CHUNK = 64


class ChunkedState(NamedTuple):
    row: int
    mamba: Any
    ping_pong: Any
    inflight: int
    protected: int
    prefix_len: int


def _chunked_state(h: sh.Harness, req: Req) -> ChunkedState:
    kv = req.kv
    return ChunkedState(
        row=kv.req_pool_idx,
        mamba=None if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx),
        ping_pong=None
        if kv.mamba_ping_pong_track_buffer is None
        else kv.mamba_ping_pong_track_buffer.tolist(),
        inflight=req.inflight_middle_chunks,
        protected=h.tree_cache.protected_size(),
        prefix_len=sh.prefix_len(req),
    )


def _start_chunked(h: sh.Harness, length: int) -> Req:
    """A request longer than a chunk whose first chunk was scheduled and cached the way the loop
    does between rounds (stash_chunked_request), i.e. a continuing chunked prefill."""
    long = h.add_request(_prompt(0, length))
    first = h.run_round()
    assert first is not None and first.reqs == [long] and h.scheduler.chunked_req is long
    h.prepare_next_round()
    assert sh.prefix_len(long) == CHUNK
    return long


CHUNK_CONFIGS = {"page1": {}, "mamba_ping_pong": PING_PONG}
# 200 tokens: chunk 2 is a middle chunk. 100: chunk 2 is the last (36 tokens) and a 20-token
# request fits behind it in the same round, so the unwound batch has both.
CHUNK_LENGTHS = {"middle_chunk": 200, "last_chunk": 100}


@pytest.mark.parametrize("length", CHUNK_LENGTHS.values(), ids=CHUNK_LENGTHS.keys())
@pytest.mark.parametrize("config", CHUNK_CONFIGS.values(), ids=CHUNK_CONFIGS.keys())
def test_continuing_chunked_request_keeps_its_state(config: dict[str, Any], length: int) -> None:
    with sh.build_harness(**config, chunked_prefill_size=CHUNK) as h:
        sched = h.scheduler
        long = _start_chunked(h, length)
        short = h.add_request(_prompt(1))
        state = _chunked_state(h, long)
        before = h.free_counts()

        with h.arm_miss("token_slots") as reported:
            assert h.run_round() is None

        assert reported == ["token_slots"]
        assert sched.chunked_req is long  # still the chunked request, not requeued
        assert sched.waiting_queue == [short]
        assert _chunked_state(h, long) == state  # row, Mamba slots, lock, inflight count kept
        assert _holds_nothing(short)
        assert h.free_counts() == before
        assert sh.num_prefill_unwinds(h) == 1

        # The next round schedules the same chunk again, from the same prefix.
        retry = h.run_round()
        assert retry is not None and retry.reqs[0] is long
        assert sh.extend_start(long) == CHUNK


@pytest.mark.parametrize("length", CHUNK_LENGTHS.values(), ids=CHUNK_LENGTHS.keys())
@pytest.mark.parametrize("config", CHUNK_CONFIGS.values(), ids=CHUNK_CONFIGS.keys())
def test_bug_unwound_chunk_is_cached_by_the_next_loop_iteration(config: dict[str, Any], length: int) -> None:
    """The loop caches the chunked request's previous chunk before each round when its
    extend_range ends past its prefix (scheduler.py:3587-3598 at 0.5.20). The unwind restores
    chunked_req but not the extend_range add_chunked_req set for the unwound chunk, so the next
    iteration caches a chunk that was never computed, with KV slots that were never allocated
    (missing rank) or were given back (other ranks)."""
    with sh.build_harness(**config, chunked_prefill_size=CHUNK) as h:
        long = _start_chunked(h, length)
        h.add_request(_prompt(1))
        state = _chunked_state(h, long)
        before = h.free_counts()
        with h.arm_miss("token_slots"):
            assert h.run_round() is None

        h.prepare_next_round()  # what get_next_batch_to_run does before the next round

        assert _chunked_state(h, long) == state  # prefix still the one computed chunk
        assert h.free_counts() == before
        retry = h.run_round()
        assert retry is not None and retry.reqs[0] is long
        assert sh.extend_start(long) == CHUNK


def test_new_chunked_request_goes_back_to_the_queue() -> None:
    """A request admitted this round and truncated into its first chunk is a new request: it is
    requeued, and chunked_req goes back to what it was (None)."""
    with sh.build_harness(**PING_PONG, chunked_prefill_size=CHUNK) as h:
        sched = h.scheduler
        short = h.add_request(_prompt(0))
        long = h.add_request(_prompt(1, 200))
        before = h.free_counts()

        with h.arm_miss("token_slots"):
            assert h.run_round() is None

        assert sched.chunked_req is None
        assert sched.waiting_queue == [short, long]
        assert _holds_nothing(short) and _holds_nothing(long)
        assert h.free_counts() == before
        assert h.tree_cache.protected_size() == 0
        assert _drain(h) == [short.rid, long.rid]
        assert h.idle_leak_report() == []


def test_bug_requeued_chunk_still_counts_as_in_flight() -> None:
    """`_get_new_batch_prefill_raw` counts the new chunk in `inflight_middle_chunks` (:3991-3992)
    before prepare_for_extend; the unwind restores the count only for the chunked request that
    was already running. The requeued request keeps 1, and when it is scheduled again its count
    is one too high: the batch result processor then treats its last chunk as a middle chunk
    (batch_result_processor.py:344, 417) and never commits its first output token."""
    with sh.build_harness(**PING_PONG, chunked_prefill_size=CHUNK) as h:
        h.add_request(_prompt(0))
        long = h.add_request(_prompt(1, 200))
        assert long.inflight_middle_chunks == 0
        with h.arm_miss("token_slots"):
            assert h.run_round() is None

        assert long.inflight_middle_chunks == 0


# --------------------------------------------------------------------------------------------
# Streaming session: its Mamba slot (and row) belong to the session, never to the unwind
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("site", ["token_slots", "mamba_slot"])
@pytest.mark.parametrize("config", [MAMBA, PING_PONG], ids=["mamba", "mamba_ping_pong"])
def test_session_held_mamba_slot_is_never_freed(config: dict[str, Any], site: sh.MissSite) -> None:
    with sh.build_harness(**config) as h:
        sched = h.scheduler
        first_turn = _prompt(0, 30)
        session = h.open_streaming_session(first_turn)
        slot = h.session_slot(session)
        session_mamba = int(slot.kv.mamba_pool_idx)
        session_row = slot.kv.req_pool_idx
        turn = h.add_request([*first_turn, 5, 6, 7], session=session)
        other = h.add_request(_prompt(1))
        before = h.free_counts()
        allocator = h.req_to_token_pool.mamba_allocator

        # mamba_slot: the session turn already holds its slot, so the one alloc(1) is `other`'s.
        with h.spy_releases(), h.arm_miss(site) as reported:
            assert h.run_round() is None

        assert reported == [site]
        assert sched.waiting_queue == [turn, other]
        assert turn.kv is slot.kv  # the turn runs on the session's record (restore_to_req)
        assert int(slot.kv.mamba_pool_idx) == session_mamba
        assert slot.kv.req_pool_idx == session_row
        assert session_mamba not in allocator.free_slots.tolist()
        freed = [name.split()[0] for name in h.device_log.ops("mamba_free")]
        assert str(session_mamba) not in ",".join(freed).split(",")
        assert _holds_nothing(other)
        assert h.free_counts() == before

        retry = h.run_round()
        assert retry is not None and retry.reqs == [turn]
        assert int(turn.kv.mamba_pool_idx) == session_mamba


# --------------------------------------------------------------------------------------------
# Anything but a miss is not unwound
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "error",
    [ValueError("pool failure that is not a miss"), RuntimeError("CUDA error: an illegal memory access")],
    ids=["ValueError", "RuntimeError"],
)
def test_other_exceptions_propagate_unchanged(error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    """Only the typed miss is unwound: any other exception from the allocation, a RuntimeError
    included, propagates as it was (the scheduler stops), and the miss's rollback does not run
    for it: the rows the batch took before the failure are still taken, for its diagnostics."""
    with sh.build_harness(**MAMBA) as h:
        for i in range(3):
            h.add_request(_prompt(i))
        rows_before = h.free_counts()["req_rows"]
        real_alloc_for_extend = sh.schedule_batch_module.alloc_for_extend
        allocator = h.token_to_kv_pool_allocator

        def alloc_for_extend(batch: Any) -> Any:
            # Raise from the token pool inside prepare_for_extend, where a miss would come from.
            with mock.patch.object(allocator, "alloc", side_effect=error):
                return real_alloc_for_extend(batch)

        caplog.set_level(logging.WARNING, logger=SCHEDULER_LOGGER)
        with (
            mock.patch.object(sh.schedule_batch_module, "alloc_for_extend", alloc_for_extend),
            pytest.raises(type(error)) as raised,
        ):
            h.run_round()

        assert raised.value is error
        assert sh.num_prefill_unwinds(h) == 0
        assert _unwind_records(caplog) == []
        assert h.free_counts()["req_rows"] < rows_before


# --------------------------------------------------------------------------------------------
# Two ranks over gloo, with the parallel groups as distinct objects
# --------------------------------------------------------------------------------------------
RANKS = 2
RANK_TIMEOUT_S = 180  # join limit; the collectives themselves time out after 30 s
MISSING_RANK = 1
Topology = Literal["tp", "cp", "dp_attention"]


class RankScenario(NamedTuple):
    config: dict[str, Any]
    topology: Topology  # which group spans both ranks (see _groups)
    site: sh.MissSite | None  # armed on MISSING_RANK only
    # What the round's batch starts with ("session_first": a streaming session's first turn).
    first: Literal["fresh", "session", "session_first", "chunked", "host"]
    # From before the first round, a co-tenant maps rank 0's KV memory away (kvcached computes
    # free space per rank) until rank 0 has only this many free tokens: it would admit less.
    rank0_free_tokens: int | None = None


ELASTIC: dict[str, Any] = {"elastic": True}
RANK_SCENARIOS = {
    "tp_mamba_ping_pong": RankScenario({**PING_PONG, **ELASTIC}, "tp", "token_slots", "fresh"),
    # page 4, a streaming-session turn on a 30-token prefix: its extend starts inside the
    # prefix's last page, which `give_back_extend` must not free on the rank that did not miss.
    "tp_paged_session": RankScenario({"page_size": 4, **ELASTIC}, "tp", "paged_extend", "session"),
    # A streaming session's first turn: its allocation hands the request's record and admission
    # lock to a new session slot, on the rank that did not miss.
    "tp_session_first_turn": RankScenario(ELASTIC, "tp", "token_slots", "session_first"),
    # A continuing chunked request with ping-pong tracking (its second chunk is unwound).
    "tp_chunked_ping_pong": RankScenario(
        {**PING_PONG, "chunked_prefill_size": CHUNK, **ELASTIC}, "tp", "token_slots", "chunked"
    ),
    # Context parallel: the attention-CP group spans the ranks, attention-TP is one rank each.
    "cp_mamba": RankScenario({**MAMBA, **ELASTIC}, "cp", "token_slots", "fresh"),
    # DP attention: each rank schedules its own batch; TP spans both ranks but must not agree.
    "dp_attention_mamba": RankScenario({**MAMBA, **ELASTIC}, "dp_attention", "token_slots", "fresh"),
    # No miss: rank 0's pool has less free space than rank 1's.
    "tp_skewed_free": RankScenario(ELASTIC, "tp", None, "fresh", rank0_free_tokens=40),
    # A host hit: the round starts a HiCache load on both ranks, rank 1 misses.
    "tp_hicache_host": RankScenario(
        {**MAMBA, **ELASTIC, "hicache": True, "auto_complete_events": False}, "tp", "token_slots", "host"
    ),
}
UNWIND_BOTH = [
    "tp_mamba_ping_pong",
    "tp_paged_session",
    "tp_session_first_turn",
    "tp_chunked_ping_pong",
    "cp_mamba",
]


def _req_state(req: Req) -> tuple[Any, ...]:
    """What a rank knows about a request, to compare ranks (pool indices may differ)."""
    kv = req.kv
    return (
        req.rid,
        kv.holds_kv,
        kv.holds_mamba,
        kv.kv_allocated_len,
        kv.kv_committed_len,
        req.cached_tokens,
        req.already_computed,
        req.extend_batch_idx,
        req.inflight_middle_chunks,
        kv.mamba_next_track_idx,
        kv.mamba_last_track_idx,
    )


def _release_order(entries: list[tuple[str, str]]) -> dict[str, Any]:
    """Where, in a rank's device log, it waited on a load and, once the load started, released a
    lock or a Mamba slot (admission's own releases come before the load starts)."""
    starts = [i for i, (op, name) in enumerate(entries) if op == "record" and name.startswith("load")]
    load_start = starts[0] if starts else len(entries)
    syncs = [i for i, (op, _) in enumerate(entries) if op == "synchronize"]
    releases = [
        i for i, (op, _) in enumerate(entries) if i > load_start and op in ("dec_lock_ref", "mamba_free")
    ]
    locks = [i for i in releases if entries[i][0] == "dec_lock_ref"]
    return {
        "synchronized": [entries[i][1] for i in syncs],
        "first_sync": syncs[0] if syncs else None,
        "first_release": releases[0] if releases else None,
        "first_lock_release": locks[0] if locks else None,
    }


def _rank_scenario(h: sh.Harness, rank: int, scenario: RankScenario) -> dict[str, Any]:
    sched = h.scheduler
    reqs: list[Req] = []
    if scenario.first == "session":
        first_turn = _prompt(7, 30)
        session = h.open_streaming_session(first_turn)
        reqs.append(h.add_request([*first_turn, 5, 6, 7, 8, 9], session=session))
    elif scenario.first == "session_first":
        session = sh.Session(capacity_of_str_len=1 << 16, session_id="first-turn", streaming=True)
        reqs.append(h.add_request(_prompt(7, 30), session=session))
    elif scenario.first == "chunked":
        reqs.append(_start_chunked(h, 100))  # both ranks run its first chunk
    elif scenario.first == "host":
        h.put_prefix_on_host(PREFIX)
        reqs.append(h.add_request([*PREFIX, 7, 8, 9]))
    reqs += [h.add_request(_prompt(i)) for i in range(4 - len(reqs))]
    before = h.free_counts()
    protected_before = h.tree_cache.protected_size()
    h.device_log.clear()
    with contextlib.ExitStack() as stack:
        reported = stack.enter_context(
            h.arm_miss(scenario.site)
            if rank == MISSING_RANK and scenario.site
            else contextlib.nullcontext([])
        )
        stack.enter_context(h.spy_releases())
        batch = h.run_round()
    consumer = [int(name) for op, name in h.device_log.entries if op == "consumer"]
    result: dict[str, Any] = {
        "batch": None if batch is None else [r.rid for r in batch.reqs],
        "reported": list(reported),
        "before": before,
        "after": h.free_counts(),
        "queue": [r.rid for r in sched.waiting_queue],
        "chunked": None if sched.chunked_req is None else sched.chunked_req.rid,
        "unwinds": sh.num_prefill_unwinds(h),
        "cap": sched.prefill_unwind_admit_cap,
        "protected": (protected_before, h.tree_cache.protected_size()),
        "state_after_unwind": [_req_state(r) for r in reqs],
        "order": _release_order(h.device_log.entries),
        "finish_event": (
            h.layer_done_counter.events[consumer[0]].finish_event.name
            if consumer and consumer[0] >= 0
            else None
        ),
    }
    result["session_slots"] = _session_slots(h)
    h.prepare_next_round()
    retry = h.run_round()
    result["retry"] = None if retry is None else [r.rid for r in retry.reqs]
    result["session_slots_after_retry"] = _session_slots(h)
    if scenario.rank0_free_tokens is not None:
        for req in {*(batch.reqs if batch else []), *(retry.reqs if retry else [])}:
            h.finish_request(req)
        h.prepare_next_round()
        result["idle_leaks_agreed"] = h.idle_leak_report()
        sched._release_agreed_free_space()  # what Scheduler.on_idle does once fully idle
        result["idle_leaks_released"] = h.idle_leak_report()
    result["state_after_retry"] = [_req_state(r) for r in reqs]
    return result


@contextlib.contextmanager
def _cotenant(h: sh.Harness, leave_free: int) -> Iterator[None]:
    """Another engine maps this rank's KV memory away until `leave_free` tokens are free (what a
    kvcached co-tenant does to one GPU); it gives them back on exit."""
    allocator = h.token_to_kv_pool_allocator
    taken = allocator.alloc(allocator.available_size() - leave_free)
    assert taken is not None
    try:
        yield
    finally:
        allocator.free(taken)


def _session_slots(h: sh.Harness) -> dict[str, bool] | None:
    """Each streaming session slot, by id: whether it holds a tree lock (None: no such cache)."""
    session_cache = getattr(h.tree_cache, "session", None)
    if session_cache is None:
        return None
    return {sid: _slot_holds_lock(slot) for sid, slot in session_cache.slots.items()}


def _slot_holds_lock(slot: Any) -> bool:
    """Up to 0.5.21 a slot keeps its first turn's tree node and lock receipt (`last_node`,
    `lock_receipt`); from 0.5.22 on the lock itself (`lock`)."""
    if hasattr(slot, "lock"):
        return slot.lock is not None
    return slot.last_node is not None


def _groups(topology: Topology, rank: int, world: Any, pair: Any, singles: list[Any]) -> dict[str, Any]:
    """The harness's groups for one rank: `pair` spans both ranks, `singles[rank]` is this rank
    alone, and the TP group is `world`, an object distinct from `pair`."""
    alone = singles[rank]
    if topology == "tp":
        return {"tp_cpu_group": world, "attn_tp_cpu_group": pair, "attn_cp_cpu_group": alone}
    if topology == "cp":
        return {"tp_cpu_group": world, "attn_tp_cpu_group": alone, "attn_cp_cpu_group": pair}
    return {
        "tp_cpu_group": world,
        "attn_tp_cpu_group": alone,
        "attn_cp_cpu_group": alone,
        "enable_dp_attention": True,
    }


def _rank_body(names: list[str]) -> Any:
    """One rank: every group built by both ranks in the same order, then the named scenarios."""

    def body(rank: int) -> dict[str, Any]:
        world = dist.new_group(list(range(RANKS)), backend="gloo")
        pair = dist.new_group(list(range(RANKS)), backend="gloo")
        singles = [dist.new_group([r], backend="gloo") for r in range(RANKS)]
        assert world is not pair
        out: dict[str, Any] = {}
        for name in names:
            if name in MULTI_ROUND_SCENARIOS:
                groups = _groups("tp", rank, world, pair, singles)
                chunk = {"chunked_prefill_size": CHUNK} if name in CHUNKED_SCENARIOS else {}
                with sh.build_harness(**ELASTIC, **chunk, tp_size=RANKS, **groups) as h:
                    out[name] = MULTI_ROUND_SCENARIOS[name](h, rank)
            else:
                scenario = RANK_SCENARIOS[name]
                groups = _groups(scenario.topology, rank, world, pair, singles)
                with sh.build_harness(**scenario.config, tp_size=RANKS, **groups) as h:
                    skewed = rank == 0 and scenario.rank0_free_tokens is not None
                    with (
                        _cotenant(h, scenario.rank0_free_tokens or 0) if skewed else contextlib.nullcontext()
                    ):
                        out[name] = _rank_scenario(h, rank, scenario)
            dist.barrier(group=world)  # a hung scenario shows up as a timeout here
        return out

    return body


class TwoRanks(NamedTuple):
    results: dict[int, dict[str, Any]]  # rank -> scenario name -> what _rank_scenario saw
    errors: list[str]  # a rank's traceback, or a hang

    def scenario(self, name: str) -> dict[int, dict[str, Any]]:
        assert not self.errors, "\n".join(self.errors)
        return {rank: result[name] for rank, result in self.results.items()}


def run_two_ranks(names: list[str]) -> TwoRanks:
    """Run the named scenarios on two forked gloo ranks."""
    with sh.build_harness():  # import sglang's model registry once, before forking
        pass
    results, errors = forked_ranks.run_forked_ranks(
        _rank_body(names), ranks=RANKS, timeout_s=RANK_TIMEOUT_S, collective_timeout_s=30
    )
    return TwoRanks(results, errors)


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    """The scenarios of this module, run once on both ranks (the HiCache one belongs to the wait
    entry, test_unwind_waits_for_load.py)."""
    return run_two_ranks(
        [name for name in RANK_SCENARIOS if name != "tp_hicache_host"] + list(MULTI_ROUND_SCENARIOS)
    )


@pytest.mark.parametrize("name", UNWIND_BOTH)
def test_two_ranks_one_miss_both_unwind(two_ranks: TwoRanks, name: str) -> None:
    ranks = two_ranks.scenario(name)
    site = RANK_SCENARIOS[name].site
    for rank, r in ranks.items():
        assert r["reported"] == ([site] if rank == MISSING_RANK else []), rank
        assert r["batch"] is None, rank  # the rank that did not miss unwinds too
        assert r["unwinds"] == 1, rank
        assert r["after"] == r["before"], rank  # and gives back what it allocated
        protected_before, protected_after = r["protected"]
        assert protected_after == protected_before, rank  # admission locks released
    assert ranks[0]["queue"] == ranks[1]["queue"] != []
    assert ranks[0]["chunked"] == ranks[1]["chunked"]
    assert ranks[0]["cap"] == ranks[1]["cap"] is not None
    # The next round (nothing armed) schedules the same requests on both ranks: the chunked
    # request, if any, then at most half of the unwound batch.
    chunked = [] if ranks[0]["chunked"] is None else [ranks[0]["chunked"]]
    assert ranks[0]["retry"] is not None and ranks[0]["retry"] == ranks[1]["retry"]
    assert ranks[0]["retry"][: len(chunked)] == chunked


@pytest.mark.parametrize("name", UNWIND_BOTH)
def test_two_ranks_requests_stay_in_step(two_ranks: TwoRanks, name: str) -> None:
    """The rank that did not miss must not move its requests' prefill progress on (cached_tokens,
    already_computed, extend_batch_idx, ping-pong indices) before the ranks agree: after the
    unwind and after the retry both ranks know the same about every request."""
    ranks = two_ranks.scenario(name)
    assert ranks[0]["state_after_unwind"] == ranks[1]["state_after_unwind"]
    assert ranks[0]["state_after_retry"] == ranks[1]["state_after_retry"]
    assert all(state[5] >= 0 for r in ranks.values() for state in r["state_after_retry"])


def test_a_first_turn_gives_its_session_slot_back(two_ranks: TwoRanks) -> None:
    """On the rank that allocated, a streaming session's first turn moved its admission lock into
    a new session slot. The unwind takes both back: no slot is left without its row (an abort
    while queued would then trip the session's one-slot assertion), the lock is released like any
    admission lock, and the retry opens the slot once, with one lock, on both ranks."""
    ranks = two_ranks.scenario("tp_session_first_turn")
    if ranks[0]["session_slots"] is None:
        pytest.skip("this line has no streaming-session slots")
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    # From 0.5.22 the first turn's allocation opens the slot (maybe_hand_to_session); up to
    # 0.5.21 the slot is opened only when the turn is cached, so the allocation hands nothing over.
    opened_by_allocation = hasattr(UnifiedRadixCache, "maybe_hand_to_session")
    for r in ranks.values():
        assert r["session_slots"] == {}
        assert r["session_slots_after_retry"] == ({"first-turn": True} if opened_by_allocation else {})


def test_dp_attention_ranks_do_not_agree(two_ranks: TwoRanks) -> None:
    """Under DP attention each rank schedules its own batch (attention-TP is one rank each):
    rank 1's miss unwinds rank 1 only, and the TP group, which spans both, is not used."""
    ranks = two_ranks.scenario("dp_attention_mamba")
    assert ranks[MISSING_RANK]["batch"] is None and ranks[MISSING_RANK]["unwinds"] == 1
    assert ranks[0]["batch"] is not None and len(ranks[0]["batch"]) == 4
    assert ranks[0]["unwinds"] == 0 and ranks[0]["cap"] is None


def test_two_ranks_with_different_free_space_admit_alike(two_ranks: TwoRanks) -> None:
    """Rank 0 has less free space than rank 1 (a co-tenant took most of it). The ranks agree on
    their free space before admission, so both admit the same batch, what fits rank 0, and run
    it: nothing is unwound, nothing is charged, and the next round runs the same on both."""
    ranks = two_ranks.scenario("tp_skewed_free")
    for r in ranks.values():
        assert r["reported"] == [] and r["unwinds"] == 0 and r["cap"] is None
    assert ranks[0]["batch"] is not None and ranks[0]["batch"] == ranks[1]["batch"]
    assert len(ranks[0]["batch"]) < 4  # what fits rank 0's 40 free tokens, not rank 1's
    assert ranks[0]["state_after_unwind"] == ranks[1]["state_after_unwind"]
    assert ranks[0]["queue"] == ranks[1]["queue"]
    assert ranks[0]["retry"] == ranks[1]["retry"]
    # Idle, rank 1 still reads rank 0's free space, which sglang's idle leak check would report
    # as a leak: idle, the scheduler reads each pool as it is again. (Rank 0's co-tenant still
    # holds its memory here, so its own check is not asked.)
    assert ranks[1]["idle_leaks_agreed"] != [] and ranks[1]["idle_leaks_released"] == []


EVICTION_PREFIXES = [list(range(2000 + 40 * i, 2000 + 40 * i + 32)) for i in range(6)]


def _skewed_eviction(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Both ranks cache the same six 32-token prefixes; a co-tenant leaves rank 0 only 16 free
    tokens. New requests need eviction, then one reuses the oldest prefix (the first LRU victim).
    Each round's batch (rid, prefix length, extend end) and the tree's evictable size after it."""
    for prefix in EVICTION_PREFIXES:
        h.cache_prefix(prefix)
    rounds: list[Any] = []
    with _cotenant(h, 16) if rank == 0 else contextlib.nullcontext():
        for i in range(3):
            h.add_request(_prompt(i, 40))
        h.add_request([*EVICTION_PREFIXES[0], 7, 8, 9])
        for _ in range(12):
            batch = h.run_round()
            rounds.append(
                None if batch is None else [(r.rid, sh.prefix_len(r), sh.extend_end(r)) for r in batch.reqs]
            )
            for req in [] if batch is None else batch.reqs:
                h.finish_request(req)
            h.prepare_next_round()
            rounds.append(h.tree_cache.evictable_size())
            if not h.scheduler.waiting_queue:
                break
    return {
        "rounds": rounds,
        "queue": [r.rid for r in h.scheduler.waiting_queue],
        "unwinds": sh.num_prefill_unwinds(h),
    }


def _cotenant_race(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Right after the ranks agreed on their free space, before admission, a co-tenant takes
    nearly all of rank 0's (the race no agreement can see coming). That round rank 0 admits
    nothing while rank 1 admits: both put it back, both count it, no request is charged. The
    co-tenant then leaves; the next round agrees again, and both ranks do the same."""
    sched = h.scheduler
    reqs = [h.add_request(_prompt(i)) for i in range(3)]
    with contextlib.ExitStack() as stack:
        agree = getattr(sched, "_agree_on_free_space", None)
        if rank == 0 and agree is None:  # a series that agrees on nothing before admission
            stack.enter_context(_cotenant(h, 2))
        elif rank == 0:

            def agree_then_lose_memory(agreement: Any) -> None:
                agree(agreement)
                stack.enter_context(_cotenant(h, 2))

            stack.enter_context(mock.patch.object(sched, "_agree_on_free_space", agree_then_lose_memory))
        raced = h.run_round()
        after_race = {
            "batch": None if raced is None else [r.rid for r in raced.reqs],
            "unwinds": sh.num_prefill_unwinds(h),
            "divergences": getattr(sched, "num_prefill_divergences", 0),
            "charged": [r.consecutive_prefill_unwinds for r in reqs],
            "queue": [r.rid for r in sched.waiting_queue],
        }
    h.prepare_next_round()
    agreed = h.run_round()
    return {**after_race, "agreed": None if agreed is None else [r.rid for r in agreed.reqs]}


def _trees_differ(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The ranks' trees differ (what per-rank eviction did before the ranks agreed on their free
    space): rank 0 has a 32-token prefix cached, rank 1 does not. With 64-token chunks both ranks
    schedule the request's first chunk with the same extend length, but rank 0 would compute
    tokens 32-96 and rank 1 tokens 0-64 of one batch. The fingerprint covers the prefix length, so
    the ranks put it back; the third such round in a row stops the scheduler, naming it."""
    prefix = list(range(3000, 3032))
    if rank == 0:
        h.cache_prefix(prefix)
    req = h.add_request([*prefix, *range(4000, 4100)])
    outcomes: list[Any] = []
    for _ in range(3):
        try:
            batch = h.run_round()
        except Exception as error:  # the scheduler stopping
            outcomes.append(type(error).__name__)
            break
        outcomes.append(
            None if batch is None else [(r.rid, sh.prefix_len(r), sh.extend_end(r)) for r in batch.reqs]
        )
        h.prepare_next_round()
    return {
        "outcomes": outcomes,
        "charged": req.consecutive_prefill_unwinds,
    }


def _idle_round_keeps_the_cap(h: sh.Harness, rank: int) -> dict[str, Any]:
    """After an unwind (rank 1 missed) the next round admits nothing on either rank (the running
    batch is full): the ranks' vote is IDLE, which must not lift the back-off cap."""
    sched = h.scheduler
    running = h.add_request(_prompt(9))
    first = h.run_round()
    assert first is not None
    sched.running_batch = first
    for i in range(4):
        h.add_request(_prompt(i))
    with h.arm_miss("token_slots") if rank == MISSING_RANK else contextlib.nullcontext([]):
        assert h.run_round() is None
    cap_after_unwind = sched.prefill_unwind_admit_cap
    sched.running_batch.batch_is_full = True  # nothing can be admitted this round, on any rank
    idle = h.run_round()
    result = {
        "cap_after_unwind": cap_after_unwind,
        "idle": idle,
        "cap_after_idle": sched.prefill_unwind_admit_cap,
    }
    h.finish_request(running)
    return result


MULTI_ROUND_SCENARIOS = {
    "tp_skewed_eviction": _skewed_eviction,
    "tp_cotenant_race": _cotenant_race,
    "tp_trees_differ": _trees_differ,
    "tp_idle_round": _idle_round_keeps_the_cap,
}
CHUNKED_SCENARIOS = {"tp_trees_differ"}


def test_ranks_with_different_free_space_evict_alike(two_ranks: TwoRanks) -> None:
    """With rank 0 short of free space, eviction follows the agreed free space on both ranks, so
    the trees stay mirrored: every round both ranks schedule the same requests with the same
    prefix lengths and extend ranges (a request reusing the first prefix evicted included), and
    their evictable sizes stay equal. Without it rank 0 evicts more, and a prefix cached on one
    rank only either stalls the request or runs different token ranges on the two ranks."""
    ranks = two_ranks.scenario("tp_skewed_eviction")
    assert ranks[0]["rounds"] == ranks[1]["rounds"]
    assert ranks[0]["queue"] == ranks[1]["queue"] == []
    assert any(batch for batch in ranks[0]["rounds"][::2])


def test_ranks_whose_trees_differ_never_run_the_batch(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_trees_differ")
    for r in ranks.values():
        assert r["outcomes"] == [None, None, "PrefillRankDivergence"]
        assert r["charged"] == 0


def test_a_round_where_no_rank_admits_keeps_the_cap(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_idle_round")
    for r in ranks.values():
        assert r["cap_after_unwind"] is not None
        assert r["idle"] is None and r["cap_after_idle"] == r["cap_after_unwind"]


def test_a_cotenant_race_is_put_back_and_counted_on_every_rank(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_cotenant_race")
    for r in ranks.values():
        assert r["batch"] is None
        assert r["unwinds"] == 1 and r["divergences"] == 1  # rank 0 admitted nothing, counts too
        assert r["charged"] == [0, 0, 0]
    assert ranks[0]["queue"] == ranks[1]["queue"]
    assert ranks[0]["agreed"] == ranks[1]["agreed"]


# --------------------------------------------------------------------------------------------
# Seeded randomized soak
# --------------------------------------------------------------------------------------------
class SoakConfig(NamedTuple):
    config: dict[str, Any]
    sites: tuple[sh.MissSite, ...]
    rounds: int


SOAK_CONFIGS = {
    "hicache_mamba_ping_pong": SoakConfig(
        {"hicache": True, **PING_PONG, "kv_tokens": 1024, "req_rows": 8, "mamba_slots": 48},
        ("req_rows", "token_slots", "mamba_slot", "ping_pong"),
        1200,
    ),
    "hicache_page4": SoakConfig(
        {"hicache": True, "page_size": 4, "kv_tokens": 1024, "req_rows": 8},
        ("req_rows", "paged_extend"),
        1200,
    ),
    # Three rows: admission often fills them and marks the running batch full.
    "mamba_3_rows": SoakConfig(
        {**MAMBA, "kv_tokens": 1024, "req_rows": 3, "mamba_slots": 48},
        ("req_rows", "token_slots", "mamba_slot"),
        800,
    ),
}
SOAK_PREFIXES = [list(range(100 + 40 * i, 132 + 40 * i)) for i in range(4)]  # 32 tokens each


@dataclasses.dataclass
class SoakLedger:
    """What happened to every request: queued, finished once, never lost or duplicated."""

    added: list[str] = dataclasses.field(default_factory=list)
    finished: dict[str, int] = dataclasses.field(default_factory=dict)
    unwinds: int = 0
    unwinds_with_chunk: int = 0  # a chunked request (continuing or new) in the unwound batch
    unwinds_with_load: int = 0  # the unwound round started an H2D load
    misses: int = 0
    rounds_with_load: int = 0

    def finish(self, h: sh.Harness, req: Req) -> None:
        assert req.rid not in self.finished, f"{req.rid} scheduled to completion twice"
        h.finish_request(req)
        self.finished[req.rid] = 1


def _soak_request(rng: random.Random, n: int) -> list[int]:
    """Fresh tokens, a 32-token cached/host prefix plus a tail, or a long (chunked) prompt."""
    kind = rng.random()
    base = 10_000 + 400 * n
    if kind < 0.35:
        return [*rng.choice(SOAK_PREFIXES), *range(base, base + rng.randint(1, 24))]
    if kind < 0.5:
        return list(range(base, base + rng.randint(70, 180)))
    return list(range(base, base + rng.randint(4, 40)))


@contextlib.contextmanager
def _maybe_miss(h: sh.Harness, rng: random.Random, cfg: SoakConfig) -> Iterator[list[str]]:
    if rng.random() < 0.3:
        with h.arm_miss(rng.choice(cfg.sites), after=rng.randint(0, 1)) as reported:
            yield reported
    else:
        yield []


def _h2d_count(h: sh.Harness) -> int:
    engine = h.transfer_engine
    return 0 if engine is None else sum(1 for kind, _ in engine.submissions if kind == "h2d")


def _soak_round(h: sh.Harness, rng: random.Random, cfg: SoakConfig, ledger: SoakLedger) -> None:
    sched = h.scheduler
    h.prepare_next_round()
    # Now and then a burst larger than the rows, so admission marks the batch full.
    arrivals = 10 if rng.random() < 0.05 else rng.choice([0, 0, 1, 1, 2, 3])
    for _ in range(arrivals):
        ledger.added.append(h.add_request(_soak_request(rng, len(ledger.added))).rid)
    if h.cfg.hicache and rng.random() < 0.08:
        # Push what is cached on device back to host (write-through keeps a copy), so later
        # requests for the shared prefixes are loaded back: rounds with an H2D load.
        total = h.token_to_kv_pool_allocator.size
        h.tree_cache.evict(EvictParams(num_tokens=total, mamba_num=total if h.cfg.mamba else 0))
    queued_before = [r.rid for r in sched.waiting_queue]
    chunked_before = sched.chunked_req
    loads_before = _h2d_count(h)
    with _maybe_miss(h, rng, cfg) as reported:
        batch = h.run_round()
    ledger.misses += len(reported)
    if batch is None:
        if reported:
            ledger.unwinds += 1
            assert sh.num_prefill_unwinds(h) == ledger.unwinds
            # Same requests queued, same order (the unwound ones went back to the head).
            assert sorted(r.rid for r in sched.waiting_queue) == sorted(queued_before)
            assert sched.chunked_req is chunked_before
            queued_long = any(len(r.origin_input_ids) > CHUNK for r in sched.waiting_queue[:8])
            ledger.unwinds_with_chunk += chunked_before is not None or queued_long
            ledger.unwinds_with_load += _h2d_count(h) > loads_before
        return
    assert not reported, "a reported miss must unwind the round"
    if batch.hicache_consumer_index >= 0:
        ledger.rounds_with_load += 1
    for req in batch.reqs:
        if req is not sched.chunked_req:
            ledger.finish(h, req)


def _soak_idle_check(h: sh.Harness, ledger: SoakLedger) -> None:
    _drain_ledger(h, ledger)
    h.prepare_next_round()  # loads landed and acknowledged: nothing locked by an ongoing op
    assert h.tree_cache.protected_size() == 0, "a lock leaked"
    assert h.idle_leak_report() == [], "a slot leaked"
    h.tree_cache.sanity_check()


def _drain_ledger(h: sh.Harness, ledger: SoakLedger) -> None:
    sched = h.scheduler
    for _ in range(200):
        if not sched.waiting_queue and sched.chunked_req is None:
            return
        h.prepare_next_round()
        batch = h.run_round()
        assert batch is not None
        for req in batch.reqs:
            if req is not sched.chunked_req:
                ledger.finish(h, req)
    raise AssertionError("soak queue not drained")


@pytest.mark.parametrize("cfg", SOAK_CONFIGS.values(), ids=SOAK_CONFIGS.keys())
def test_randomized_soak(cfg: SoakConfig) -> None:
    rng = random.Random(20260529)
    ledger = SoakLedger()
    with sh.build_harness(**cfg.config, chunked_prefill_size=CHUNK) as h:
        for i, prefix in enumerate(SOAK_PREFIXES):
            if h.cfg.hicache and i < 2:
                h.put_prefix_on_host(prefix)
            else:
                h.cache_prefix(prefix)
        logging.getLogger(SCHEDULER_LOGGER).disabled = True  # one warning per unwind: thousands
        try:
            for round_no in range(cfg.rounds):
                _soak_round(h, rng, cfg, ledger)
                if round_no % 100 == 99:
                    _soak_idle_check(h, ledger)
            _soak_idle_check(h, ledger)
        finally:
            logging.getLogger(SCHEDULER_LOGGER).disabled = False
    # Every request ended scheduled exactly once; none is lost, none duplicated.
    assert sorted(ledger.finished) == sorted(ledger.added)
    # The soak did exercise what it is for.
    assert ledger.unwinds > 50 and ledger.unwinds_with_chunk > 20, ledger
    if h.cfg.hicache:
        assert ledger.rounds_with_load > 10 and ledger.unwinds_with_load > 5, ledger
