"""A prefill allocation miss as one typed error, and a request pool that takes nothing when it
misses (series entry "Allocation: every prefill allocation miss is one typed AllocationMiss",
sgl-project/sglang#34676).

Upstream, a prefill batch's allocation misses in three shapes: `alloc_token_slots` and
`alloc_paged_token_slots_extend` raise a bare RuntimeError, `alloc_req_slots` raises one when the
request pool returns None, and `HybridReqToTokenPool.alloc` trips an assert on a Mamba or
ping-pong miss, keeping the rows and slots that call already took. With the patch each is an
`AllocationMiss` (still a RuntimeError, with upstream's diagnostics where upstream gave them),
and the request pool gives back what the missing call took. The batch still stops the scheduler
here; later entries of the series put it back instead.

Expected: these tests FAIL on pristine upstream and PASS with the patch.
"""

from __future__ import annotations

import logging
from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache import allocation

MAMBA: dict[str, Any] = {"mamba": True}
PING_PONG: dict[str, Any] = {"mamba": True, "ping_pong": True}
# Every site of a prefill batch's allocation that can miss, with the pools that have it.
SITES: dict[sh.MissSite, dict[str, Any]] = {
    "req_rows": {},
    "token_slots": {},
    "paged_extend": {"page_size": 4},
    "mamba_slot": MAMBA,
    "ping_pong": PING_PONG,
}
# The sites whose miss upstream logs with the pools' state and the tree (the others raise bare).
DIAGNOSED_SITES = {"token_slots", "paged_extend"}


def _prompt(i: int, length: int = 20) -> list[int]:
    return [1000 + 50 * i + k for k in range(length)]


def _holds_nothing(req: Req) -> bool:
    return not req.kv.holds_kv and not req.kv.holds_mamba and req.kv.mamba_ping_pong_track_buffer is None


@pytest.mark.parametrize("site", SITES)
def test_every_prefill_miss_is_one_typed_error(site: sh.MissSite, caplog: pytest.LogCaptureFixture) -> None:
    """Whatever pool misses, `prepare_for_extend` raises `AllocationMiss`, a RuntimeError (so
    every caller that let a RuntimeError stop the scheduler still does), and a miss upstream
    diagnosed is logged once, with the tree printed once."""
    with sh.build_harness(**SITES[site]) as h:
        for i in range(3):
            h.add_request(_prompt(i))
        batch = h.admitted_batch()
        caplog.set_level(logging.ERROR)
        with (
            h.arm_miss(site),
            mock.patch.object(h.tree_cache, "pretty_print") as pretty_print,
            pytest.raises(RuntimeError) as raised,
        ):
            batch.prepare_for_extend()
        assert type(raised.value) is getattr(allocation, "AllocationMiss", None)
        if site in DIAGNOSED_SITES:
            assert pretty_print.call_count == 1
            assert len([r for r in caplog.records if "Try to allocate" in r.getMessage()]) == 1


@pytest.mark.parametrize("site", ["mamba_slot", "ping_pong"])
def test_a_missing_request_pool_takes_nothing(site: sh.MissSite) -> None:
    """`HybridReqToTokenPool.alloc`, when its Mamba (or ping-pong) allocation misses for the
    second request, gives back the rows and state slots that same call took for the first:
    None means nothing taken."""
    with sh.build_harness(**PING_PONG) as h:
        reqs = [h.add_request(_prompt(i)) for i in range(3)]
        batch = h.admitted_batch()
        pool = h.req_to_token_pool
        real_alloc = pool.alloc
        seen: list[tuple[dict[str, int], Any, dict[str, int]]] = []

        def alloc(batch_reqs: list[Req]) -> Any:
            free_before = h.free_counts()
            result = real_alloc(batch_reqs)
            seen.append((free_before, result, h.free_counts()))
            return result

        with mock.patch.object(pool, "alloc", alloc), h.arm_miss(site, after=1), pytest.raises(RuntimeError):
            batch.prepare_for_extend()

        [(free_before, result, free_after)] = seen
        assert result is None
        assert free_after == free_before  # the first request's row and slots are back
        assert all(_holds_nothing(r) for r in reqs)


def test_decode_miss_still_stops_with_its_diagnostics(caplog: pytest.LogCaptureFixture) -> None:
    """Decode allocates through `alloc_token_slots` (alloc_for_decode). Its miss raises a
    RuntimeError (AllocationMiss is one) after logging the error and printing the tree, as
    upstream does: nothing outside prefill changes."""
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
