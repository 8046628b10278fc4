"""`ScheduleBatch.prepare_for_extend` in halves that can be undone (series entry "ScheduleBatch:
split prepare_for_extend into an allocation that can be given back and its finish",
sgl-project/sglang#34676).

`allocate_for_extend` computes a prefill batch's inputs and allocates its rows, Mamba slots and
KV pages without moving any request's prefill progress; `finish_extend` then does the rest of
what `prepare_for_extend` did, and `give_back_extend` instead returns the pools and the requests
to what they were before the allocation. A miss inside `allocate_for_extend` leaves nothing
half-allocated and is left to its caller to report.

Expected: these tests FAIL on pristine upstream (and with only the typed miss) and PASS with
the patch.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from sglang.srt.managers import schedule_batch as schedule_batch_module
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.mem_cache import allocation
from sglang.srt.session.session_controller import Session

PREFIX = list(range(100, 132))  # 32 tokens: whole pages for page_size 1 and 4
MAMBA: dict[str, Any] = {"mamba": True}
PING_PONG: dict[str, Any] = {"mamba": True, "ping_pong": True}
CONFIGS: dict[str, dict[str, Any]] = {
    "page1": {},
    "page4": {"page_size": 4},
    "mamba": MAMBA,
    "mamba_ping_pong": PING_PONG,
    "hicache_page4": {"hicache": True, "page_size": 4},
}
# What the batch's first request starts from: a cached prefix; a streaming session's later turn
# (its extend starts inside the prefix's last page with page 4); a session's first turn (from
# 0.5.22 on its allocation opens the session's slot and hands it the admission lock).
STARTS = ["prefix", "session_turn", "session_first_turn"]


def _prompt(i: int, length: int = 20) -> list[int]:
    return [1000 + 50 * i + k for k in range(length)]


def _queue(h: sh.Harness, start: str) -> list[Req]:
    if start == "prefix":
        h.cache_prefix(PREFIX)
        first = h.add_request([*PREFIX, 7, 8, 9])
    elif start == "session_turn":
        first_turn = _prompt(7, 30)
        session = h.open_streaming_session(first_turn)
        first = h.add_request([*first_turn, 5, 6, 7, 8, 9], session=session)
    else:
        session = Session(capacity_of_str_len=1 << 16, session_id="first-turn", streaming=True)
        first = h.add_request(_prompt(7, 30), session=session)
    return [first, *(h.add_request(_prompt(i)) for i in range(2))]


def _request_state(req: Req) -> tuple[Any, ...]:
    """What an allocation changes about a request, with the admission lock and node by identity."""
    kv = req.kv
    ping_pong = kv.mamba_ping_pong_track_buffer
    return (
        kv.req_pool_idx,
        None if kv.mamba_pool_idx is None else int(kv.mamba_pool_idx),
        None if ping_pong is None else ping_pong.tolist(),
        kv.kv_allocated_len,
        kv.kv_committed_len,
        id(getattr(req, "lock", None)),
        getattr(req, "lock_receipt", None),
        id(req.last_node),
        getattr(req, "kv_rotation_base", None),
        sh.prefix_len(req),
        sh.extend_end(req),
    )


def _session_slots(h: sh.Harness) -> list[str] | None:
    slots = getattr(getattr(h.tree_cache, "session", None), "slots", None)
    return None if slots is None else sorted(slots)


def _batch_fields(batch: ScheduleBatch) -> dict[str, Any]:
    def plain(value: Any) -> Any:
        return value.tolist() if hasattr(value, "tolist") else value

    fields = ["input_ids", "seq_lens", "out_cache_loc", "req_pool_indices", "prefix_lens", "extend_lens"]
    found = {name: plain(getattr(batch, name)) for name in fields}
    found["forward_mode"] = batch.forward_mode
    found["extend_num_tokens"] = batch.extend_num_tokens
    found["requests"] = [_request_state(req)[:5] + _request_state(req)[9:] for req in batch.reqs]
    return found


@contextlib.contextmanager
def _stamping_rotation_bases() -> Iterator[None]:
    """A page-interleaved pool stamps each request's rotation base during the allocation; the
    harness's pools are not interleaved, so stamp one the way they would."""
    real = schedule_batch_module.alloc_for_extend

    def alloc_and_stamp(batch: ScheduleBatch) -> Any:
        result = real(batch)
        for req in batch.reqs:
            if hasattr(req, "kv_rotation_base"):
                req.kv_rotation_base = 3
        return result

    with mock.patch.object(schedule_batch_module, "alloc_for_extend", alloc_and_stamp):
        yield


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_allocate_then_finish_is_prepare_for_extend(config: dict[str, Any]) -> None:
    """For every other caller nothing changes: the two halves build the same batch, and leave
    the requests in the same state, as `prepare_for_extend` in one go."""
    built = []
    for split in (False, True):
        with sh.build_harness(**config) as h:
            _queue(h, "prefix")
            batch = h.admitted_batch()
            if split:
                batch.finish_extend(batch.allocate_for_extend())
            else:
                batch.prepare_for_extend()
            built.append(_batch_fields(batch))
    assert built[0] == built[1]


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_give_back_leaves_pools_and_requests_as_before(config: dict[str, Any], start: str) -> None:
    """After `allocate_for_extend`, `give_back_extend` returns every pool's free space and every
    request's rows, slots, KV lengths, admission lock, rotation base and session hand-off to
    what they were before, and moves no request's prefill progress."""
    with sh.build_harness(**config) as h:
        reqs = _queue(h, start)
        batch = h.admitted_batch()
        free_before = h.free_counts()
        states_before = [_request_state(req) for req in reqs]
        slots_before = _session_slots(h)
        with _stamping_rotation_bases():
            taken = batch.allocate_for_extend()
        assert h.free_counts() != free_before
        batch.give_back_extend(taken)
        assert h.free_counts() == free_before
        assert [_request_state(req) for req in reqs] == states_before
        assert _session_slots(h) == slots_before


@pytest.mark.parametrize(
    ("config", "site"),
    [
        ({}, "token_slots"),
        ({"page_size": 4}, "paged_extend"),
        (PING_PONG, "mamba_slot"),
        (PING_PONG, "ping_pong"),
    ],
    ids=["token_slots", "paged_extend", "mamba_slot", "ping_pong"],
)
def test_a_miss_takes_nothing_and_is_left_to_the_caller(
    config: dict[str, Any], site: sh.MissSite, caplog: pytest.LogCaptureFixture
) -> None:
    """A miss inside `allocate_for_extend` raises `AllocationMiss` with nothing half-allocated
    (the rows taken before a token miss are back) and is not logged there: its caller decides
    whether it is fatal. `prepare_for_extend`, for which it is, still logs it."""
    with sh.build_harness(**config) as h:
        reqs = _queue(h, "prefix")
        batch = h.admitted_batch()
        free_before = h.free_counts()
        states_before = [_request_state(req) for req in reqs]
        caplog.set_level(logging.ERROR)
        miss = getattr(allocation, "AllocationMiss", RuntimeError)
        with (
            h.arm_miss(site, after=1 if site in ("mamba_slot", "ping_pong") else 0),
            mock.patch.object(h.tree_cache, "pretty_print") as pretty_print,
            pytest.raises(miss),
        ):
            batch.allocate_for_extend()
        assert h.free_counts() == free_before
        assert [_request_state(req) for req in reqs] == states_before
        assert pretty_print.call_count == 0
        assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
