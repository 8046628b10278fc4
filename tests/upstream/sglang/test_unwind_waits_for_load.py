"""An unwound prefill waits for its own HiCache load before releasing anything (series entry
"Scheduler: wait for the batch's HiCache load before an unwind releases anything").

`ready_to_load_host_cache` starts the batch's host-to-device load (scheduler.py:4012-4016) before
`prepare_for_extend` can miss (:4018). If the unwind then released the admission locks or the
Mamba slot the load writes into, a later request could match the loading nodes before their data
arrives, and a freed slot could be reused while the copy still writes into it. The patch waits
host-side on exactly that load's `finish_event` (the last layer's record, LayerDoneCounter) first.

The device is the harness's fake (scheduler_harness.py): events and streams append to one ordered
log, and with `auto_complete_events=False` a load stays pending until its event is synchronized.
`spy_releases` puts every lock release (`tree_cache.dec_lock_ref`) and every Mamba free
(`mamba_allocator.free`) into the same log, each with the load events still pending at that moment.

Expected: these tests FAIL with the unwind alone and PASS with the wait too (pristine 0.5.20 fails:
it has no unwind).
"""

from __future__ import annotations

from typing import Any, NamedTuple
from unittest import mock

import pytest
import scheduler_harness as sh
import test_rank_agreement
from sglang.srt.managers.schedule_batch import ScheduleBatch

PREFIX = list(range(100, 132))  # 32 tokens: whole pages for page_size 1 and 4
PING_PONG: dict[str, Any] = {"mamba": True, "ping_pong": True}
CONFIGS: dict[str, dict[str, Any]] = {
    "page1": {},
    "page4": {"page_size": 4},
    "mamba": {"mamba": True},
    "mamba_ping_pong": PING_PONG,
    "mamba_ping_pong_page4": {**PING_PONG, "page_size": 4},
}
# The site that misses after the load started: a token miss takes the rows (and Mamba slots) first.
TOKEN_SITE: dict[str, sh.MissSite] = {
    "page1": "token_slots",
    "page4": "paged_extend",
    "mamba": "token_slots",
    "mamba_ping_pong": "token_slots",
    "mamba_ping_pong_page4": "paged_extend",
}
RELEASES = ("dec_lock_ref", "mamba_free")
# The device-side calls a host-side wait on one load must not be replaced by.
DEVICE_WIDE_WAITS = ("device_synchronize", "stream_synchronize")


def _prompt(i: int, length: int = 20) -> list[int]:
    return list(range(1000 + 300 * i, 1000 + 300 * i + length))


def _host_prefix(i: int) -> list[int]:
    return list(range(5000 + 100 * i, 5032 + 100 * i))


class Unwound(NamedTuple):
    """What one unwound round left in the log."""

    entries: list[tuple[str, str]]
    consumer: int  # the batch's hicache_consumer_index
    finish_event: str  # name of that slot's finish_event, e.g. "load2.layer1" ("": no load)
    load_start: int  # log position of the load's start record (-1: no load)


def _advance_ring(h: sh.Harness, loads: int) -> None:
    """Run `loads` earlier rounds that each start (and complete) a host load, so the next load
    takes LayerDoneCounter slot `loads` (the ring has 3 slots, cache_controller.py:72-86)."""
    for i in range(loads):
        h.put_prefix_on_host(_host_prefix(i))
        req = h.add_request([*_host_prefix(i), 1, 2, 3])
        batch = h.run_round()
        assert batch is not None and batch.hicache_consumer_index == i
        h.prepare_next_round()  # the device finishes the copy; loading_check acknowledges it
        h.finish_request(req)


