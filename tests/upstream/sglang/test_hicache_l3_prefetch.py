"""HiCache L3 prefetch and backup: the storage threads, their failures and the timeout budget.

Driven through the real 0.5.20 classes (see prefetch_harness.py): ``HiCacheController`` with its
real storage threads, ``HiRadixCache`` and the live default ``UnifiedRadixCache``. Only the
hardware and I/O boundary is stood in for; the storage backend's calls are held on gates,
slowed down, cut short or made to raise, so every scenario is a forced interleaving, not a race
left to chance: while the query gate is shut the prefetch thread is provably inside
``batch_exists`` and ``operation.hash_value`` is provably still empty.

The two-rank tests fork two gloo ranks, each with its own cache and controller, make the storage
fail on one rank only, and require the same outcome on both and no hang (bounded wait).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import prefetch_harness as ph
import pytest
import torch
from prefetch_harness import KINDS, OTHER_TOKENS, PAGE_SIZE, POLICIES, TOKENS, Harness
from sglang.srt.managers import cache_controller as cache_controller_module
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
from sglang.srt.mem_cache.utils import get_storage_hash_str

# How many scheduler rounds the wait_complete test runs while the query is held.
POLL_ROUNDS = 200
# Base of the timeout policy in the timeout tests, far below every budget they test: a prefetch
# judged on the base alone (0.5.20's budget while the query is in flight) ends far too early.
BASE_S = 0.1
# How late after its budget a timed-out prefetch may end: a few scheduler polls, with room for
# a loaded machine. Far below any budget here, so a budget twice too long cannot pass.
MARGIN_S = 0.25
# A timeout budget no test reaches: the prefetch must end by its own ACKs.
NO_TIMEOUT = {"prefetch_timeout_base": 60.0}

HarnessFactory = Callable[..., Harness]


@pytest.fixture
def make_harness() -> Iterator[HarnessFactory]:
    with contextlib.ExitStack() as scope:
        ph.load_hash_extension()
        scope.enter_context(ph.one_rank_world())
        stores = scope.enter_context(ph.device_boundary())

        def build(kind: str, policy: str, **timeout: float) -> Harness:
            # One rank (one_rank_world), named so that no timeout knob can stand for a rank.
            one_rank = ph.build_harness(stores, kind, policy, tp_rank=0, tp_size=1, **timeout)
            return scope.enter_context(one_rank)

        yield build


def _logged(caplog: pytest.LogCaptureFixture, logger: str, rid: str) -> bool:
    return any(r.name == logger and rid in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------
# #9397 (Applied-Upstream): wait_complete must not finish before the page list is known
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_wait_complete_waits_for_page_list(make_harness: HarnessFactory, kind: str) -> None:
    h = make_harness(kind, "wait_complete")
    h.store.query_gate.clear()
    req = h.prefetch("r-9397", TOKENS)
    assert h.store.query_entered.wait(ph.DEADLINE_S), "the prefetch thread never ran the query"

    for i in range(POLL_ROUNDS):
        assert not h.round(req), f"{kind}: wait_complete prefetch finished at round {i} with no page list"
    # The window #9397 is about: still no page list, no host memory, and still not done.
    assert req.operation.hash_value == []
    assert req.operation.host_indices is None

    h.store.query_gate.set()
    h.run_until_done(req)
    assert h.loaded["r-9397"] == len(TOKENS)
    assert len(h.host_pool.pages) == len(TOKENS) // PAGE_SIZE, "not every page was read into host memory"
    h.assert_clean(expected_host_tokens=len(TOKENS))


# >>> DELIBERATELY BROKEN: the completion check as it was before upstream #9397 <<<
# Installed only by test_pre_9397_check_finishes_early, on one cache instance, to show that
# the interleaving above bites: "completed" is judged against hash_value, which is empty until
# the prefetch thread's storage query returns, so "0 completed == 0 planned" reads as done.
def _pre_9397_can_terminate_prefetch(self: Any, operation: Any) -> bool:
    if self.prefetch_stop_policy == "best_effort":
        return True
    completed = bool(operation.completed_tokens == len(operation.hash_value) * self.page_size)
    if self.prefetch_stop_policy == "wait_complete":
        return completed
    return completed or bool(self._prefetch_timeout_check_linear_func(operation))


@pytest.mark.parametrize("kind", KINDS)
def test_pre_9397_check_finishes_early(make_harness: HarnessFactory, kind: str) -> None:
    h = make_harness(kind, "wait_complete")
    name = "can_terminate_prefetch" if kind == "hiradix" else "_can_terminate_prefetch"
    setattr(h.cache, name, types.MethodType(_pre_9397_can_terminate_prefetch, h.cache))
    h.store.query_gate.clear()
    req = h.prefetch("r-pre-9397", TOKENS)
    assert h.store.query_entered.wait(ph.DEADLINE_S), "the prefetch thread never ran the query"

    assert h.round(req), f"{kind}: the pre-#9397 check should end the prefetch before the page list is known"
    assert h.loaded["r-pre-9397"] == 0, "the request was staged without its L3 hit"

    h.settle_late_query()
    h.assert_clean(expected_host_tokens=0)


# ---------------------------------------------------------------------------------------------
# timeout policy: the budget of the requested span, from the first scheduler poll that waits
# ---------------------------------------------------------------------------------------------


def _timeout_config(kind: str, budget_s: float) -> dict[str, float]:
    """Timeout knobs whose linear budget for the whole of TOKENS (16 pages) is ``budget_s``."""
    per_ki_token = (budget_s - BASE_S) * 1024 / len(TOKENS)
    config = {"prefetch_timeout_base": BASE_S, "prefetch_timeout_per_ki_token": per_ki_token}
    if kind == "hiradix":
        config["prefetch_timeout_max"] = 60.0  # HiRadixCache's cap, out of the way
    return config


def _assert_ended_on_budget(kind: str, waited: float, budget_s: float) -> None:
    assert waited >= budget_s, f"{kind}: gave up after {waited:.3f}s, before the {budget_s}s budget"
    assert waited <= budget_s + MARGIN_S, (
        f"{kind}: gave up after {waited:.3f}s, later than the {budget_s}s budget plus {MARGIN_S}s"
    )


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_bounds_a_query_that_never_returns(make_harness: HarnessFactory, kind: str) -> None:
    # While the query is in flight nothing is known but the requested span, and its budget
    # (1.0 s, not the 0.1 s base) bounds the wait on both sides.
    budget_s = 1.0
    h = make_harness(kind, "timeout", **_timeout_config(kind, budget_s))
    h.store.query_gate.clear()
    req = h.prefetch("r-stuck", TOKENS)
    assert h.store.query_entered.wait(ph.DEADLINE_S), "the prefetch thread never ran the query"

    waited = h.run_until_done(req)
    assert req.operation.hash_value == [], "the query was meant to be still in flight"
    _assert_ended_on_budget(kind, waited, budget_s)
    assert h.loaded["r-stuck"] == 0
    h.settle_late_query()
    h.assert_clean(expected_host_tokens=0)


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_budget_covers_a_slow_partial_hit(make_harness: HarnessFactory, kind: str) -> None:
    # 16 pages requested, a 1.0 s budget; the query takes 0.5 s and finds 4 pages. The budget
    # is that of the requested span, not of the 4 pages found (0.325 s, already spent).
    budget_s, query_s, hit_pages = 1.0, 0.5, 4
    h = make_harness(kind, "timeout", **_timeout_config(kind, budget_s))
    h.store.query_delay_s, h.store.hit_pages = query_s, hit_pages
    req = h.prefetch("r-slow-partial", TOKENS)

    waited = h.run_until_done(req)
    assert h.loaded["r-slow-partial"] == hit_pages * PAGE_SIZE, (
        f"{kind}: a {query_s}s query with {hit_pages} hits inside a {budget_s}s budget lost its pages"
    )
    assert query_s <= waited < budget_s
    h.assert_clean(expected_host_tokens=hit_pages * PAGE_SIZE)


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_clock_starts_at_the_first_blocked_poll(make_harness: HarnessFactory, kind: str) -> None:
    # The scheduler is busy for longer than the budget before it first looks at the request:
    # the budget is for waiting on the prefetch, so it starts then, not at the enqueue.
    budget_s, busy_s = 0.5, 0.7
    h = make_harness(kind, "timeout", **_timeout_config(kind, budget_s))
    h.store.query_gate.clear()
    req = h.prefetch("r-busy", TOKENS)
    assert h.store.query_entered.wait(ph.DEADLINE_S), "the prefetch thread never ran the query"
    time.sleep(busy_s)

    assert not h.round(req), f"{kind}: the first poll, {busy_s}s after the enqueue, ended the prefetch"
    waited = h.run_until_done(req)
    _assert_ended_on_budget(kind, waited, budget_s)
    assert h.loaded["r-busy"] == 0
    h.settle_late_query()
    h.assert_clean(expected_host_tokens=0)


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_still_fires_when_the_transfer_overruns(make_harness: HarnessFactory, kind: str) -> None:
    # Once the query has returned, a transfer that overruns the budget is still cut off and
    # the request goes ahead without the unfinished pages.
    budget_s = 0.3
    h = make_harness(kind, "timeout", **_timeout_config(kind, budget_s))
    h.store.io_gate.clear()
    req = h.prefetch("r-slow-io", TOKENS)
    h.wait_for(lambda: req.operation.host_indices is not None, "host memory for the hit")
    assert len(req.operation.hash_value) == len(TOKENS) // PAGE_SIZE

    waited = h.run_until_done(req)
    _assert_ended_on_budget(kind, waited, budget_s)
    assert h.loaded["r-slow-io"] == 0

    # The cut-off transfer still owns its host slots until its final ACK is drained.
    h.store.io_gate.set()
    h.wait_for(lambda: h.host_pool.used_slots() == 0, "the cut-off transfer's host slots")
    h.assert_clean(expected_host_tokens=0)


# ---------------------------------------------------------------------------------------------
# A storage call that raises ends that operation, never a storage thread
# ---------------------------------------------------------------------------------------------


def _fail_then_recover(h: Harness, call: str, rid: str) -> None:
    """One prefetch whose storage ``call`` raises, then one that must load everything."""
    h.store.fail[call] = 1
    failed = h.prefetch(rid, TOKENS)
    h.finish(failed)
    assert h.store.failed.get(call) == 1, f"{call} was never reached"
    # A failed storage call is a miss for that request: it goes ahead without an L3 hit...
    assert h.loaded[rid] == 0
    # ...and every storage thread lives on, for the next request.
    assert h.dead_threads() == [], f"{h.kind}: storage threads died: {h.dead_threads()}"
    following = h.prefetch(f"{rid}-next", OTHER_TOKENS)
    h.finish(following)
    assert h.loaded[f"{rid}-next"] == len(OTHER_TOKENS)
    h.assert_clean(expected_host_tokens=len(OTHER_TOKENS))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
def test_prefetch_thread_survives_failing_exists_query(
    make_harness: HarnessFactory, kind: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    h = make_harness(kind, policy, **NO_TIMEOUT)
    caplog.set_level(logging.ERROR, logger=ph.CACHE_CONTROLLER_LOGGER)
    _fail_then_recover(h, "batch_exists", "r-query-fails")
    assert _logged(caplog, ph.CACHE_CONTROLLER_LOGGER, "r-query-fails"), "the failed query was not logged"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kind", KINDS)
def test_io_thread_survives_failing_page_read(
    make_harness: HarnessFactory, kind: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    # The query finds every page and host memory is taken for them; then the read raises. The
    # request still completes (its final ACK is sent), with 0 tokens, and gives every host slot
    # back.
    h = make_harness(kind, policy, **NO_TIMEOUT)
    caplog.set_level(logging.ERROR, logger=ph.CACHE_CONTROLLER_LOGGER)
    _fail_then_recover(h, "batch_get", "r-read-fails")
    assert _logged(caplog, ph.CACHE_CONTROLLER_LOGGER, "r-read-fails"), "the failed read was not logged"


# The sidecar read (batch_get_v2 of a non-KV pool such as Mamba or SWA) happens on the live
# HybridCacheController's IO thread after the KV pages. A FULL-only tree has no such pool, so the
# operation is made here the way the hit drain makes it (host memory taken, page list known)
# and handed to the real IO thread; its ACKs are read where the scheduler's drain reads them.


def _sidecar_operation(h: Harness, rid: str) -> Any:
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    hashes = get_storage_hash_str(TOKENS, None, page_size=PAGE_SIZE)
    sidecar = PoolTransfer(name=PoolName.MAMBA, host_indices=torch.arange(1), keys=hashes[-1:])
    operation = PrefetchOperation(CacheRequestHandle(rid, 0), TOKENS, pool_transfers=[sidecar])
    operation.hash_value = hashes
    operation.storage_hit_count = len(TOKENS)
    operation.host_indices = h.host_pool.alloc(len(TOKENS))
    return operation


def _run_sidecar_operation(h: Harness, rid: str) -> dict[str, Any]:
    """Hand one sidecar prefetch to the IO thread; collect its ACKs (bounded wait)."""
    operation = _sidecar_operation(h, rid)
    h.controller.prefetch_buffer.put(operation)
    acks = h.controller.ack_prefetch_queue
    pool_hits: list[dict[str, int]] = []
    completed_tokens, completed = 0, False
    deadline = time.monotonic() + ph.DEADLINE_S
    while not completed and time.monotonic() < deadline:
        try:
            ack = acks.get(timeout=0.1)
        except queue.Empty:
            if h.dead_threads():
                break  # every ACK the dead thread sent is drained: no more will come
            continue
        assert ack.operation is operation
        if ack.completed_tokens is not None:
            completed_tokens = ack.completed_tokens
        if ack.pool_hits is not None:
            pool_hits.append(dict(ack.pool_hits))
        completed = bool(ack.completed_req)
    h.host_pool.free(operation.host_indices)
    return {
        "completed_req": completed,
        "completed_tokens": completed_tokens,
        "mamba_hits": [hits.get(PoolName.MAMBA.value) for hits in pool_hits],
        "dead_threads": h.dead_threads(),
    }


def test_io_thread_survives_failing_sidecar_read(
    make_harness: HarnessFactory, caplog: pytest.LogCaptureFixture
) -> None:
    h = make_harness("unified", "wait_complete")
    caplog.set_level(logging.ERROR, logger=ph.HYBRID_CONTROLLER_LOGGER)
    h.store.fail["batch_get_v2"] = 1
    failed = _run_sidecar_operation(h, "r-sidecar-fails")
    assert h.store.failed.get("batch_get_v2") == 1
    # The KV pages arrived, the sidecar did not: its ACK reports 0 sidecar pages (the hybrid
    # all-or-nothing check then discards the prefetch), and the final ACK still goes out.
    assert failed == {
        "completed_req": True,
        "completed_tokens": len(TOKENS),
        "mamba_hits": [0],
        "dead_threads": [],
    }
    assert _logged(caplog, ph.HYBRID_CONTROLLER_LOGGER, "r-sidecar-fails"), "the failed read was not logged"
    following = _run_sidecar_operation(h, "r-sidecar-next")
    assert following["mamba_hits"] == [1] and following["completed_req"]


def _backup(h: Harness, node: Any, what: str) -> None:
    """Back ``node`` up to storage, the way a finished write-through does, and drain its ACK."""
    h.cache.write_backup_storage(node)
    assert h.cache.ongoing_backup
    h.wait_for(lambda: not h.cache.ongoing_backup, what)


@pytest.mark.parametrize("kind", KINDS)
def test_backup_thread_survives_failing_write(
    make_harness: HarnessFactory, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    h = make_harness(kind, "wait_complete")
    caplog.set_level(logging.ERROR, logger=ph.CACHE_CONTROLLER_LOGGER)
    seed = h.prefetch("r-seed", TOKENS)
    h.finish(seed)
    node = h.host_node(TOKENS)
    refs = h.host_refs(node)

    h.store.fail["batch_set"] = 1
    _backup(h, node, "the ACK of the failed backup")
    assert h.store.failed.get("batch_set") == 1 and h.store.written == []
    # The failed backup is ACKed like any other: its node's host reference is given back...
    assert h.host_refs(node) == refs, f"{kind}: the failed backup kept its host reference"
    # ...and the backup thread (and every other storage thread) lives on.
    assert h.dead_threads() == [], f"{kind}: storage threads died: {h.dead_threads()}"
    assert any(r.name == ph.CACHE_CONTROLLER_LOGGER for r in caplog.records), (
        "the failed write was not logged"
    )

    _backup(h, node, "the ACK of the next backup")
    assert h.store.written == get_storage_hash_str(TOKENS, None, page_size=PAGE_SIZE)
    assert h.host_refs(node) == refs
    h.assert_clean(expected_host_tokens=len(TOKENS))


# ---------------------------------------------------------------------------------------------
# Two gloo ranks, a storage failure on one of them: same outcome on both, no hang
# ---------------------------------------------------------------------------------------------

FAILING_RANK = 0


@contextlib.contextmanager
def _rank_harness(rank: int, group: Any, policy: str = "wait_complete") -> Iterator[Harness]:
    with (
        ph.device_boundary() as stores,
        ph.build_harness(
            stores, "unified", policy, tp_group=group, tp_rank=rank, tp_size=ph.RANKS, **NO_TIMEOUT
        ) as h,
    ):
        yield h


def _rank_fail_then_recover(call: str, batch_pages: int | None = None) -> ph.RankScenario:
    """A prefetch whose storage ``call`` raises on one rank only, then one that must load.

    With ``batch_pages`` the storage is read in batches of that many pages and the second batch
    of the failing rank raises: every rank must still reduce the same ACKs, one per batch."""

    def scenario(rank: int, group: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        with pytest.MonkeyPatch.context() as mp:
            if batch_pages is not None:
                mp.setattr(cache_controller_module, "STORAGE_BATCH_SIZE", batch_pages)
            for policy in POLICIES:
                with _rank_harness(rank, group, policy) as h:
                    if rank == FAILING_RANK:
                        h.store.fail[call] = 1
                        h.store.fail_after[call] = 0 if batch_pages is None else 1
                    failed = h.prefetch("r-fails", TOKENS)
                    h.finish(failed)
                    following = h.prefetch("r-next", OTHER_TOKENS)
                    h.finish(following)
                    out[policy] = {
                        "failed": h.store.failed.get(call, 0),
                        "loaded": dict(h.loaded),
                        "dead_threads": h.dead_threads(),
                        "host_slots": h.host_pool.used_slots(),
                        "host_tokens_in_tree": h.host_tokens_in_tree(),
                    }
        return out

    return scenario


def _assert_same_outcome_after_one_rank_failed(
    ranks: dict[int, dict[str, Any]], kept_tokens: int = 0
) -> None:
    for policy in POLICIES:
        outcome = {rank: dict(r[policy]) for rank, r in ranks.items()}
        assert [outcome[rank].pop("failed") for rank in (0, 1)] == [1, 0], policy
        # The rank whose storage worked takes the failed rank's miss: a prefix only one rank
        # holds is no prefix.
        assert outcome[0] == outcome[1], f"{policy}: the ranks disagree: {outcome}"
        in_tree = kept_tokens + len(OTHER_TOKENS)
        assert outcome[0] == {
            "loaded": {"r-fails": kept_tokens, "r-next": len(OTHER_TOKENS)},
            "dead_threads": [],
            "host_slots": in_tree,
            "host_tokens_in_tree": in_tree,
        }, policy


def test_two_ranks_failing_exists_query_on_one_rank() -> None:
    _assert_same_outcome_after_one_rank_failed(ph.two_ranks(_rank_fail_then_recover("batch_exists")))


def test_two_ranks_failing_page_read_on_one_rank() -> None:
    # 16 pages read in batches of 4; the failing rank's second batch raises. Both ranks keep the
    # first batch (4 pages) and nothing else.
    ranks = ph.two_ranks(_rank_fail_then_recover("batch_get", batch_pages=4))
    _assert_same_outcome_after_one_rank_failed(ranks, kept_tokens=4 * PAGE_SIZE)


def _rank_sidecar(rank: int, group: Any) -> dict[str, Any]:
    with _rank_harness(rank, group) as h:
        if rank == FAILING_RANK:
            h.store.fail["batch_get_v2"] = 1
        return {
            "failed": _run_sidecar_operation(h, "r-sidecar-fails"),
            "next": _run_sidecar_operation(h, "r-sidecar-next"),
        }


def test_two_ranks_failing_sidecar_read_on_one_rank() -> None:
    ranks = ph.two_ranks(_rank_sidecar)
    assert ranks[0] == ranks[1], f"the ranks disagree: {ranks}"
    assert ranks[0]["failed"] == {
        "completed_req": True,
        "completed_tokens": len(TOKENS),
        "mamba_hits": [0],
        "dead_threads": [],
    }
    assert ranks[0]["next"]["mamba_hits"] == [1]


def _rank_backup(rank: int, group: Any) -> dict[str, Any]:
    with _rank_harness(rank, group) as h:
        seed = h.prefetch("r-seed", TOKENS)
        h.finish(seed)
        node = h.host_node(TOKENS)
        refs = h.host_refs(node)
        if rank == FAILING_RANK:
            h.store.fail["batch_set"] = 1
        _backup(h, node, "the ACK of the failed backup")
        after_failed = h.host_refs(node) - refs
        _backup(h, node, "the ACK of the next backup")
        return {
            "failed": h.store.failed.get("batch_set", 0),
            "host_refs_after_failed": after_failed,
            "host_refs_after_next": h.host_refs(node) - refs,
            "written": len(h.store.written),
            "dead_threads": h.dead_threads(),
        }


def test_two_ranks_failing_backup_write_on_one_rank() -> None:
    ranks = ph.two_ranks(_rank_backup)
    pages = len(TOKENS) // PAGE_SIZE
    assert ranks[FAILING_RANK] == {
        "failed": 1,
        "host_refs_after_failed": 0,
        "host_refs_after_next": 0,
        "written": pages,
        "dead_threads": [],
    }
    assert ranks[1 - FAILING_RANK] == {**ranks[FAILING_RANK], "failed": 0, "written": 2 * pages}


# ---------------------------------------------------------------------------------------------
# The harness: a wait gives up at once when a storage thread is dead
# ---------------------------------------------------------------------------------------------


def _a_dead_thread() -> threading.Thread:
    thread = threading.Thread(target=lambda: None, name="dead")
    thread.start()
    thread.join()
    return thread


@pytest.mark.parametrize("kind", KINDS)
def test_waits_fail_at_once_on_a_dead_storage_thread(make_harness: HarnessFactory, kind: str) -> None:
    # No failure injected here leaves a thread dead on a fixed tree, so one is stood in for:
    # the prefetch below never finishes (its query is held), and each wait must say why
    # before its deadline.
    h = make_harness(kind, "wait_complete")
    h.store.query_gate.clear()
    req = h.prefetch("r-held", TOKENS)
    assert h.store.query_entered.wait(ph.DEADLINE_S), "the prefetch thread never ran the query"
    backup_thread = h.controller.backup_thread
    try:
        h.controller.backup_thread = _a_dead_thread()
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match=r"dead storage threads: \['backup_thread'\]"):
            h.run_until_done(req)
        with pytest.raises(pytest.fail.Exception, match=r"storage threads died \(\['backup_thread'\]\)"):
            h.wait_for(lambda: False, "nothing")
        assert time.monotonic() - started < ph.DEADLINE_S, "a wait ran out its deadline"
    finally:
        h.controller.backup_thread = backup_thread
    h.settle_late_query()
