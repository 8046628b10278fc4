"""A kvcached pool says how much it can hand out that no co-tenant can take (series entry "Count
the free space no co-tenant can take, for SGLang's decode vote", sgl-project/sglang#34676).

The carried SGLang scheduler makes its TP ranks vote on every decode step's allocation, because a
co-tenant can map the GPU memory a step needs on one rank. A step that fits in the free blocks of
pages the pool already holds mapped cannot miss: kvcached maps a page (`alloc_page`, the only call
that can fail on a co-tenant) only when those run out. `guaranteed_available_size()` counts them,
and from its first call keeps an emptied page mapped until the next call, so between two calls the
count falls only by the pool's own allocations: the ranks agree on it once and skip the votes of
the steps it covers.

These tests drive the REAL `KVCacheManager` (built as kvcached's own tests build it, without its
constructor's CUDA set-up) over a fake of its C++ extension (`kvcached.vmm_ops`: the GPU's pages,
which a co-tenant maps away), and the REAL elastic SGLang allocators over a fake manager.

Expected: FAIL without the entry (no such reading), PASS with it.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import sglang.srt.mem_cache.allocator as alloc_pkg
import torch
from test_rank_local_capacity import PAGE, TOKENS, _mha_pool, elastic

__all__ = ["elastic"]  # the fixture, shared with test_rank_local_capacity.py

BLOCKS_PER_PAGE = 4
GPU_PAGES = 6


class FakeInternalPage:
    """kvcached's C++ InternalPage: one mapped page's blocks, each free or in use."""

    def __init__(self, page_id: int) -> None:
        self.page_id = page_id
        self._free: list[int] = []

    @staticmethod
    def get_num_blocks(page_size: int, block_mem_size: int) -> int:
        return BLOCKS_PER_PAGE

    def init(self, block_mem_size: int) -> None:
        first = self.page_id * BLOCKS_PER_PAGE
        self._free = list(range(first, first + BLOCKS_PER_PAGE))

    def num_free_blocks(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int]:
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free_batch(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def empty(self) -> bool:
        return len(self._free) == BLOCKS_PER_PAGE

    def full(self) -> bool:
        return not self._free


class FakePageAllocator:
    """kvcached's C++ PageAllocator: this pool's virtual pages, and the GPU memory to map them,
    which co-tenants share (`cotenant_pages` is what they hold)."""

    def __init__(self) -> None:
        self.unmapped = list(range(GPU_PAGES))
        self.mapped: set[int] = set()
        self.cotenant_pages = 0

    def alloc_page(self) -> FakeInternalPage:
        if not self.unmapped or len(self.mapped) + self.cotenant_pages >= GPU_PAGES:
            raise RuntimeError("no physical page left to map")
        page_id = self.unmapped.pop(0)
        self.mapped.add(page_id)
        return FakeInternalPage(page_id)

    def quarantine(self, count: int) -> None:
        """`count` unmapped pages fail to map and are set aside (kvcached's quarantine): they are
        no longer free, on this GPU alone."""
        self.unmapped = self.unmapped[count:]

    def free_pages(self, page_ids: list[int]) -> None:
        for page_id in page_ids:
            self.mapped.remove(page_id)
            self.unmapped.append(page_id)

    def get_num_free_pages(self) -> int:
        return len(self.unmapped)

    def get_avail_physical_pages(self) -> int:
        return max(0, GPU_PAGES - len(self.mapped) - self.cotenant_pages)

    def get_num_reserved_pages(self) -> int:
        return 0

    def get_resize_target(self) -> int:
        return 0

    def group_indices_by_page(self, indices: list[int], block_mem_size: int) -> dict[int, list[int]]:
        pages: dict[int, list[int]] = {}
        for index in indices:
            pages.setdefault(index // BLOCKS_PER_PAGE, []).append(index)
        return pages


@pytest.fixture
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The real KVCacheManager over the fake extension, with its state as its constructor leaves
    it once the background set-up is done (no null block: SGLang's is not under test here)."""
    vmm_ops = types.ModuleType("kvcached.vmm_ops")
    vars(vmm_ops).update(
        PageAllocator=FakePageAllocator,
        InternalPage=FakeInternalPage,
        kv_tensors_created=lambda: True,
        # No page is mapped across processes here (one rank).
        map_to_kv_tensors=None,
        unmap_from_kv_tensors=None,
    )
    monkeypatch.setitem(sys.modules, "kvcached.vmm_ops", vmm_ops)
    fresh = ("kvcached.kv_cache_manager", "kvcached.tp_ipc_util")
    for name in fresh:
        monkeypatch.delitem(sys.modules, name, raising=False)
    try:
        module = importlib.import_module("kvcached.kv_cache_manager")
        from kvcached.locks import NoOpLock

        pool = module.KVCacheManager.__new__(module.KVCacheManager)
        vars(pool).update(
            page_allocator=FakePageAllocator(),
            block_mem_size=1,
            page_size=BLOCKS_PER_PAGE,
            mem_size=GPU_PAGES * BLOCKS_PER_PAGE,
            num_avail_blocks=0,
            avail_pages={},
            full_pages={},
            reserved_blocks=[],
            in_shrink=False,
            target_num_blocks=None,
            defer_physical_release=False,
            physical_release_barrier=None,
            _physical_release_epoch=0,
            _retired_pages=[],
            _lock=NoOpLock(),
            _post_init_done=threading.Event(),
        )
        pool._post_init_done.set()
        yield pool
    finally:
        for name in fresh:
            sys.modules.pop(name, None)


def _take_every_page_left(pool: Any) -> None:
    """Co-tenants map every GPU page this pool has not mapped."""
    pool.page_allocator.cotenant_pages = GPU_PAGES - len(pool.page_allocator.mapped)


def test_the_reading_covers_every_allocation_until_the_next_whatever_the_co_tenants_take(
    manager: Any,
) -> None:
    """Three blocks in use on one page, one free: the reading counts the free one. Freeing the
    three empties the page, which stays mapped (upstream unmaps it at once, and the next block
    then needs a page a co-tenant took). So every allocation totalling the reading plus what was
    freed since succeeds, with every other page taken."""
    blocks = manager.alloc(3)
    assert blocks is not None
    assert manager.guaranteed_available_size() == 1
    manager.free(blocks)
    _take_every_page_left(manager)
    assert manager.available_size() == BLOCKS_PER_PAGE
    got = [manager.alloc(1) for _ in range(BLOCKS_PER_PAGE)]
    assert None not in got
    assert manager.alloc(1) is None  # beyond it, a co-tenant's page is a real miss


def test_the_next_reading_unmaps_the_pages_emptied_since_and_counts_without_them(manager: Any) -> None:
    """Deferral only lasts until the next reading: pages emptied since go back to the GPU's
    co-tenants there, and the count drops by their blocks."""
    first = manager.alloc(BLOCKS_PER_PAGE)
    second = manager.alloc(2)
    assert first is not None and second is not None
    assert manager.guaranteed_available_size() == 2
    manager.free(first)
    assert manager.page_allocator.mapped == {0, 1}  # kept until the next reading
    assert manager.guaranteed_available_size() == 2
    assert manager.page_allocator.mapped == {1}
    manager.free(second)
    assert manager.guaranteed_available_size() == 0
    assert manager.page_allocator.mapped == set()


def test_reserved_blocks_count_and_a_reused_empty_page_stays_mapped(manager: Any) -> None:
    """Reserved blocks are the pool's too. A kept empty page that an allocation reuses before
    the next reading is in use again, and that reading must not unmap it."""
    assert manager.try_to_reserve(2)
    assert manager.guaranteed_available_size() == BLOCKS_PER_PAGE
    reserved = list(manager.reserved_blocks)
    manager.free_reserved()
    assert manager.guaranteed_available_size() == 0  # the emptied page was unmapped
    page = manager.alloc(2)
    assert page is not None and reserved
    manager.free(page)
    again = manager.alloc(1)
    assert again is not None
    assert manager.guaranteed_available_size() == BLOCKS_PER_PAGE - 1
    assert len(manager.page_allocator.mapped) == 1


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_the_elastic_allocators_give_it_in_tokens(elastic: types.ModuleType, page_size: int) -> None:
    """SGLang counts tokens: the token allocator's reading is the manager's capped at the pool's
    size (as its other readings are), the paged one's the manager's blocks times the page size."""
    kvcache = _mha_pool(elastic.MHATokenToKVPool)
    if page_size == 1:
        allocator = alloc_pkg.TokenToKVPoolAllocator(TOKENS, torch.bfloat16, "cpu", kvcache, False)
    else:
        allocator = alloc_pkg.PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", kvcache, False)
    beyond_the_pool = TOKENS if page_size == 1 else (TOKENS + 5) * PAGE
    for blocks, tokens in ((3, 3 * page_size), (TOKENS + 5, beyond_the_pool)):
        allocator.kvcached_allocator.guaranteed_available_size = lambda blocks=blocks: blocks
        assert allocator.guaranteed_available_size() == tokens
