"""A Mamba checkpoint that finds every slot held does not kill the scheduler (series entry
"Mamba checkpoint: a slot miss waits for the write-through backups in flight, then skips the
checkpoint").

With HiCache write-through on a hybrid model, each tree node that holds a Mamba state stays locked
until its host backup's ack is reaped (writing_check, at the start of a later scheduler step). A
request's checkpoint (a chunk's stash, the end of its prefill: checkpoint_into_tree ->
MambaComponent.prepare_for_caching_req -> _alloc_mamba_slot) that finds every slot taken evicts,
finds nothing unlocked, and upstream asserts "Can not alloc mamba cache", which kills the
scheduler. With the entry it waits for the backups in flight, reaps their acks and evicts again;
where still nothing can be had it skips that checkpoint (the request keeps its live state; only a
later prefix hit is lost), counted in sglang:mamba_slot_misses_total{outcome}.

The trees are the real UnifiedRadixCache / MambaComponent / HybridCacheController; the copies'
completion events are a fake device's, pending until waited on.

Expected: the checkpoint tests FAIL without the entry (the assertion) and PASS with it; the
two-rank test, where one rank's copies have landed and the other's have not, FAILS without it (the
assertion on both ranks) and PASSES with it, both ranks deciding alike.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from event_loop_driver import EventLoopDriver
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixKey
from test_decode_retraction import _checkpoint_prompt
from test_event_loop_driver import NO_OVERLAP
from test_prefill_unwind import _prompt
from test_rank_agreement import TwoRanks, run_two_ranks

PROMPT_TOKENS = 100
MAMBA_SLOTS = 6
# The request holds one slot; finished prefixes, their backups in flight, hold the rest.
PREFIXES = MAMBA_SLOTS - 1
PREFIX_TOKENS = 10
PREFIX_START = 30_000
CONFIG: dict[str, Any] = {
    "mamba": True,
    "hicache": True,
    "auto_complete_events": False,
    "mamba_slots": MAMBA_SLOTS,
}


def _prefix(i: int) -> list[int]:
    start = PREFIX_START + 100 * i
    return list(range(start, start + PREFIX_TOKENS))


def _mamba(h: sh.Harness) -> Any:
    """The tree's real MambaComponent."""
    found = [c for c in h.tree_cache._components_tuple if type(c).__name__ == "MambaComponent"]
    assert len(found) == 1
    return found[0]


def _running_request(h: sh.Harness) -> tuple[Req, ScheduleBatch]:
    """One request admitted and prefilled (the real round): it holds its own Mamba slot."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    req = h.add_request(_prompt(0, PROMPT_TOKENS))
    batch = h.run_round()
    assert batch is not None and batch.reqs == [req]
    req.output_ids.append(7)
    sched.running_batch = batch
    return req, batch


def _fill_with_backed_up_prefixes(h: sh.Harness) -> list[Any]:
    """Finished prefixes take every Mamba slot left, each node locked by its write-through backup
    (in flight: its event pending). Returns their tree nodes, in the order their backups went."""
    nodes = []
    for i in range(h.free_counts()["mamba_slots"]):
        h.cache_prefix(_prefix(i))
        nodes.append(_match(h, _prefix(i))[1])
    assert h.free_counts()["mamba_slots"] == 0
    assert len(h.tree_cache.ongoing_write_through) == len(nodes)
    return nodes


def _match(h: sh.Harness, tokens: list[int]) -> tuple[int, Any]:
    """(device match length, last device node) of `tokens` in the tree."""
    result = h.tree_cache.match_prefix(MatchPrefixParams(key=RadixKey(token_ids=array("q", tokens))))
    return sh._device_match_len(result), result.last_device_node


@contextlib.contextmanager
def _held_by_other_requests(h: sh.Harness, nodes: list[Any]) -> Iterator[None]:
    """Lock `nodes` as requests that matched them do (inc_lock_ref), until the block ends."""
    receipts = [(node, h.tree_cache.inc_lock_ref(node).to_dec_params()) for node in nodes]
    try:
        yield
    finally:
        for node, receipt in receipts:
            h.tree_cache.dec_lock_ref(node, receipt)


def _checkpoint(h: sh.Harness, req: Req) -> dict[str, Any]:
    mamba_slot = int(req.kv.mamba_pool_idx)
    _checkpoint_prompt(h, req)
    misses = _mamba(h).slot_misses
    return {
        "rescued": misses.rescued,
        "skipped": misses.checkpoint_skipped,
        "prompt_cached": _match(h, list(req.origin_input_ids))[0],
        "own_slot_kept": int(req.kv.mamba_pool_idx) == mamba_slot,
        "backups_in_flight": len(h.tree_cache.ongoing_write_through),
    }


def _decode_then_finish(h: sh.Harness, req: Req, batch: ScheduleBatch) -> list[str]:
    """The request's next decode step (the real update_running_batch) and its finish; the idle
    leak check's problems after it."""
    stepped = h.scheduler.update_running_batch(batch)
    assert stepped is not None and stepped.reqs == [req], "the request must keep decoding"
    h.scheduler.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
    h.finish_request(req)
    h.device.complete_all()
    h.tree_cache.writing_check(finish_count=len(h.tree_cache.cache_controller.ack_write_queue))
    return h.idle_leak_report()


