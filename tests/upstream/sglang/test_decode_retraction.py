"""A decode step short of memory first waits for the host backups in flight (series entry
"Scheduler: a decode step short of memory waits for the host backups in flight before it
retracts").

With HiCache's write-through, a prompt put in the tree after its prefill is backed up to host at
once, and the tree node stays locked until that copy is acknowledged. A decode step that does not
fit evicts what is unlocked, then retracts requests: a request whose prompt is still being copied
gives back only its tail, so upstream retracts request after request for almost nothing and aborts
the last one with "Out of memory even after retracting all other requests" (HTTP 500), while the
pool holds enough KV that is merely waiting for its copy. With the patch the step waits for those
copies first (the ack's event, a host wait), unlocks their nodes and checks again: it evicts
instead of retracting, and a request it still retracts gives back its prompt too.

The copies are the real HiCache ones (UnifiedRadixCache / HiRadixCache and the cache controller),
their completion events a fake device's that stay pending until waited on.

Expected: the first test FAILS without the patch (one request retracted, the other aborted) and
PASSES with it; the second pins what the patch must leave alone (a step that fits waits for
nothing); the third, on two gloo ranks with rank 0's reading drifting, FAILS without the patch (a
request retracted on both ranks) and PASSES with it, both ranks deciding alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import scheduler_harness as sh
from event_loop_driver import EventLoopDriver
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache import common
from test_event_loop_driver import NO_OVERLAP
from test_prefill_unwind import _prompt
from test_rank_agreement import TwoRanks, _drifting, run_two_ranks

PROMPT_TOKENS = 100
# Two prompts and a little room for their decode: admission takes both.
KV_TOKENS = 2 * PROMPT_TOKENS + 30
FILLER_START = 20_000


def _checkpoint_prompt(h: sh.Harness, req: Req) -> None:
    """What the batch result processor does for a request still running after its prefill: put
    its prompt in the tree (0.5.22 on: checkpoint_kv_cache; before: maybe_cache_unfinished_req),
    which starts the write-through backup."""
    checkpoint = getattr(common, "checkpoint_kv_cache", None)
    if checkpoint is not None:
        checkpoint(req, h.tree_cache)
    else:
        common.maybe_cache_unfinished_req(req, h.tree_cache)
    h.flush_pending_backups()


@contextlib.contextmanager
def _decoding(kv_tokens: int) -> Iterator[tuple[sh.Harness, ScheduleBatch]]:
    """Two requests prefilled and decoding, their prompts in the tree with their host backups in
    flight (the copies' events stay pending until waited on)."""
    with sh.build_harness(hicache=True, auto_complete_events=False, kv_tokens=kv_tokens) as h:
        yield h, _start_decoding(h)


def _start_decoding(h: sh.Harness) -> ScheduleBatch:
    """Two requests prefilled and decoding (the real admission and prefill round), their prompts
    put in the tree as the result processor does, which starts their host backups."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    for i in range(2):
        h.add_request(_prompt(i, PROMPT_TOKENS))
    batch = h.run_round()
    assert batch is not None and len(batch.reqs) == 2
    for req in batch.reqs:
        req.output_ids.append(7)
        _checkpoint_prompt(h, req)
    sched.running_batch = batch
    assert h.tree_cache.ongoing_write_through, "the backups must still be in flight"
    return batch


def _fill_with_a_finished_prefix(h: sh.Harness, left_free: int = 0) -> None:
    """A finished request's prefix takes the rest of the pool but `left_free` tokens, its backup
    in flight too (sized from the free space every rank counts alike)."""
    free = h.free_counts()["kv_tokens"] - left_free
    h.cache_prefix(list(range(FILLER_START, FILLER_START + free)))


def _decode_step(h: sh.Harness, batch: ScheduleBatch) -> dict[str, Any]:
    sched = h.scheduler
    running = [r.rid for r in batch.reqs]
    stepped = sched.update_running_batch(batch)
    kept = [] if stepped is None else [r.rid for r in stepped.reqs]
    return {
        "kept": kept,
        "retracted": [r.rid for r in sched.waiting_queue],
        "aborted": sorted(set(running) - set(kept) - {r.rid for r in sched.waiting_queue}),
        "backups_in_flight": len(h.tree_cache.ongoing_write_through),
    }


def test_a_step_behind_a_finished_prefix_s_backup_evicts_it_instead_of_retracting() -> None:
    """The pool's only reclaimable KV is a finished request's prefix whose backup is in flight:
    upstream cannot evict it, retracts one request for nothing and aborts the other; the step
    must wait for the copy, evict the prefix and decode both."""
    with _decoding(KV_TOKENS) as (h, batch):
        _fill_with_a_finished_prefix(h)
        step = _decode_step(h, batch)
    assert step["aborted"] == []
    assert step["retracted"] == []
    assert len(step["kept"]) == 2
    assert step["backups_in_flight"] == 0


def test_a_step_that_fits_waits_for_no_copy() -> None:
    """A step that fits does not wait for any copy (a default deployment's decode is unchanged)."""
    with _decoding(4 * KV_TOKENS) as (h, batch):
        in_flight = len(h.tree_cache.ongoing_write_through)
        step = _decode_step(h, batch)
    assert step["backups_in_flight"] == in_flight
    assert len(step["kept"]) == 2


def _behind_backups_with_drift(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Both ranks, on SGLang's event_loop_normal: a rank-local pool, two requests prefilled (the
    loop's result processing puts their prompts in the tree, which starts their backups), a
    finished prefix filling the pool but one token (one less than the next step needs), every
    backup in flight; then each rank's real reading drifts at every read (a co-tenant's 0-5
    tokens, differently on each rank, as kvcached's cached reading drifts). The loop's next
    iteration decodes: the ranks must decide alike, wait, evict the prefix, decode both."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    driver = EventLoopDriver(h)
    assert h.physical is not None
    h.physical.take(0)  # the setup fills the pool exactly; the readings drift once it is full
    reqs = [h.add_request(_prompt(i, PROMPT_TOKENS)) for i in range(2)]
    prefill = driver.step()
    assert prefill.forward_mode == "EXTEND" and len(prefill.rids) == 2, prefill
    assert h.tree_cache.ongoing_write_through, "the backups must still be in flight"
    _fill_with_a_finished_prefix(h, left_free=1)
    h.physical.drift(_drifting(rank))
    decode = driver.step()
    kept = list(decode.rids) if decode.forward_mode == "DECODE" else []
    queued = {r.rid for r in sched.waiting_queue}
    return {
        "kept": kept,
        "retracted": sorted(queued),
        "aborted": sorted({r.rid for r in reqs} - set(kept) - queued),
        "backups_in_flight": len(h.tree_cache.ongoing_write_through),
        "uniform_free": h.token_to_kv_pool_allocator.uniform_available_size(),
    }


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    name = "tp_behind_backups_with_drift"
    config = {"hicache": True, "auto_complete_events": False, **NO_OVERLAP}
    return run_two_ranks([name], {name: _behind_backups_with_drift}, {name: KV_TOKENS}, {name: config})


def test_two_ranks_whose_readings_drift_wait_and_evict_alike(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_behind_backups_with_drift")
    assert ranks[0] == ranks[1]  # kept, retracted, aborted, copies in flight, free space: alike
    r = ranks[0]
    assert r["aborted"] == [] and r["retracted"] == [] and len(r["kept"]) == 2
    assert r["backups_in_flight"] == 0
