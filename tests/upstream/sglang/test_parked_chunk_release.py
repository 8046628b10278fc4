"""A decode step short of memory releases a parked chunked request before it retracts anyone
(series entry "Scheduler: a decode step short of memory releases a parked chunked request before
it retracts anyone").

A chunked request whose next chunk missed is put back and parked: it keeps its row and the tree
lock on the chunks it computed while the running requests decode. When they fill the pool,
upstream's retraction takes decoding requests (their decoded KV is recomputed later) and, when
even the last one does not fit, aborts it with "Out of memory even after retracting all other
requests" (HTTP 500), although the pool's only other KV is the parked chunk's, which is making no
progress. With the patch the step releases the parked chunk first (its row and lock; it is queued
as a retracted request and admitted again later) and retracts only if the step still does not fit.

Expected, each FAILS without the patch and PASSES with it: the last request kept (upstream aborts
it); two requests short by less than the chunk both kept (releasing the chunk only for the last
request retracts one); a chunk whose last piece is still in flight not released until its result
is processed (the step decodes nothing meanwhile; a release while in flight frees KV the forward
is writing); on two gloo ranks with readings that drift, both ranks deciding alike.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from event_loop_driver import EventLoopDriver
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from test_decode_retraction import _checkpoint_prompt
from test_event_loop_driver import NO_OVERLAP
from test_prefill_unwind import CHUNK, MAMBA, _prompt
from test_rank_agreement import TwoRanks, _drifting, run_two_ranks

SHORT_TOKENS = 30  # two fit in one chunk
LONG_TOKENS = 100  # two chunks
# Admission reserves a new request's whole prompt and the running requests' decode (at the
# initial new-token ratio): room for both, then the short requests' decode fills the rest.
KV_TOKENS = 400
DECODE_STEPS_BOUND = KV_TOKENS  # no decode loop runs longer than the pool has tokens


def _start_decoding(h: sh.Harness, requests: int) -> ScheduleBatch:
    """`requests` short requests prefilled and decoding (the real admission and prefill round),
    their prompts put in the tree as the result processor does."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    # Enough new tokens to fill the pool, and few enough that admission still takes a chunk.
    max_new_tokens = (KV_TOKENS - requests * SHORT_TOKENS - CHUNK) // requests + 10
    for i in range(requests):
        sched._add_request_to_queue(h.make_req(_prompt(i, SHORT_TOKENS), max_new_tokens=max_new_tokens))
    batch = h.run_round()
    assert batch is not None and len(batch.reqs) == requests
    for req in batch.reqs:
        req.output_ids.append(7)
        _checkpoint_prompt(h, req)
    h.prepare_next_round()
    sched.running_batch = batch
    return batch


def _park_a_chunk(h: sh.Harness) -> Req:
    """A long request whose first chunk ran (cached and locked in the tree, as the loop stashes
    it), then whose next chunk's allocation missed: unwound and parked."""
    sched = h.scheduler
    long = h.add_request(_prompt(len(sched.running_batch.reqs), LONG_TOKENS))
    first = h.run_round()
    assert first is not None and first.reqs == [long] and sched.chunked_req is long
    long.inflight_middle_chunks -= 1  # its result processed (process_batch_result_prefill)
    h.prepare_next_round()
    with h.arm_miss("token_slots"):
        assert h.run_round() is None
    h.prepare_next_round()
    assert sched.chunked_req is long and sh.prefix_len(long) == CHUNK
    assert long.inflight_middle_chunks == 0
    return long


def _decode_until_full(h: sh.Harness, batch: ScheduleBatch) -> None:
    """Decode steps (each output token appended, as the result processor does) until the next one
    does not fit in the pool."""
    sched = h.scheduler
    for _ in range(DECODE_STEPS_BOUND):
        if not batch.check_decode_mem():
            return
        assert sched.update_running_batch(batch) is batch
        for req in batch.reqs:
            req.output_ids.append(7)
    raise AssertionError("the pool never filled")