def _unwind_with_load(h: sh.Harness, site: sh.MissSite, after: int = 0, ring_slot: int = 0) -> Unwound:
    """A round whose batch is a host hit (its load starts) plus a fresh request, then a miss."""
    _advance_ring(h, ring_slot)
    h.put_prefix_on_host(PREFIX)
    h.add_request([*PREFIX, 7, 8, 9])
    h.add_request(_prompt(0))
    h.device_log.clear()
    with h.spy_releases(), h.arm_miss(site, after=after) as reported:
        assert h.run_round() is None
    assert reported == [site]
    entries = list(h.device_log.entries)
    [consumer] = [int(name) for op, name in entries if op == "consumer"]
    if consumer < 0:
        return Unwound(entries, consumer, "", -1)
    loading = h.layer_done_counter.events[consumer]
    return Unwound(
        entries, consumer, loading.finish_event.name, entries.index(("record", loading.start_event.name))
    )


def _waits(entries: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(op, name) for op, name in entries if op == "synchronize" or op in DEVICE_WIDE_WAITS]


def _releases_after(entries: list[tuple[str, str]], start: int) -> list[tuple[int, str, str]]:
    """The lock releases and Mamba frees logged after position `start`, with their positions."""
    return [(i, op, detail) for i, (op, detail) in enumerate(entries) if i > start and op in RELEASES]


def _wait_position(unwound: Unwound) -> int:
    """Where the unwind waited on its load's finish_event."""
    wait = ("synchronize", unwound.finish_event)
    assert wait in unwound.entries, f"the unwind never waited on load {unwound.consumer}: {unwound.entries}"
    return unwound.entries.index(wait)


def _freed_slots(detail: str) -> set[int]:
    return {int(s) for s in detail.split()[0].split(",")}


# --------------------------------------------------------------------------------------------
# No host load, or not ours to wait for: no wait
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", CONFIGS.keys())
def test_no_host_load_no_wait(name: str) -> None:
    """HiCache on, but nothing on host: the batch starts no load (consumer -1)."""
    with sh.build_harness(hicache=True, auto_complete_events=False, **CONFIGS[name]) as h:
        h.add_request(_prompt(0))
        h.add_request(_prompt(1))
        with h.spy_releases(), h.arm_miss(TOKEN_SITE[name]):
            assert h.run_round() is None
        log = h.device_log
        assert log.ops("consumer") == ["-1"]
        assert _waits(log.entries) == []
        assert log.ops("dec_lock_ref")  # the unwind did release the admission locks


def test_linker_load_is_not_unwound() -> None:
    """With an external cache linker the batch's load runs on the linker's own thread, which no
    event here orders: the unwind must not release the locks and Mamba slots it may still be
    writing. The miss stops the scheduler, as on 0.5.20, with a message that says why."""
    with sh.build_harness(hicache=True, auto_complete_events=False) as h:
        h.put_prefix_on_host(PREFIX)
        linker = sh.FakeCacheLinker(start_index=0)
        h.tree_cache.linker = linker
        h.add_request([*PREFIX, 7, 8, 9])
        h.add_request(_prompt(0))
        h.device_log.clear()
        try:
            with h.spy_releases(), h.arm_miss("token_slots"), pytest.raises(RuntimeError) as raised:
                h.run_round()
            assert "external cache linker" in str(raised.value)
            assert linker.started == 1
            assert h.device_log.ops("consumer") == ["0"]
            entries = h.device_log.entries
            load_started = entries.index(("consumer", "0"))
            assert [op for op, _ in entries[load_started:] if op in RELEASES] == []  # nothing released
            assert _waits(h.device_log.entries) == []
            assert sh.num_prefill_unwinds(h) == 0
        finally:
            h.tree_cache.linker = None  # the fake holds nothing to shut down


def test_linker_without_load_unwinds() -> None:
    """A linker that started no load for the batch (consumer -1): nothing to race, the unwind
    goes ahead."""
    with sh.build_harness(hicache=True, auto_complete_events=False) as h:
        linker = sh.FakeCacheLinker(start_index=-1)
        h.tree_cache.linker = linker
        h.add_request(_prompt(0))
        try:
            with h.arm_miss("token_slots"):
                assert h.run_round() is None
            assert sh.num_prefill_unwinds(h) == 1
            assert _waits(h.device_log.entries) == []
        finally:
            h.tree_cache.linker = None


