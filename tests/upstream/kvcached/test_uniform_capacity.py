"""Every elastic pool the carried SGLang scheduler's ranks agree on counts its free space alike on
every rank (series entry "sglang: give every rank-local pool a free-space reading only its own calls
change", sgl-project/sglang#34676).

kvcached's `available_size()` is the least of its free virtual space and the physical memory the GPU
can still map, which a co-tenant changes and which kvcached caches for 100 ms: two ranks' readings
drift apart. The carried scheduler agrees on that reading at points every rank reaches alike and in
between counts from `uniform_available_size()`, which only the pool's own calls change. These tests
install kvcached's patches over the REAL SGLang classes (test_rank_local_capacity.py's fixture,
faking only kvcached's CUDA boundary).

Expected: FAIL with the miss-reporting entry alone, PASS with this one.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import sglang.srt.mem_cache.allocator as alloc_pkg
import torch
from test_guaranteed_capacity import BLOCKS_PER_PAGE, GPU_PAGES, manager
from test_rank_local_capacity import PAGE, TOKENS, _hybrid_req_to_token_pool, _mha_pool, elastic

# The fixtures, shared with test_rank_local_capacity.py and test_guaranteed_capacity.py.
__all__ = ["elastic", "manager"]


def _scheduler_reads(allocator: Any, req_to_token_pool: Any) -> list[Any]:
    """The pools whose free space the carried scheduler agrees on (Scheduler._prefill_agreement)."""
    from sglang.srt.mem_cache.allocator.base import rank_local_pools

    pools = [allocator, allocator.get_kvcache(), req_to_token_pool]
    pools += [getattr(req_to_token_pool, name, None) for name in ("mamba_pool", "mamba_allocator")]
    return [
        part
        for pool in pools
        if pool is not None
        for part in rank_local_pools(pool)
        if callable(getattr(part, "available_size", None))
    ]


def elastic_pools(elastic: types.ModuleType, page_size: int) -> tuple[Any, Any]:
    """An elastic token allocator (paged where `page_size` > 1) and a hybrid request pool with
    kvcached's elastic Mamba pool, as kvcached's patches build them over sglang's classes."""
    req_to_token_pool = _hybrid_req_to_token_pool()
    kvcache = _mha_pool(elastic.MHATokenToKVPool)
    if page_size == 1:
        allocator = alloc_pkg.TokenToKVPoolAllocator(TOKENS, torch.bfloat16, "cpu", kvcache, False)
    else:
        allocator = alloc_pkg.PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", kvcache, False)
    return allocator, req_to_token_pool


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_every_pool_the_scheduler_agrees_on_counts_alike_on_every_rank(
    elastic: types.ModuleType, page_size: int
) -> None:
    """Each elastic pool whose free space the scheduler's ranks agree on has a reading that only
    its own calls change (`uniform_available_size`: the manager's virtual space), beside its real
    one (the least of that and the GPU memory left to map). A co-tenant lowers the real reading
    only. (That the carried scheduler's agreement takes every one of them is test_agreed_deficit's:
    from the sglang series' pool interface on it needs kvcached's entry 0004 too.)"""
    allocator, req_to_token_pool = elastic_pools(elastic, page_size)
    read = _scheduler_reads(allocator, req_to_token_pool)
    assert {type(pool).__name__ for pool in read} >= {
        type(allocator).__name__,
        "ElasticMambaPool",
        "ElasticMambaSlotAllocator",
    }
    for pool in read:
        uniform, real = pool.uniform_available_size(), pool.available_size()
        assert uniform == real > 0, type(pool).__name__
    managers = (allocator.kvcached_allocator, req_to_token_pool.mamba_pool.kvcached_allocator)
    for fake_manager in managers:
        fake_manager.mappable = 1  # a co-tenant maps this GPU's memory away
    for pool in read:
        assert pool.available_size() < pool.uniform_available_size(), type(pool).__name__


def test_the_managers_own_reading_counts_its_unmapped_pages_and_no_co_tenant(manager: Any) -> None:
    """The REAL KVCacheManager (test_guaranteed_capacity.py's fixture, its C++ extension faked):
    `virtual_available_size()` is every block of its virtual space it has not handed out, on
    mapped pages and on pages it has not mapped yet, whatever co-tenants map; only its own calls
    move it, one block for one."""
    every_block = GPU_PAGES * BLOCKS_PER_PAGE
    assert manager.virtual_available_size() == every_block  # nothing mapped yet
    blocks = manager.alloc(3)
    assert blocks is not None
    assert manager.virtual_available_size() == every_block - 3
    manager.page_allocator.cotenant_pages = GPU_PAGES - len(manager.page_allocator.mapped)
    assert manager.available_size() < manager.virtual_available_size() == every_block - 3
    manager.free(blocks)
    assert manager.virtual_available_size() == every_block


def test_a_quarantine_or_a_shrink_on_one_gpu_leaves_the_managers_own_reading(manager: Any) -> None:
    """Pages quarantined after a failed map, and a shrink still pending, happen on one GPU at its
    own moment: they lower the real reading, which the ranks agree on, and not the one the ranks
    count from between agreements (were they to lower it, one rank's count would drop between two
    agreements and its next allocation would evict by it alone)."""
    blocks = manager.alloc(3)
    assert blocks is not None
    own = manager.virtual_available_size()
    real = manager.available_size()
    manager.page_allocator.quarantine(2)
    assert manager.available_size() == real - 2 * BLOCKS_PER_PAGE
    assert manager.virtual_available_size() == own
    manager.in_shrink = True
    assert manager.available_size() == BLOCKS_PER_PAGE - 3  # the free blocks on its mapped page
    assert manager.virtual_available_size() == own
    manager.in_shrink = False  # the shrink given up
    manager.free(blocks)
    assert manager.virtual_available_size() == own + 3
