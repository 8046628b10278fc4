"""HiCache L3 prefetch: never judge a prefetch against a page list that is not known yet.

The real 0.5.20 classes are driven here: ``HiCacheController`` with its real storage threads
(prefetch query, prefetch IO, prefetch sync), ``HiRadixCache`` and the live default
``UnifiedRadixCache`` (with its real ``HybridCacheController`` and ``HostPoolGroup``). Only the
hardware and I/O boundary is stood in for: the CUDA events/streams the controller creates, the
host KV pool (slot bookkeeping only), and the storage backend, whose existence query and page
reads can be held on ``threading.Event`` gates or made to fail.

Every scenario is an interleaving forced with those gates, not a race left to chance: while the
query gate is shut the prefetch thread is provably inside ``batch_exists`` and
``operation.hash_value`` is provably still empty.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
from sglang.srt.managers import cache_controller as cache_controller_module
from sglang.srt.mem_cache import hiradix_cache as hiradix_cache_module
from sglang.srt.mem_cache import l2_transfer as l2_transfer_module
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_context, get_parallel

KINDS = ("hiradix", "unified")
PAGE_SIZE = 4
PREFETCH_THRESHOLD = 8
HOST_SLOTS = 256
# Two requests with disjoint prompts, 16 pages each.
TOKENS = list(range(1000, 1064))
OTHER_TOKENS = list(range(2000, 2064))
# How many scheduler rounds the wait_complete test runs while the query is held.
POLL_ROUNDS = 200
POLL_S = 0.002
# Only reached when a test is failing: nothing in a passing run waits this long.
DEADLINE_S = 10.0
# Base of the timeout policy in the timeout tests: every sleep here is far shorter.
BASE_S = 0.1

CACHE_CONTROLLER_LOGGER = "sglang.srt.managers.cache_controller"


# ---------------------------------------------------------------------------------------------
# Stand-ins at the hardware and I/O boundary
# ---------------------------------------------------------------------------------------------


class CpuEvent:
    """torch.cuda.Event stand-in. No device work exists on CPU, so every event is complete."""

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing

    def record(self, stream: object | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class CpuStream:
    """torch.cuda.Stream stand-in: the controller only creates its streams on this path."""


CPU_DEVICE_MODULE = types.SimpleNamespace(Event=CpuEvent, Stream=CpuStream)


class FakeHostPool:
    """Host KV pool stand-in: slot bookkeeping and the page payloads the storage reads wrote.

    It takes the constructor arguments of the real MHA host pool classes, so it is handed to the
    real builders (``get_mha_host_pool_cls``) in place of them.
    """

    layout = "page_first"
    device = "cpu"
    can_use_write_back_jit = False
    size_per_token = 1
    dtype = torch.float16

    def __init__(
        self,
        device_pool: object,
        host_to_device_ratio: float,
        host_size: float,
        page_size: int,
        layout: str,
        **kwargs: object,
    ) -> None:
        self.page_size = page_size
        self.size = HOST_SLOTS
        self.logical_size = HOST_SLOTS
        self.pages: dict[int, object] = {}
        self._free = list(range(HOST_SLOTS))

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self._free):
            return None
        taken, self._free = self._free[:need_size], self._free[need_size:]
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, indices: torch.Tensor) -> int:
        slots = indices.tolist()
        # A double free would hide a leak elsewhere: fail loudly instead.
        assert not set(slots) & set(self._free), f"host slots freed twice: {slots}"
        self._free.extend(slots)
        return len(slots)

    def available_size(self) -> int:
        return len(self._free)

    def used_slots(self) -> int:
        return HOST_SLOTS - len(self._free)

    def clear(self) -> None:
        self._free = list(range(HOST_SLOTS))
        self.pages.clear()

    def get_dummy_flat_data_page(self) -> None:
        return None

    def set_from_flat_data_page(self, index: int, data_page: object) -> None:
        self.pages[int(index)] = data_page


class GatedStorage(HiCacheStorage):
    """Storage backend stand-in: every page exists; queries and reads can be held or fail.

    ``query_gate`` holds ``batch_exists`` (the existence query the prefetch thread runs before
    it publishes ``operation.hash_value``); ``io_gate`` holds ``batch_get`` (the page reads of the
    prefetch IO thread). Both gates start open.
    """

    def __init__(self) -> None:
        self.query_gate = threading.Event()
        self.query_gate.set()
        self.io_gate = threading.Event()
        self.io_gate.set()
        self.query_entered = threading.Event()
        self.queries_to_fail = 0

    def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
        self.query_entered.set()
        self.query_gate.wait()
        if self.queries_to_fail > 0:
            self.queries_to_fail -= 1
            raise ConnectionError("storage backend unreachable (injected by the test)")
        return len(keys)

    def batch_get(
        self, keys: list[str], target_locations: object = None, target_sizes: object = None
    ) -> list[str]:
        self.io_gate.wait()
        # The payload of a page is its key: enough to tell pages apart in the host pool.
        return list(keys)

    def exists(self, key: str) -> bool:
        return True

    def get(self, key: str, target_location: object = None, target_sizes: object = None) -> str:
        return key

    def set(
        self, key: str, value: object = None, target_location: object = None, target_sizes: object = None
    ) -> bool:
        return True

    def batch_set(
        self,
        keys: list[str],
        values: object = None,
        target_locations: object = None,
        target_sizes: object = None,
    ) -> bool:
        return True


# ---------------------------------------------------------------------------------------------
# Harness: one real cache with its real controller threads, driven like the scheduler drives it
# ---------------------------------------------------------------------------------------------


@dataclass
class Prefetch:
    handle: CacheRequestHandle
    operation: Any

    def elapsed(self) -> float:
        return time.monotonic() - float(self.operation.start_time)


@dataclass
class Harness:
    kind: str
    cache: Any
    store: GatedStorage
    host_pool: FakeHostPool
    anchor: Any = None
    anchor_host_refs: int = 0
    loaded: dict[str, int] = field(default_factory=dict)

    @property
    def controller(self) -> Any:
        return self.cache.cache_controller

    def _host_refs(self, anchor: Any) -> int:
        if self.kind == "hiradix":
            return int(anchor.host_ref_counter)
        node = self.cache.tree_core.node_by_id(anchor)
        return int(node.component_data[ComponentType.FULL].host_lock_ref)

    def prefetch(self, rid: str, tokens: list[int]) -> Prefetch:
        """What Scheduler._prefetch_kvcache does for a request with no L1/L2 hit."""
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        anchor = match.last_host_node
        if self.anchor is None:
            self.anchor, self.anchor_host_refs = anchor, self._host_refs(anchor)
        handle = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(handle, anchor, tokens)
        entry = self.cache.ongoing_prefetch[rid if self.kind == "hiradix" else handle]
        operation = entry[2] if self.kind == "hiradix" else entry.operation
        return Prefetch(handle, operation)

    def round(self, req: Prefetch) -> bool:
        """One scheduler iteration: drain the HiCache control queues, then ask whether the
        request may be staged (Scheduler._get_new_batch_prefill_raw). On True the scheduler
        takes the L3-loaded span; so do we."""
        self.cache.check_hicache_events()
        done = bool(self.cache.check_prefetch_progress(req.handle))
        if done and req.handle.rid not in self.loaded:
            self.loaded[req.handle.rid] = int(self.cache.pop_prefetch_loaded_tokens(req.handle))
        return done

    def wait_for(self, condition: Callable[[], bool], what: str, drain: bool = True) -> None:
        """Poll ``condition``; between polls, drain the control queues unless told not to."""
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"{self.kind}: timed out waiting for {what}")
            if drain:
                self.cache.check_hicache_events()
            time.sleep(POLL_S)

    def run_until_done(self, req: Prefetch) -> float:
        """Run scheduler rounds until the prefetch ends; returns its age at that moment."""
        deadline = time.monotonic() + DEADLINE_S
        while not self.round(req):
            if not self.controller.prefetch_thread.is_alive():
                # Nothing will ever answer this prefetch: one last round picks up anything
                # the thread published before it died.
                if self.round(req):
                    break
                pytest.fail(
                    f"{self.kind}: prefetch {req.handle.rid} never completes: the prefetch "
                    f"thread is dead (policy {self.cache.prefetch_stop_policy})"
                )
            if time.monotonic() > deadline:
                pytest.fail(f"{self.kind}: prefetch {req.handle.rid} did not finish")
            time.sleep(POLL_S)
        return req.elapsed()

    def settle_late_query(self) -> None:
        """Let a query the scheduler already gave up on return, and drain its result.

        The prefetch thread publishes every query it finishes, revoked or not, to the hit
        queue; once that entry is drained, nothing of the prefetch is left in flight. Only
        this harness drains that queue, so wait for the entry without draining, then drain."""
        self.store.query_gate.set()
        queue = self.controller.prefetch_hit_queue
        self.wait_for(lambda: queue.qsize() > 0, "the late query result", drain=False)
        self.cache.check_hicache_events()
        assert queue.qsize() == 0

    def host_tokens_in_tree(self) -> int:
        return sum(
            int(self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).host_hit_length)
            for tokens in (TOKENS, OTHER_TOKENS)
        )

    def assert_clean(self, expected_host_tokens: int) -> None:
        """Nothing leaked: every host slot in use belongs to the tree, no occupancy or host
        reference is left behind, and no prefetch is still tracked."""
        assert not self.cache.ongoing_prefetch, f"{self.kind}: prefetch still tracked"
        assert self.controller.prefetch_tokens_occupied == 0, (
            f"{self.kind}: leaked prefetch occupancy {self.controller.prefetch_tokens_occupied}"
        )
        assert self.anchor is not None
        assert self._host_refs(self.anchor) == self.anchor_host_refs, f"{self.kind}: leaked host ref"
        in_tree = self.host_tokens_in_tree()
        assert in_tree == expected_host_tokens, f"{self.kind}: {in_tree} host tokens in the tree"
        assert self.host_pool.used_slots() == in_tree, (
            f"{self.kind}: {self.host_pool.used_slots()} host slots taken, {in_tree} held by the tree"
        )
        if self.kind == "unified":
            self.cache.sanity_check()


@pytest.fixture(scope="module")
def gloo_world() -> Iterator[None]:
    """HiRadixCache asks torch.distributed for its TP width: a one-rank gloo world answers."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # The page hashes come from a JIT-built C++ extension: build/load it here, not inside a
    # prefetch thread whose timing a test depends on.
    get_storage_hash_str(TOKENS[:PAGE_SIZE], None, page_size=PAGE_SIZE)
    yield
    if created:
        dist.destroy_process_group()


