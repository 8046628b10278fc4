"""A diverged prefill round that started a HiCache load on one rank only (review finding 8).

Finding: "A DIVERGED prefill round (the ranks admitted different batches; the carried scheduler
puts back what each admitted, on every rank) that started a HiCache load on ONE rank only keeps
that rank's load ack and node lock until a peer gets a matching ack."

Scenario (two forked gloo ranks, TP; the config of RANK_SCENARIOS["tp_hicache_host"]: Mamba,
elastic KV pool, HiCache, loads pending until synchronized). Rank 0 has PREFIX on host, rank 1 a
different 32-token prefix (so both ranks make the same collectives while putting them there). The
request [*PREFIX, 7, 8, 9] is a host hit on rank 0 only: its round starts a load on rank 0
(`ready_to_load_host_cache`, scheduler.py:4486-4488) and admits it with prefix 32, rank 1 with
prefix 0; the fingerprints differ, the round is DIVERGED on both (:4661) and put back on both
(batch None, `num_prefill_divergences` 1, no unwind counted). The request is then withdrawn on
both ranks (its client aborts it while queued; it holds nothing after the put-back), else the
ranks keep diverging on the prefix rank 0 now has on device and the third round stops the
scheduler. Then idle polls (`prepare_next_round`: the copies land, the real
`_process_hicache_events`), then two rounds that each load a prefix both ranks have on host, run
alike on both, finish, and more polls.

What the ranks showed without the fix (sglang 0.5.23 with the carried patches up to the load
wait): after the diverged round and three idle polls, rank 0 kept 1 load ack queued, PREFIX's node
in `ongoing_load_back`, protected_size 32 (the load's own lock), `is_fully_idle()` False; rank 1:
0, none, 0, True, although the copy had landed (the put-back itself waited on it). With two shared
loads in flight rank 0 held 3 acks (`has_free_load_back_slot()` False), rank 1 2 (True). Rank 0's
stale ack is only ever reaped against a later ack of the peer, so it stays one load behind for the
rest of the process; `idle_leak_report()` is empty on both (the held lock counts as protected).

Mechanism: every poll reaps load acks in lockstep, the count being the MIN over the attention
groups of each rank's ready acks (`_sync_hicache_ready_counts` in unified_radix_cache.py, used by
`check_hicache_events`; `loading_check` does the same when called alone). Rank 0 has 1 ready,
rank 1 has 0: nothing is reaped. The put-back released only admission's lock. So
`has_free_load_back_slot` ("Acks are reaped in lockstep, so every rank agrees on this"; PD decode
admits on it) differed between the ranks, and `is_fully_idle` was False on rank 0 only, so on_idle
let rank 1 alone release its agreed free space: its next prefill round would make the
pre-admission all-reduce and rank 0's would not (recorded here as the agreement's `current` after
an idle pass, not run).

The fix (the load wait's entry): a DIVERGED round's put-back, after waiting for the load it
started, finishes that load on this rank (`UnifiedRadixCache.finish_unshared_load`: its ack leaves
the lockstep queue, its node lock is released), on every rank that started one.

Expected: the tests FAIL without the fix (rank 0 keeps the ack and the lock) and PASS with it,
except `test_loads_started_alike_are_released_alike`, which pins what holds either way.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from test_prefill_unwind import PREFIX
from test_rank_agreement import RANK_SCENARIOS, MultiRoundScenario, _reads_the_ledger, run_two_ranks

NAME = "tp_diverged_round_loads_on_one_rank"
# Mamba, an elastic KV pool, HiCache; a load stays pending until the device completes it.
HICACHE: dict[str, Any] = RANK_SCENARIOS["tp_hicache_host"].config
# Rank 1's host prefix in place of PREFIX: the same sizes, so the same collectives.
OTHER = list(range(200, 232))
# Prefixes both ranks have on host: each is loaded alike on both, one round each.
SHARED = [list(range(300, 332)), list(range(400, 432))]

Ranks = dict[int, dict[str, Any]]


def _fully_idle(h: sh.Harness) -> bool:
    """The real `Scheduler.is_fully_idle()` (what on_idle gates the idle work on), with nothing
    in flight in the event loop the harness does not build."""
    with h.nothing_in_flight():
        return bool(h.scheduler.is_fully_idle())


def _idle_work(h: sh.Harness) -> None:
    """What on_idle does before its leak check (scheduler.py:5921-5941), only where the
    scheduler is fully idle: the agreed free space's release."""
    if _fully_idle(h):
        h.scheduler._release_agreed_free_space()