def test_a_checkpoint_behind_backups_in_flight_waits_for_them_and_is_taken() -> None:
    """Every free slot is held by a node whose backup is in flight: the checkpoint waits for the
    copies, evicts one of the nodes they unlocked and is taken."""
    with sh.build_harness(**CONFIG) as h:
        req, batch = _running_request(h)
        _fill_with_backed_up_prefixes(h)
        seen = _checkpoint(h, req)
        leaks = _decode_then_finish(h, req, batch)
    assert seen == {
        "rescued": 1,
        "skipped": 0,
        "prompt_cached": PROMPT_TOKENS,
        "own_slot_kept": True,
        "backups_in_flight": 1,  # every prefix's waited for; the checkpoint's own, started by its insert
    }
    assert leaks == []


def test_the_rescue_evicts_after_the_wait_whatever_this_rank_counted() -> None:
    """The number of acks a rank reaps is its own (a backup that found no host memory on one
    rank queued none there; upstream's writing_check says so), so the rescue must not decide on
    it: after the wait it evicts and retries on every rank. Here the wait does its real work but
    reports 0 acks, as a rank whose acks were counted elsewhere would: the checkpoint is still
    taken."""
    with sh.build_harness(**CONFIG) as h:
        req, batch = _running_request(h)
        _fill_with_backed_up_prefixes(h)
        wait = h.tree_cache.finish_write_through_in_flight

        def wait_counting_nothing() -> int:
            wait()
            return 0

        h.tree_cache.finish_write_through_in_flight = wait_counting_nothing
        seen = _checkpoint(h, req)
        leaks = _decode_then_finish(h, req, batch)
    assert (seen["rescued"], seen["skipped"], seen["prompt_cached"]) == (1, 0, PROMPT_TOKENS)
    assert leaks == []


def test_the_last_backup_in_flight_is_waited_for() -> None:
    """Only the node whose backup went last can be evicted once its copy lands (the others are
    held by requests that matched them): a wait that stops one ack short finds nothing."""
    with sh.build_harness(**CONFIG) as h:
        req, batch = _running_request(h)
        nodes = _fill_with_backed_up_prefixes(h)
        with _held_by_other_requests(h, nodes[:-1]):
            seen = _checkpoint(h, req)
        leaks = _decode_then_finish(h, req, batch)
    assert (seen["rescued"], seen["skipped"], seen["prompt_cached"]) == (1, 0, PROMPT_TOKENS)
    assert seen["backups_in_flight"] == 1  # every prefix's waited for; the checkpoint's own
    assert leaks == []