def _decode_step(h: sh.Harness, batch: ScheduleBatch, long: Req) -> dict[str, Any]:
    sched = h.scheduler
    running = [r.rid for r in batch.reqs]
    queued_before = {r.rid for r in sched.waiting_queue}
    protected_before = h.tree_cache.protected_size()
    stepped = sched.update_running_batch(batch)
    kept = [] if stepped is None else [r.rid for r in stepped.reqs]
    queued = [r.rid for r in sched.waiting_queue if r.rid not in queued_before]
    return {
        "kept": kept,
        "queued": queued,
        "aborted": sorted(set(running) - set(kept) - set(queued)),
        "chunk_parked": sched.chunked_req is long,
        "chunk_holds_kv": long.kv.holds_kv,
        # Tree tokens whose lock was given back (the parked chunk's, or a retracted prompt's).
        "unlocked": protected_before - h.tree_cache.protected_size(),
        "releases": getattr(sched, "num_parked_chunk_releases", 0),
        "step_slots": None if stepped is None else len(stepped.out_cache_loc),
    }


@contextlib.contextmanager
def _parked_chunk_behind(
    requests: int, config: dict[str, Any] | None = None
) -> Iterator[tuple[sh.Harness, ScheduleBatch, Req]]:
    """`requests` short requests decoding into a pool the parked chunk's locked prefix shares,
    decoded until their next step does not fit."""
    with sh.build_harness(**(config or {}), kv_tokens=KV_TOKENS, chunked_prefill_size=CHUNK) as h:
        batch = _start_decoding(h, requests)
        long = _park_a_chunk(h)
        _decode_until_full(h, batch)
        yield h, batch, long


# A hybrid model's decode with ping-pong tracking pins host memory (CUDA only): the plain Mamba
# radix cache stands for the hybrid family here.
CONFIGS = {"page1": {}, "mamba": MAMBA}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_a_step_that_cannot_fit_its_last_request_releases_the_parked_chunk(config: dict[str, Any]) -> None:
    """One request decodes and the parked chunk's prefix holds the rest of the pool: upstream
    aborts the request; the step must release the chunk and decode it (a hybrid model's chunk
    gives back its Mamba slots too)."""
    with _parked_chunk_behind(requests=1, config=config) as (h, batch, long):
        step = _decode_step(h, batch, long)
        assert step["aborted"] == []
        assert step["kept"] == ["r0"] and step["step_slots"] == 1
        assert step["queued"] == [long.rid]
        assert not step["chunk_parked"] and not step["chunk_holds_kv"]
        assert step["unlocked"] == CHUNK
        assert step["releases"] == 1
        assert long.kv.mamba_pool_idx is None and long.kv.mamba_ping_pong_track_buffer is None
        # The released request is admitted again once the decoding request has finished.
        h.finish_request(batch.reqs[0])
        batch.filter_batch()
        batch.batch_is_full = False
        again = h.run_round()
        assert again is not None and again.reqs == [long]


def test_a_step_short_by_less_than_the_parked_chunk_retracts_nobody() -> None:
    """Two requests decode and their step is short by a token or two, less than the parked
    chunk's prefix: the step releases the chunk and decodes both. Releasing it only for the last
    request (after retraction took the other) retracts one request, whose decoded KV is then
    recomputed, while the chunk, which makes no progress, keeps its row and lock."""
    with _parked_chunk_behind(requests=2) as (h, batch, long):
        step = _decode_step(h, batch, long)
    assert step["aborted"] == [] and step["queued"] == [long.rid]
    assert step["kept"] == ["r0", "r1"] and step["step_slots"] == 2
    assert not step["chunk_parked"] and not step["chunk_holds_kv"]
    assert step["unlocked"] == CHUNK  # the chunk's prefix, not a retracted request's prompt
    assert step["releases"] == 1