def _load_state(h: sh.Harness, names: dict[Any, str]) -> dict[str, Any]:
    """This rank's load-back bookkeeping: queued load acks, the nodes whose load holds a lock
    (by name), the tree's locked tokens, the free load-back slot and whether it is fully idle."""
    cache = h.tree_cache
    controller = cache.cache_controller
    assert controller is not None, "built without hicache"
    # Up to 0.5.21 the cache has no load-back slot check: reported as free.
    free_slot = getattr(cache, "has_free_load_back_slot", lambda: True)
    return {
        "acks": len(controller.ack_load_queue),
        "loading": [names.get(node_id, "?") for node_id in cache.ongoing_load_back],
        "protected": cache.protected_size(),
        "free_slot": free_slot(),
        "fully_idle": _fully_idle(h),
    }


def _name_new_loads(h: sh.Harness, names: dict[Any, str], name: str) -> None:
    for node_id in h.tree_cache.ongoing_load_back:
        names.setdefault(node_id, name)


def _h2d_loads(h: sh.Harness) -> int:
    engine = h.transfer_engine
    assert engine is not None, "built without hicache"
    return sum(1 for kind, _ in engine.submissions if kind == "h2d")


def _rids(batch: Any) -> list[str] | None:
    return None if batch is None else [r.rid for r in batch.reqs]


def _diverged_round_loads_on_one_rank(h: sh.Harness, rank: int) -> dict[str, Any]:
    sched = h.scheduler
    names: dict[Any, str] = {}
    h.put_prefix_on_host(PREFIX if rank == 0 else OTHER)
    req = h.add_request([*PREFIX, 7, 8, 9])
    batch = h.run_round()
    _name_new_loads(h, names, "PREFIX")
    out: dict[str, Any] = {
        "batch": _rids(batch),
        "divergences": sched.num_prefill_divergences,
        "unwinds": sh.num_prefill_unwinds(h),
        "loads": _h2d_loads(h),
        "queue": [r.rid for r in sched.waiting_queue],
        "after_round": _load_state(h, names),
    }
    # Its client aborts it while queued (it holds nothing after the put-back): the ranks'
    # trees differ, and the next round would diverge again on the prefix rank 0 loaded.
    sched.waiting_queue.remove(req)
    assert h.physical is not None
    h.physical.take(0)  # the co-tenants leave: sglang's idle check compares the pool with its total
    out["idle"] = []
    for _ in range(3):
        h.prepare_next_round()
        out["idle"].append(_load_state(h, names))
    _idle_work(h)
    out["idle_leaks"] = h.idle_leak_report()

    for prefix in SHARED:
        h.put_prefix_on_host(prefix)
    shared = []
    out["shared_rounds"] = []
    for i, prefix in enumerate(SHARED):
        shared.append(h.add_request([*prefix, 4, 5, 6]))
        batch = h.run_round()  # its load stays in flight: no poll before the next round
        _name_new_loads(h, names, f"SHARED{i}")
        out["shared_rounds"].append({"batch": _rids(batch), "state": _load_state(h, names)})
    out["loads_after_shared"] = _h2d_loads(h)
    for r in shared:
        h.finish_request(r)
    out["drained"] = []
    for _ in range(3):
        h.prepare_next_round()
        out["drained"].append(_load_state(h, names))
    _idle_work(h)
    out["agreement_current_after_idle"] = _reads_the_ledger(sched)
    out["final_leaks"] = h.idle_leak_report()
    return out


SCENARIOS: dict[str, MultiRoundScenario] = {NAME: _diverged_round_loads_on_one_rank}