def test_hicache_off_no_wait() -> None:
    with sh.build_harness(auto_complete_events=False, **PING_PONG) as h:
        h.cache_prefix(PREFIX)
        h.add_request([*PREFIX, 7, 8, 9])
        h.add_request(_prompt(0))
        with h.spy_releases(), h.arm_miss("token_slots"):
            assert h.run_round() is None
        assert h.scheduler.waiting_queue  # it did unwind
        assert _waits(h.device_log.entries) == []
        assert h.device_log.ops("consumer") == []  # HiCache off: no load is ever started


# --------------------------------------------------------------------------------------------
# A host load in flight: exactly one host-side wait, on that load's own finish_event
# --------------------------------------------------------------------------------------------
RING_SLOTS = {"slot0": 0, "slot2": 2}


@pytest.mark.parametrize("name", CONFIGS.keys())
def test_a_round_that_runs_does_not_wait_for_its_load(name: str) -> None:
    """The wait is the unwind's only: a round that runs leaves its load in flight (the forward
    waits for it on the device, layer by layer), with no host-side wait."""
    with sh.build_harness(hicache=True, auto_complete_events=False, **CONFIGS[name]) as h:
        h.put_prefix_on_host(PREFIX)
        h.add_request([*PREFIX, 7, 8, 9])
        h.device_log.clear()
        batch = h.run_round()
        assert batch is not None and batch.hicache_consumer_index >= 0
        assert _waits(h.device_log.entries) == []
        assert not h.layer_done_counter.events[batch.hicache_consumer_index].finish_event.done


@pytest.mark.parametrize("ring_slot", RING_SLOTS.values(), ids=RING_SLOTS.keys())
@pytest.mark.parametrize("name", CONFIGS.keys())
def test_waits_for_its_own_load(name: str, ring_slot: int) -> None:
    with sh.build_harness(hicache=True, auto_complete_events=False, **CONFIGS[name]) as h:
        unwound = _unwind_with_load(h, TOKEN_SITE[name], ring_slot=ring_slot)

        assert unwound.consumer == ring_slot
        # One wait, host-side, on this slot's finish_event (the last layer's record, recorded
        # after every copy of the load), and no device- or stream-wide synchronize.
        assert _waits(unwound.entries) == [("synchronize", unwound.finish_event)]
        assert unwound.finish_event == f"load{ring_slot}.layer{sh.NUM_LAYERS - 1}"
        finish = h.layer_done_counter.events[ring_slot].finish_event
        assert finish.done  # it was pending until the wait (auto_complete_events=False)


@pytest.mark.parametrize("ring_slot", RING_SLOTS.values(), ids=RING_SLOTS.keys())
@pytest.mark.parametrize("name", CONFIGS.keys())
def test_nothing_the_load_touches_is_released_before_it_lands(name: str, ring_slot: int) -> None:
    """Every lock release after the load started, and every free of a Mamba slot the load writes
    into, is logged after the wait, while the load's finish_event was no longer pending."""
    with sh.build_harness(hicache=True, auto_complete_events=False, **CONFIGS[name]) as h:
        unwound = _unwind_with_load(h, TOKEN_SITE[name], ring_slot=ring_slot)
        targets = h.mamba_load_targets()
        if h.cfg.mamba:
            assert targets, "the load writes the node's and the request's Mamba slots"
        wait = _wait_position(unwound)

        releases = _releases_after(unwound.entries, unwound.load_start)
        locks = [(i, detail) for i, op, detail in releases if op == "dec_lock_ref"]
        assert len(locks) == 2  # the two admitted requests' admission locks
        target_frees = [
            (i, detail) for i, op, detail in releases if op == "mamba_free" and _freed_slots(detail) & targets
        ]
        if h.cfg.mamba:
            assert target_frees, "the request's load-back slot is freed by the unwind"
        for i, detail in locks + target_frees:
            assert i > wait, (unwound.entries[i], unwound.entries)
            assert unwound.finish_event not in detail  # not released while the load was in flight