HarnessFactory = Callable[..., Harness]


@pytest.fixture
def make_harness(gloo_world: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[HarnessFactory]:
    monkeypatch.setattr(cache_controller_module, "device_module", CPU_DEVICE_MODULE)
    monkeypatch.setattr(l2_transfer_module, "device_module", CPU_DEVICE_MODULE)
    monkeypatch.setattr(hiradix_cache_module, "get_mha_host_pool_cls", lambda kv_pool: FakeHostPool)
    monkeypatch.setattr(hybrid_pool_assembler, "get_mha_host_pool_cls", lambda kv_pool: FakeHostPool)
    stores: list[GatedStorage] = []
    monkeypatch.setattr(
        StorageBackendFactory,
        "create_backend",
        classmethod(lambda cls, *args, **kwargs: stores[-1]),
    )
    scope = contextlib.ExitStack()
    harnesses: list[Harness] = []

    def build(kind: str, policy: str, **timeout: float) -> Harness:
        extra = {"prefetch_threshold": PREFETCH_THRESHOLD, **timeout}
        server_args = scope.enter_context(
            get_context().override_server_args(
                enable_hierarchical_cache=True,
                # Any built-in name with the generic page get/set path: the factory that
                # would open it is replaced by the GatedStorage above.
                hicache_storage_backend="file",
                hicache_storage_prefetch_policy=policy,
                hicache_storage_backend_extra_config=json.dumps(extra),
            )
        )
        scope.enter_context(
            get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, dcp_enabled=False)
        )
        kv_pool = MHATokenToKVPool(
            size=256,
            page_size=PAGE_SIZE,
            dtype=torch.float16,
            head_num=1,
            head_dim=8,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
            enable_alt_stream=False,
        )
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=ReqToTokenPool(8, 512, "cpu", False),
            token_to_kv_pool_allocator=PagedTokenToKVPoolAllocator(
                256, PAGE_SIZE, torch.float16, "cpu", kv_pool, need_sort=False
            ),
            page_size=PAGE_SIZE,
        )
        stores.append(GatedStorage())
        cache: Any
        if kind == "hiradix":
            cache = hiradix_cache_module.HiRadixCache(params, server_args)
        else:
            params.tree_components = (ComponentType.FULL,)
            cache = UnifiedRadixCache(params)
            cache.init_hicache(server_args, params)
        assert cache.enable_storage and cache.prefetch_stop_policy == policy
        host_pool = cache.cache_controller.storage_host_pool
        assert isinstance(host_pool, FakeHostPool)
        harness = Harness(kind, cache, stores[-1], host_pool)
        harnesses.append(harness)
        return harness

    yield build

    for harness in harnesses:
        # Release anything a test left held, so the storage threads can stop.
        harness.store.query_gate.set()
        harness.store.io_gate.set()
        detached, message = harness.cache.detach_storage_backend()
        assert detached, f"{harness.kind}: storage threads did not stop: {message}"
    scope.close()


