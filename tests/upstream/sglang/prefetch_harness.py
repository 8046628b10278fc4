"""A real HiCache tree cache with its real storage threads, driven like the scheduler drives it.

The real sglang classes run here: ``HiCacheController`` with its storage threads (prefetch query,
prefetch IO, prefetch sync, backup), ``HiRadixCache`` (while the tree ships it) and the live
default ``UnifiedRadixCache`` with its ``HybridCacheController`` and ``HostPoolGroup``. Only the
hardware and I/O boundary is stood in for: the CUDA events/streams the controller creates, the
host KV pool (slot bookkeeping and page payloads only), and the storage backend, whose calls can
be held on ``threading.Event`` gates, slowed down, cut short or made to raise.

``two_ranks`` runs a scenario on two gloo ranks (forked processes, a file store, a bounded
wait), each rank with its own cache and controller, the way tensor-parallel ranks run them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import threading
import time
import types
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import forked_ranks
import pytest
import torch
import torch.distributed as dist
from sglang.srt.managers import cache_controller as cache_controller_module
from sglang.srt.mem_cache import l2_transfer as l2_transfer_module
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, PoolTransfer
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.unified_cache.components import ComponentType
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.mem_cache.utils import get_storage_hash_str
from sglang.srt.runtime_context import get_context, get_parallel

# HiRadixCache ships until 0.5.20 (deleted in 0.5.21): test it only where the tree has it.
HAS_HIRADIX = importlib.util.find_spec("sglang.srt.mem_cache.hiradix_cache") is not None
KINDS = ("hiradix", "unified") if HAS_HIRADIX else ("unified",)
POLICIES = ("wait_complete", "timeout", "best_effort")

PAGE_SIZE = 4
PREFETCH_THRESHOLD = 8
HOST_SLOTS = 256
# Two requests with disjoint prompts, 16 pages each (token ids are array("q"), as in a Req).
TOKENS = array("q", range(1000, 1064))
OTHER_TOKENS = array("q", range(2000, 2064))
POLL_S = 0.002
# Only reached when a test is failing: nothing in a passing run waits this long. A wait ends
# sooner, failed, once a storage thread has died, since nothing it owed will come.
DEADLINE_S = 10.0
# A two-rank scenario that has not reported by then hangs (it takes a few seconds).
RANK_TIMEOUT_S = 60.0
RANKS = 2

CACHE_CONTROLLER_LOGGER = "sglang.srt.managers.cache_controller"
HYBRID_CONTROLLER_LOGGER = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller"
STORAGE_THREADS = ("prefetch_thread", "prefetch_io_aux_thread", "prefetch_sync_thread", "backup_thread")


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
    # 0.5.22+ asks the host pool for a storage key tag; the MHA host pools have none.
    storage_format_tag = None

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

    def get_data_page(self, index: int, flat: bool = True) -> object:
        return self.pages.get(int(index))


class StorageFailure(ConnectionError):
    """What the fake storage raises when a test makes a call fail."""


class GatedStorage(HiCacheStorage):  # type: ignore[misc]  # sglang is untyped
    """Storage backend stand-in: every page exists, unless a test says otherwise.

    ``query_gate`` holds ``batch_exists`` (the existence query the prefetch thread runs before
    it publishes ``operation.hash_value``); ``io_gate`` holds ``batch_get`` (the page reads of
    the prefetch IO thread). Both gates start open. ``query_delay_s`` slows the query down and
    ``hit_pages`` caps how many pages it finds. ``fail`` counts, per call name, how many calls
    raise ``StorageFailure``, after the first ``fail_after`` calls of that name succeeded.
    """

    def __init__(self) -> None:
        self.query_gate = threading.Event()
        self.query_gate.set()
        self.io_gate = threading.Event()
        self.io_gate.set()
        self.query_entered = threading.Event()
        self.query_delay_s = 0.0
        self.hit_pages: int | None = None
        self.fail: dict[str, int] = {}
        self.fail_after: dict[str, int] = {}
        self.failed: dict[str, int] = {}
        self.written: list[str] = []
        self._lock = threading.Lock()

    def _maybe_fail(self, call: str) -> None:
        with self._lock:
            if self.fail_after.get(call, 0) > 0:
                self.fail_after[call] -= 1
            elif self.fail.get(call, 0) > 0:
                self.fail[call] -= 1
                self.failed[call] = self.failed.get(call, 0) + 1
                raise StorageFailure(f"storage backend unreachable in {call} (injected by the test)")

    def batch_exists(self, keys: list[str], extra_info: object = None) -> int:
        self.query_entered.set()
        self.query_gate.wait()
        if self.query_delay_s:
            time.sleep(self.query_delay_s)
        self._maybe_fail("batch_exists")
        return len(keys) if self.hit_pages is None else min(len(keys), self.hit_pages)

    def batch_get(
        self, keys: list[str], target_locations: object = None, target_sizes: object = None
    ) -> list[str]:
        self.io_gate.wait()
        self._maybe_fail("batch_get")
        # The payload of a page is its key: enough to tell pages apart in the host pool.
        return list(keys)

    def batch_get_v2(self, transfers: list[PoolTransfer], extra_info: object = None) -> dict[str, list[bool]]:
        self._maybe_fail("batch_get_v2")
        return {str(t.name.value): [True] * len(t.keys or []) for t in transfers}

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
        self._maybe_fail("batch_set")
        self.written.extend(keys)
        return True


# ---------------------------------------------------------------------------------------------
# Harness: one real cache with its real controller threads, driven like the scheduler drives it
# ---------------------------------------------------------------------------------------------


@dataclass
class Prefetch:
    handle: CacheRequestHandle
    operation: Any
    # When the scheduler first asked whether this prefetch is done (see Harness.round).
    first_poll: float | None = None

    def waited(self) -> float:
        """Seconds since the first scheduler poll of this prefetch."""
        assert self.first_poll is not None, "the prefetch was never polled"
        return time.monotonic() - self.first_poll


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

    def host_refs(self, node: Any) -> int:
        """Host references held on a tree node (HiRadixCache) or node id (UnifiedRadixCache)."""
        if self.kind == "hiradix":
            return int(node.host_ref_counter)
        return int(self.cache.tree_core.node_by_id(node).component_data[ComponentType.FULL].host_lock_ref)

    def prefetch(self, rid: str, tokens: array[int]) -> Prefetch:
        """What Scheduler._prefetch_kvcache does for a request with no L1/L2 hit."""
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        anchor = match.last_host_node
        if self.anchor is None:
            self.anchor, self.anchor_host_refs = anchor, self.host_refs(anchor)
        handle = CacheRequestHandle(rid, 0)
        self.cache.prefetch_from_storage(handle, anchor, tokens)
        entry = self.cache.ongoing_prefetch[rid if self.kind == "hiradix" else handle]
        operation = entry[2] if self.kind == "hiradix" else entry.operation
        return Prefetch(handle, operation)

    def is_ongoing(self, req: Prefetch) -> bool:
        """Whether the tree cache still tracks the prefetch (HiRadixCache keys it by rid)."""
        key = req.handle.rid if self.kind == "hiradix" else req.handle
        return key in self.cache.ongoing_prefetch

    def round(self, req: Prefetch) -> bool:
        """One scheduler iteration: drain the HiCache control queues, then ask whether the
        request may be staged (Scheduler._get_new_batch_prefill_raw). On True the scheduler
        takes the L3-loaded span; so do we."""
        self.cache.check_hicache_events()
        if req.first_poll is None:
            req.first_poll = time.monotonic()
        done = bool(self.cache.check_prefetch_progress(req.handle))
        if done and req.handle.rid not in self.loaded:
            self.loaded[req.handle.rid] = int(self.cache.pop_prefetch_loaded_tokens(req.handle))
        return done

    def drain(self) -> None:
        """The control-queue drain of a scheduler iteration that does not reach this request."""
        self.cache.check_hicache_events()

    def wait_for(self, condition: Callable[[], bool], what: str, drain: bool = True) -> None:
        """Poll ``condition``; between polls, drain the control queues unless told not to."""
        deadline = time.monotonic() + DEADLINE_S
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"{self.kind}: timed out waiting for {what}")
            dead = self.dead_threads()
            if drain:
                self.drain()
            if dead and not condition():
                pytest.fail(f"{self.kind}: storage threads died ({dead}) while waiting for {what}")
            time.sleep(POLL_S)

    def run_until_done(self, req: Prefetch) -> float:
        """Run scheduler rounds until the prefetch ends; returns how long it was waited for."""
        deadline = time.monotonic() + DEADLINE_S
        while True:
            # Read before the round: a thread that died after sending its last ACK has
            # had that ACK drained by this round.
            dead = self.dead_threads()
            if self.round(req):
                break
            if dead or time.monotonic() > deadline:
                pytest.fail(
                    f"{self.kind}: prefetch {req.handle.rid} did not finish "
                    f"(policy {self.cache.prefetch_stop_policy}; dead storage threads: {dead})"
                )
            time.sleep(POLL_S)
        return req.waited()

    def finish(self, req: Prefetch) -> None:
        """Let the prefetch end on its own, then stage the request.

        Under best_effort the first poll ends any prefetch, so a scheduler that wants the L3
        hit only polls once the prefetch has left the tracked set (its last ACK drained, or
        revoked); under the other policies it polls every round."""
        if self.cache.prefetch_stop_policy == "best_effort":
            self.wait_for(lambda: not self.is_ongoing(req), f"prefetch {req.handle.rid} to end")
            assert self.round(req)
        else:
            self.run_until_done(req)

    def settle_late_query(self) -> None:
        """Let a query the scheduler already gave up on return, and drain its result.

        The prefetch thread publishes every query it finishes, revoked or not, to the hit
        queue; once that entry is drained, nothing of the prefetch is left in flight. Only
        this harness drains that queue, so wait for the entry without draining, then drain."""
        self.store.query_gate.set()
        hits = self.controller.prefetch_hit_queue
        self.wait_for(lambda: hits.qsize() > 0, "the late query result", drain=False)
        self.drain()
        assert hits.qsize() == 0

    def dead_threads(self) -> list[str]:
        return [name for name in STORAGE_THREADS if not getattr(self.controller, name).is_alive()]

    def host_tokens_in_tree(self) -> int:
        return sum(
            int(self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens))).host_hit_length)
            for tokens in (TOKENS, OTHER_TOKENS)
        )

    def host_node(self, tokens: array[int]) -> Any:
        """The tree node (HiRadixCache) or node id (UnifiedRadixCache) holding ``tokens`` on host."""
        match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        assert int(match.host_hit_length) == len(tokens), f"{self.kind}: {tokens[0]}.. not on host"
        return match.last_host_node

    def assert_clean(self, expected_host_tokens: int) -> None:
        """Nothing leaked: every host slot in use belongs to the tree, no occupancy or host
        reference is left behind, and no prefetch is still tracked."""
        assert not self.cache.ongoing_prefetch, f"{self.kind}: prefetch still tracked"
        assert self.controller.prefetch_tokens_occupied == 0, (
            f"{self.kind}: leaked prefetch occupancy {self.controller.prefetch_tokens_occupied}"
        )
        assert self.anchor is not None
        assert self.host_refs(self.anchor) == self.anchor_host_refs, f"{self.kind}: leaked host ref"
        in_tree = self.host_tokens_in_tree()
        assert in_tree == expected_host_tokens, f"{self.kind}: {in_tree} host tokens in the tree"
        assert self.host_pool.used_slots() == in_tree, (
            f"{self.kind}: {self.host_pool.used_slots()} host slots taken, {in_tree} held by the tree"
        )
        if self.kind == "unified":
            self.cache.sanity_check()


@contextlib.contextmanager
def device_boundary() -> Iterator[list[GatedStorage]]:
    """Replace the CUDA events/streams, the host pool class and the storage backend factory.

    Yields the list the factory hands its backend from: append a GatedStorage before building a
    cache, and that cache's controller gets it."""
    stores: list[GatedStorage] = []
    hiradix: types.ModuleType | None = None
    if HAS_HIRADIX:
        from sglang.srt.mem_cache import hiradix_cache

        hiradix = hiradix_cache
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache_controller_module, "device_module", CPU_DEVICE_MODULE)
        mp.setattr(l2_transfer_module, "device_module", CPU_DEVICE_MODULE)
        if hiradix is not None:
            mp.setattr(hiradix, "get_mha_host_pool_cls", lambda kv_pool: FakeHostPool)
        mp.setattr(hybrid_pool_assembler, "get_mha_host_pool_cls", lambda kv_pool: FakeHostPool)
        mp.setattr(
            StorageBackendFactory,
            "create_backend",
            classmethod(lambda cls, *args, **kwargs: stores[-1]),
        )
        yield stores


