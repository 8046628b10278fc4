"""The prefill allocation-miss unwind on one rank (series entry "Scheduler: unwind a prefill
batch whose allocation misses instead of dying", sgl-project/sglang#34676).

When a prefill batch's allocation misses although admission said yes (an elastic kvcached pool,
an undersized Mamba pool), upstream raises out of `Scheduler._get_new_batch_prefill_raw` and the
scheduler process dies. With the patch the round returns None and the batch goes back to the head
of the waiting queue with nothing held. Everything below the scheduler is the real upstream code
(see scheduler_harness.py); a miss is a real pool whose alloc reports None (`arm_miss`). The
ranks' agreement is tested in test_rank_agreement.py, the bounded retries in
test_unwind_retries.py.

Expected: these tests FAIL without the unwind and PASS with it, except
`test_other_exceptions_propagate_unchanged`, which pins what the unwind must leave alone. Tests
named `*_bug_*` pin defects found in earlier versions of the patch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import random
from collections.abc import Iterator
from typing import Any, Literal, NamedTuple
from unittest import mock

import pytest
import scheduler_harness as sh
from sglang.srt.managers import schedule_batch as schedule_batch_module
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


def _charged(req: Req) -> int:
    """The missed rounds charged to a request (none before the series bounds the retries)."""
    return int(getattr(req, "consecutive_prefill_unwinds", 0))


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
        real_alloc_for_extend = schedule_batch_module.alloc_for_extend
        allocator = h.token_to_kv_pool_allocator

        def alloc_for_extend(batch: Any) -> Any:
            # Raise from the token pool inside prepare_for_extend, where a miss would come from.
            with mock.patch.object(allocator, "alloc", side_effect=error):
                return real_alloc_for_extend(batch)

        caplog.set_level(logging.WARNING, logger=SCHEDULER_LOGGER)
        with (
            mock.patch.object(schedule_batch_module, "alloc_for_extend", alloc_for_extend),
            pytest.raises(type(error)) as raised,
        ):
            h.run_round()

        assert raised.value is error
        assert sh.num_prefill_unwinds(h) == 0
        assert _unwind_records(caplog) == []
        assert h.free_counts()["req_rows"] < rows_before


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