def test_a_step_behind_a_chunk_still_in_flight_waits_a_step_then_releases_it() -> None:
    """With the overlap loop the parked request's last chunk can still be running (its result not
    processed) when the decode step is scheduled: the step decodes nothing rather than retract or
    abort (upstream aborts the request), and once the result is processed the next step releases
    the chunk and decodes."""
    with _parked_chunk_behind(requests=1) as (h, batch, long):
        sched = h.scheduler
        long.inflight_middle_chunks += 1  # its last chunk's result not processed yet
        assert sched.update_running_batch(batch) is None  # this step decodes nothing
        r0 = batch.reqs[0]
        assert [r.rid for r in batch.reqs] == ["r0"] and r0.to_finish is None and not sched.waiting_queue
        assert sched.chunked_req is long and long.kv.holds_kv
        long.inflight_middle_chunks -= 1  # the result processed, this iteration
        step = _decode_step(h, batch, long)
    assert step["aborted"] == [] and step["kept"] == ["r0"] and step["releases"] == 1


def _parked_chunk_with_drift(h: sh.Harness, rank: int) -> dict[str, Any]:
    """Both ranks, on SGLang's event_loop_normal, each rank's real reading drifting at every read
    (a co-tenant's 0-5 tokens, differently on each rank, as kvcached's cached reading drifts): one
    request decoding, then a long request whose first chunk runs and whose next chunk's allocation
    misses at every try (the pool cannot fit it), so it stays parked while the loop decodes the
    short request into the rest of the pool. The ranks must decide alike at the step that does not
    fit: release the chunk and decode the request."""
    sched = h.scheduler
    sched.enable_skip_finishing_decode = False
    sched.decode_offload_manager = None
    driver = EventLoopDriver(h)
    assert h.physical is not None
    h.physical.drift(_drifting(rank))
    max_new_tokens = KV_TOKENS - SHORT_TOKENS - CHUNK + 10
    short = h.make_req(_prompt(0, SHORT_TOKENS), max_new_tokens=max_new_tokens)
    sched._add_request_to_queue(short)
    assert driver.step().rids == (short.rid,)
    long = h.add_request(_prompt(1, LONG_TOKENS))
    assert driver.step().rids == (long.rid,) and sched.chunked_req is long
    protected: list[int] = []
    # Every later chunk of it misses, so it stays parked; for as long as the ~300 decode steps
    # take on a busy machine (its unwind deadline, 30 s by default, is not what this tests).
    with h.arm_miss("token_slots"), mock.patch.dict(os.environ, {"SGLANG_PREFILL_UNWIND_DEADLINE_S": "600"}):
        for _ in range(DECODE_STEPS_BOUND):
            protected.append(h.tree_cache.protected_size())
            ran = driver.step()
            if getattr(sched, "num_parked_chunk_releases", 0) or ran.forward_mode != "DECODE":
                break
    return {
        "long": long.rid,
        "ran": (ran.forward_mode, ran.rids),
        "decode_steps": len(protected),
        "queued": [r.rid for r in sched.waiting_queue],
        "aborted": sorted(r.rid for r in (short, long) if r.finished() and r.rid not in ran.rids),
        "chunk_parked": sched.chunked_req is long,
        "chunk_holds_kv": long.kv.holds_kv,
        # Tree tokens whose lock was given back (the parked chunk's, or a retracted prompt's).
        "unlocked": protected[-1] - h.tree_cache.protected_size(),
        "releases": getattr(sched, "num_parked_chunk_releases", 0),
        "uniform_free": h.token_to_kv_pool_allocator.uniform_available_size(),
    }


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    name = "tp_parked_chunk_with_drift"
    config = {"chunked_prefill_size": CHUNK, **NO_OVERLAP}
    return run_two_ranks([name], {name: _parked_chunk_with_drift}, {name: KV_TOKENS}, {name: config})


def test_two_ranks_whose_readings_drift_release_the_parked_chunk_alike(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_parked_chunk_with_drift")
    assert ranks[0] == ranks[1]  # kept, queued, aborted, the chunk's state, free space: alike
    r = ranks[0]
    assert r["aborted"] == [] and r["releases"] == 1, r
    assert r["ran"][0] == "DECODE" and len(r["ran"][1]) == 1, r  # the short request decoded on
    # The chunk released: queued again, holding nothing, its prefix's lock given back.
    assert r["queued"] == [r["long"]] and not r["chunk_parked"] and not r["chunk_holds_kv"], r
    assert r["unlocked"] == CHUNK, r