@contextlib.contextmanager
def build_harness(
    stores: list[GatedStorage],
    kind: str,
    policy: str,
    *,
    tp_group: Any = None,
    tp_rank: int = 0,
    tp_size: int = 1,
    **timeout: float,
) -> Iterator[Harness]:
    """One cache of ``kind`` under the storage prefetch ``policy``, inside ``device_boundary``.

    On exit every gate opens and the storage threads are stopped (they must stop)."""
    extra = {"prefetch_threshold": PREFETCH_THRESHOLD, **timeout}
    with contextlib.ExitStack() as scope:
        server_args = scope.enter_context(
            get_context().override_server_args(
                enable_hierarchical_cache=True,
                # Any built-in name with the generic page get/set path: the factory that
                # would open it is replaced by the GatedStorage.
                hicache_storage_backend="file",
                hicache_storage_prefetch_policy=policy,
                hicache_storage_backend_extra_config=json.dumps(extra),
            )
        )
        scope.enter_context(
            get_parallel().override(
                tp_rank=tp_rank,
                tp_size=tp_size,
                attn_tp_rank=tp_rank,
                attn_tp_size=tp_size,
                attn_dp_size=1,
                attn_dp_rank=0,
                attn_cp_size=1,
                attn_cp_rank=0,
                moe_tp_size=tp_size,
                moe_tp_rank=tp_rank,
                moe_ep_size=1,
                moe_ep_rank=0,
                moe_dp_size=1,
                moe_dp_rank=0,
                pp_rank=0,
                pp_size=1,
                dcp_enabled=False,
                attn_dcp_rank=0,
            )
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
            tp_cache_group=tp_group,
        )
        if "tree_core_backend" in CacheInitParams.__dataclass_fields__:
            # 0.5.23 defaults to its Rust tree core, which cannot show a node's host references.
            params.tree_core_backend = "python"
        store = GatedStorage()
        stores.append(store)
        cache: Any
        if kind == "hiradix":
            from sglang.srt.mem_cache.hiradix_cache import HiRadixCache

            cache = HiRadixCache(params, server_args)
        else:
            params.tree_components = (ComponentType.FULL,)
            cache = UnifiedRadixCache(params)
            cache.init_hicache(server_args, params)
        assert cache.enable_storage and cache.prefetch_stop_policy == policy
        host_pool = cache.cache_controller.storage_host_pool
        assert isinstance(host_pool, FakeHostPool)
        harness = Harness(kind, cache, store, host_pool)
        try:
            yield harness
        finally:
            # Release anything a test left held, so the storage threads can stop.
            store.query_gate.set()
            store.io_gate.set()
            detached, message = cache.detach_storage_backend()
            assert detached, f"{kind}: storage threads did not stop: {message}"


def load_hash_extension() -> None:
    """The page hashes come from a JIT-built C++ extension: build/load it here, not inside a
    prefetch thread whose timing a test depends on (nor in each forked rank)."""
    get_storage_hash_str(TOKENS[:PAGE_SIZE], None, page_size=PAGE_SIZE)


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """A one-rank gloo world (HiRadixCache asks torch.distributed for its TP width), torn down
    after the test so that a two-rank test can fork without one."""
    created = not dist.is_initialized()
    if created:
        # torch.distributed imports HashStore without re-exporting it explicitly.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Two gloo ranks
# ---------------------------------------------------------------------------------------------

RankScenario = Callable[[int, Any], dict[str, Any]]


def two_ranks(scenario: RankScenario) -> dict[int, dict[str, Any]]:
    """Run ``scenario(rank, tp_group)`` on two gloo ranks; fail on an error or a hang."""
    load_hash_extension()
    results, errors = forked_ranks.run_forked_ranks(
        lambda rank: scenario(rank, dist.group.WORLD),
        ranks=RANKS,
        timeout_s=RANK_TIMEOUT_S,
        collective_timeout_s=RANK_TIMEOUT_S / 2,
    )
    if errors:
        pytest.fail("\n".join(errors))
    return results