@pytest.fixture(scope="module")
def ranks() -> Ranks:
    """Both ranks' records. `run_two_ranks` builds a multi-round scenario's harness with an
    elastic pool only; HiCache and Mamba are added to every harness it builds."""
    real = sh.build_harness

    def build_with_hicache(cfg: sh.HarnessConfig | None = None, **overrides: Any) -> sh.Harness:
        return real(cfg, **{**overrides, **HICACHE})

    with sh.build_harness(**HICACHE) as h:
        if hasattr(h.tree_cache, "_load_alike_on_every_rank"):
            pytest.skip(
                "from series entry 'HiCache: the ranks agree on each load-back's allocation from a"
                " rank-local pool' on, no load starts on one rank only: every load-back is agreed"
                " (test_load_back_agreement.py), and ranks whose host trees differ, as here, part"
                " at that agreement"
            )
    with mock.patch.object(sh, "build_harness", build_with_hicache):
        return run_two_ranks([NAME], SCENARIOS, {}).scenario(NAME)


def test_the_round_diverges_with_a_load_on_one_rank(ranks: Ranks) -> None:
    """The scenario: rank 0 alone started a load; the round was put back on both ranks as a
    divergence (not an unwind), admission's locks and rank 0's finished load released; the
    shared rounds ran alike."""
    for rank, r in ranks.items():
        assert r["batch"] is None, rank
        assert r["divergences"] == 1 and r["unwinds"] == 0, rank
        assert r["queue"] == ["r0"], rank
        assert [s["batch"] for s in r["shared_rounds"]] == [["r1"], ["r2"]], rank
    assert ranks[0]["loads"] == 1 and ranks[1]["loads"] == 0
    assert ranks[0]["loads_after_shared"] == 3 and ranks[1]["loads_after_shared"] == 2
    # Neither rank holds anything after the put-back (the request waits in the queue: not idle
    # yet); without the fix rank 0 kept its load's ack and PREFIX's lock (32 tokens).
    for rank, r in ranks.items():
        assert r["after_round"] == {
            "acks": 0,
            "loading": [],
            "protected": 0,
            "free_slot": True,
            "fully_idle": False,
        }, rank


def test_loads_started_alike_are_released_alike(ranks: Ranks) -> None:
    """What holds with or without the defect: the rank without the stale ack reaps both shared
    loads once they landed, and rank 0 no longer holds PREFIX's lock after its peer acked a load
    (its stale ack is reaped at the latest then). Neither rank's idle check reports a leak."""
    assert ranks[1]["drained"][-1] == {
        "acks": 0,
        "loading": [],
        "protected": 0,
        "free_slot": True,
        "fully_idle": True,
    }
    assert "PREFIX" not in ranks[0]["drained"][0]["loading"]
    for rank, r in ranks.items():
        assert r["idle_leaks"] == [] and r["final_leaks"] == [], rank


def test_the_put_back_load_is_released_by_the_next_poll(ranks: Ranks) -> None:
    """The load landed (the put-back waited for it) and was finished on rank 0: both ranks are
    idle alike at the next poll and after the shared loads. Without the fix rank 0 keeps 1 ack and
    PREFIX's lock (32 tokens) through every poll, and is never fully idle."""
    clean = {"acks": 0, "loading": [], "protected": 0, "free_slot": True, "fully_idle": True}
    for rank, r in ranks.items():
        assert r["idle"][0] == clean, rank
    for rank, r in ranks.items():
        assert r["drained"][-1] == clean, rank
    assert ranks[0]["agreement_current_after_idle"] == ranks[1]["agreement_current_after_idle"]


def test_the_ranks_agree_on_their_load_back_slots(ranks: Ranks) -> None:
    """Loads started alike leave the ranks with the same acks queued, so they agree on
    `has_free_load_back_slot`. Without the fix, with two shared loads in flight, rank 0 has 3 acks
    (no free slot) and rank 1 has 2 (a free slot)."""
    for i, (r0, r1) in enumerate(zip(ranks[0]["shared_rounds"], ranks[1]["shared_rounds"], strict=True)):
        assert r0["state"]["acks"] == r1["state"]["acks"], i
        assert r0["state"]["free_slot"] == r1["state"]["free_slot"], i