def test_a_checkpoint_with_nothing_evictable_is_skipped_and_the_request_decodes_on() -> None:
    """Every slot is held by nodes other requests hold: after the wait nothing is evictable, so
    the checkpoint is skipped. The request keeps its own state and decodes on; only its prompt is
    not cached (a later request with that prefix recomputes it)."""
    with sh.build_harness(**CONFIG) as h:
        req, batch = _running_request(h)
        nodes = _fill_with_backed_up_prefixes(h)
        with _held_by_other_requests(h, nodes):
            seen = _checkpoint(h, req)
        leaks = _decode_then_finish(h, req, batch)
    assert seen == {
        "rescued": 0,
        "skipped": 1,
        "prompt_cached": 0,
        "own_slot_kept": True,
        "backups_in_flight": 0,  # every backup waited for
    }
    assert leaks == []


def test_the_miss_is_counted_in_prometheus() -> None:
    """A skipped checkpoint increments sglang:mamba_slot_misses_total of the tree's real
    RadixCacheMetricsCollector (its Prometheus classes swapped for recording stand-ins)."""
    from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector

    class RecordingCollector(RadixCacheMetricsCollector):  # type: ignore[misc]  # sglang is untyped
        _counter_cls = _histogram_cls = sh.RecordingMetric

    sh.RecordingMetric.created = {}
    with sh.build_harness(**CONFIG) as h:
        h.tree_cache.metrics_collector = RecordingCollector(labels={"cache": "tiny"})
        req, _ = _running_request(h)
        nodes = _fill_with_backed_up_prefixes(h)
        with _held_by_other_requests(h, nodes):
            _checkpoint(h, req)
    assert sh.RecordingMetric.created["sglang:mamba_slot_misses_total"].total == 1


def _landed_on_one_rank(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Both ranks, on SGLang's event_loop_normal: backed-up prefixes hold every Mamba slot but
    one, which a request's admission takes. Rank 0's copies land, rank 1's are still in flight;
    the iteration's lockstep reaping (writing_check, the least count any rank has ready) then reaps
    none on either rank. The request prefills, and the loop's result processing checkpoints its
    prompt with no slot free: the checkpoint must decide alike on both ranks."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    driver = EventLoopDriver(h)
    for i in range(h.free_counts()["mamba_slots"] - 1):
        h.cache_prefix(_prefix(i))
    assert len(h.tree_cache.ongoing_write_through) == PREFIXES
    req = h.add_request(_prompt(0, PROMPT_TOKENS))
    if rank == 0:
        h.device.complete_all()
    in_flight: list[int] = []
    poll = sched._process_hicache_events

    def polled(*args: Any, **kwargs: Any) -> Any:
        polled_now = poll(*args, **kwargs)
        in_flight.append(len(h.tree_cache.ongoing_write_through))
        return polled_now

    with mock.patch.object(sched, "_process_hicache_events", polled):
        ran = driver.step()
    misses = _mamba(h).slot_misses
    return {
        "ran": (ran.forward_mode, ran.rids),
        "in_flight_after_lockstep_reaping": in_flight[0],
        "rescued": misses.rescued,
        "skipped": misses.checkpoint_skipped,
        "prompt_cached": _match(h, list(req.origin_input_ids))[0],
        "backups_in_flight": len(h.tree_cache.ongoing_write_through),
        "free_mamba_slots": h.free_counts()["mamba_slots"],
    }


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    name = "tp_mamba_checkpoint_behind_backups"
    return run_two_ranks([name], {name: _landed_on_one_rank}, {}, {name: {**CONFIG, **NO_OVERLAP}})


def test_two_ranks_whose_copies_land_apart_checkpoint_alike(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_mamba_checkpoint_behind_backups")
    assert ranks[0] == ranks[1]  # the same outcome, tree and free slots on both ranks
    r = ranks[0]
    assert r["in_flight_after_lockstep_reaping"] == PREFIXES
    assert (r["rescued"], r["skipped"], r["prompt_cached"]) == (1, 0, PROMPT_TOKENS)