# ---------------------------------------------------------------------------------------------
# #9397 (Applied-Upstream): wait_complete must not finish before the page list is known
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_wait_complete_waits_for_page_list(make_harness: HarnessFactory, kind: str) -> None:
    h = make_harness(kind, "wait_complete")
    h.store.query_gate.clear()
    req = h.prefetch("r-9397", TOKENS)
    assert h.store.query_entered.wait(DEADLINE_S), "the prefetch thread never ran the query"

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
    assert h.store.query_entered.wait(DEADLINE_S), "the prefetch thread never ran the query"

    assert h.round(req), f"{kind}: the pre-#9397 check should end the prefetch before the page list is known"
    assert h.loaded["r-pre-9397"] == 0, "the request was staged without its L3 hit"

    h.settle_late_query()
    h.assert_clean(expected_host_tokens=0)


# ---------------------------------------------------------------------------------------------
# timeout policy: budget of the requested span while the storage query is in flight
# ---------------------------------------------------------------------------------------------


def _timeout_config(kind: str, budget_s: float, cap_s: float = 60.0) -> dict[str, float]:
    """Timeout knobs whose linear budget for the whole of TOKENS is ``budget_s``."""
    per_ki_token = (budget_s - BASE_S) * 1024 / len(TOKENS)
    config = {"prefetch_timeout_base": BASE_S, "prefetch_timeout_per_ki_token": per_ki_token}
    if kind == "hiradix":
        config["prefetch_timeout_max"] = cap_s
    return config


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_budget_covers_requested_span_while_query_in_flight(
    make_harness: HarnessFactory, kind: str
) -> None:
    # The requested span earns 60 s; an empty page list earns only the 0.1 s base.
    h = make_harness(kind, "timeout", **_timeout_config(kind, budget_s=60.0))
    h.store.query_gate.clear()
    req = h.prefetch("r-timeout", TOKENS)
    assert h.store.query_entered.wait(DEADLINE_S), "the prefetch thread never ran the query"

    while req.elapsed() <= 3 * BASE_S:
        assert not h.round(req), (
            f"{kind}: prefetch revoked after {req.elapsed():.3f}s while its storage query was in "
            "flight: it was judged against an empty page list (base timeout only)"
        )
        time.sleep(POLL_S)

    h.store.query_gate.set()
    h.run_until_done(req)
    assert h.loaded["r-timeout"] == len(TOKENS)
    h.assert_clean(expected_host_tokens=len(TOKENS))


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_bounds_a_query_that_never_returns(make_harness: HarnessFactory, kind: str) -> None:
    # A stuck query is still given up on, at the requested span's budget: 1.0 s here (for
    # HiRadixCache through prefetch_timeout_max, which still caps it), not at the 0.1 s base.
    budget_s = 1.0
    config = _timeout_config(kind, budget_s) if kind == "unified" else _timeout_config(kind, 60.0, budget_s)
    h = make_harness(kind, "timeout", **config)
    h.store.query_gate.clear()
    req = h.prefetch("r-stuck", TOKENS)
    assert h.store.query_entered.wait(DEADLINE_S), "the prefetch thread never ran the query"

    age = h.run_until_done(req)
    assert req.operation.hash_value == [], "the query was meant to be still in flight"
    assert age > budget_s, f"{kind}: gave up after {age:.3f}s, before the requested span's budget"
    assert h.loaded["r-stuck"] == 0
    h.settle_late_query()
    h.assert_clean(expected_host_tokens=0)


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_still_fires_when_the_transfer_overruns(make_harness: HarnessFactory, kind: str) -> None:
    # Once the query has returned, the budget is that of the page list, as before: a transfer
    # that overruns it is cut off and the request goes ahead without the unfinished pages.
    budget_s = 0.3
    h = make_harness(kind, "timeout", **_timeout_config(kind, budget_s))
    h.store.io_gate.clear()
    req = h.prefetch("r-slow-io", TOKENS)
    h.wait_for(lambda: req.operation.host_indices is not None, "host memory for the hit")
    assert len(req.operation.hash_value) == len(TOKENS) // PAGE_SIZE

    age = h.run_until_done(req)
    assert age > budget_s
    assert h.loaded["r-slow-io"] == 0

    # The cut-off transfer still owns its host slots until its final ACK is drained.
    h.store.io_gate.set()
    h.wait_for(lambda: h.host_pool.used_slots() == 0, "the cut-off transfer's host slots")
    h.assert_clean(expected_host_tokens=0)


# ---------------------------------------------------------------------------------------------
# The prefetch thread survives a failing existence query
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_prefetch_thread_survives_failing_exists_query(
    make_harness: HarnessFactory, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    h = make_harness(kind, "wait_complete")
    h.store.queries_to_fail = 1
    caplog.set_level(logging.ERROR, logger=CACHE_CONTROLLER_LOGGER)

    failed = h.prefetch("r-query-fails", TOKENS)
    h.run_until_done(failed)
    # A failed query is a miss for that request: it goes ahead without an L3 hit.
    assert h.loaded["r-query-fails"] == 0
    assert h.controller.prefetch_thread.is_alive()
    assert any(
        record.name == CACHE_CONTROLLER_LOGGER and "r-query-fails" in record.getMessage()
        for record in caplog.records
    ), "the failed storage query was not logged"

    following = h.prefetch("r-next", OTHER_TOKENS)
    h.run_until_done(following)
    assert h.loaded["r-next"] == len(OTHER_TOKENS)
    h.assert_clean(expected_host_tokens=len(OTHER_TOKENS))
