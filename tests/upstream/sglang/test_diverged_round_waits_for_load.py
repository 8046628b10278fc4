"""A diverged prefill round waits for its own HiCache load before it releases anything (series
entry "Scheduler: wait for the batch's HiCache load before an unwind releases anything", its
DIVERGED clause).

Every HiCache load-back is agreed (both ranks load the prefix or neither), so a round that both
ranks loaded for can still be DIVERGED: the ranks admitted the loaded request and then different
other requests. Both put the round back, and each must first wait on its own load's finish_event,
as a missed round does (test_unwind_waits_for_load.py), before it releases a lock or a Mamba slot
the load writes into.

Two forked gloo ranks (a Mamba pool, a rank-local KV pool, HiCache, loads pending until waited
on). Both have PREFIX on host; the queue holds [*PREFIX, 7, 8, 9], then a longer request. Rank 1's
uniform reading drops after the round's first vote (a pool whose own reading moves on one rank),
so it admits the first request, loading PREFIX as rank 0 does, but not the second: the round is
DIVERGED on both ranks.

Expected: FAILS where a diverged round skips the wait (rank 0 released a lock with no wait at
all), PASSES with it. A line test, not in the entry's `Test:` list: a diverged round with a load on
both ranks needs the agreed load-backs and the least free space of later entries (the entry's own
diverged-round test, test_diverged_round_loads.py, loads on one rank only, which they rule out).
"""

from __future__ import annotations

from typing import Any

import pytest
import scheduler_harness as sh
from test_prefill_unwind import MAMBA, PREFIX, _prompt
from test_rank_agreement import TwoRanks, _loop, _release_order, run_two_ranks

NAME = "tp_diverged_round_with_a_load"
CONFIG: dict[str, Any] = {
    **MAMBA,
    "hicache": True,
    "auto_complete_events": False,
}  # elastic: every two-rank run
# What rank 1 keeps free once its reading drops: room for the loaded request, not the second.
LEFT_FREE = 48
SECOND_PROMPT = 96


def _diverged_round_with_a_load(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The round is the first iteration of SGLang's event loop (the configuration's:
    event_loop_overlap)."""
    sched = h.scheduler
    driver = _loop(h)
    assert h.physical is not None
    h.physical.take(0)
    h.put_prefix_on_host(PREFIX)
    if rank == 1:
        agreement = sched._prefill_agreement
        drop = h.physical.uniform() - LEFT_FREE
        h.physical.part_own_reading(lambda: drop if agreement.votes >= 1 else 0)
    h.add_request([*PREFIX, 7, 8, 9])
    h.add_request(_prompt(1, SECOND_PROMPT))
    h.device_log.clear()
    with h.spy_releases():
        ran = driver.step()
    consumer = [int(name) for op, name in h.device_log.entries if op == "consumer"]
    return {
        "batch": None if ran.forward_mode is None else list(ran.rids),
        "divergences": sched.num_prefill_divergences,
        "unwinds": sh.num_prefill_unwinds(h),
        "order": _release_order(h.device_log.entries),
        "finish_event": (
            h.layer_done_counter.events[consumer[0]].finish_event.name
            if consumer and consumer[0] >= 0
            else None
        ),
    }


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    # The ranks admit apart on purpose: upstream's checker may see their calls differ too.
    return run_two_ranks(
        [NAME], {NAME: _diverged_round_with_a_load}, {}, {NAME: CONFIG}, divergence_expected={NAME}
    )


def test_a_diverged_round_waits_for_its_load_before_it_releases_anything(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario(NAME)
    for rank, r in ranks.items():
        assert r["batch"] is None and r["divergences"] == 1 and r["unwinds"] == 0, (rank, r)
        assert r["finish_event"] is not None, (rank, r)  # both ranks loaded PREFIX
        order = r["order"]
        # The first wait is on its own load's last layer (then the load, unshared or not, is
        # finished: its ack).
        assert order["synchronized"][:1] == [r["finish_event"]], (rank, r)
        assert order["first_lock_release"] is not None, (rank, r)
        assert order["first_sync"] < order["first_lock_release"], (rank, r)