class StrictCase(NamedTuple):
    config: str
    site: sh.MissSite
    after: int


STRICT_CASES = {
    **{f"{name}-{TOKEN_SITE[name]}": StrictCase(name, TOKEN_SITE[name], 0) for name in CONFIGS},
    # The host hit holds its load-back slot; the fresh request's alloc(1) misses.
    "mamba-mamba_slot": StrictCase("mamba", "mamba_slot", 0),
    # The host hit's ping-pong pair is taken, then the fresh request's misses.
    "mamba_ping_pong-ping_pong": StrictCase("mamba_ping_pong", "ping_pong", 1),
}


@pytest.mark.parametrize("case", STRICT_CASES.values(), ids=STRICT_CASES.keys())
def test_nothing_released_before_the_wait(case: StrictCase) -> None:
    """The patch's own contract: once the load started, no lock is released and no Mamba slot is
    freed before the wait. Frees inside the `allocate_for_extend` call that misses (the batch's
    allocation undoing what it took in that call, so that a miss leaves nothing half-allocated)
    belong to that failed call, not to a release: those slots were free when the load started,
    so they are allowed before the wait but must never be a slot the load writes into."""
    with sh.build_harness(hicache=True, auto_complete_events=False, **CONFIGS[case.config]) as h:
        log = h.device_log
        real_allocate = ScheduleBatch.allocate_for_extend

        def allocate_for_extend(batch: Any) -> Any:
            # Bracket the allocation in the log, to tell its own rollback from later releases.
            log.add("pool_alloc", "begin")
            try:
                result = real_allocate(batch)
            except RuntimeError:
                log.add("pool_alloc", "miss")
                raise
            log.add("pool_alloc", "ok")
            return result

        with mock.patch.object(ScheduleBatch, "allocate_for_extend", allocate_for_extend):
            unwound = _unwind_with_load(h, case.site, after=case.after)
        targets = h.mamba_load_targets()
        wait = _wait_position(unwound)

        inside_failed_alloc: set[int] = set()
        begin = -1
        for i, (op, detail) in enumerate(unwound.entries):
            if (op, detail) == ("pool_alloc", "begin"):
                begin = i
            elif (op, detail) == ("pool_alloc", "miss"):
                inside_failed_alloc.update(range(begin, i))
        early = [
            unwound.entries[i]
            for i, op, detail in _releases_after(unwound.entries, unwound.load_start)
            if i < wait and i not in inside_failed_alloc
        ]
        assert early == [], f"released before the wait on load {unwound.consumer}: {unwound.entries}"
        for i in inside_failed_alloc:
            op, detail = unwound.entries[i]
            if op == "mamba_free":
                assert not _freed_slots(detail) & targets


# --------------------------------------------------------------------------------------------
# Two ranks: the rank that did not miss waits too
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def two_ranks() -> Any:
    return test_rank_agreement.run_two_ranks(["tp_hicache_host"])


def test_two_ranks_the_rank_that_did_not_miss_waits_for_its_load(two_ranks: Any) -> None:
    """Both ranks started the batch's HiCache load; rank 1 missed. Rank 0 allocated, but it too
    waits host-side on its own load's finish_event before it releases a lock or a Mamba slot.
    (Rank 1's failed allocation gives back, before the wait, only the slots it took in that call,
    which no load targets; its admission locks still come after the wait.)"""
    ranks = two_ranks.scenario("tp_hicache_host")
    for rank, r in ranks.items():
        assert r["batch"] is None, rank
        assert r["finish_event"] is not None, rank
        order = r["order"]
        assert order["synchronized"] == [r["finish_event"]], rank
        assert order["first_lock_release"] is not None, rank
        assert order["first_sync"] < order["first_lock_release"], rank
    order = ranks[0]["order"]
    assert order["first_sync"] < order["first_release"]
