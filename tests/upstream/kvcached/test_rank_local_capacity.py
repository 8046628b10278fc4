"""Every elastic pool and allocator kvcached installs into SGLang declares `rank_local_capacity`.

kvcached maps physical memory per GPU on demand, shared with co-tenant engines, so the free space of
each TP rank is its own. The carried SGLang scheduler reads `getattr(pool, "rank_local_capacity",
False)` on the token allocator, its `get_kvcache()`, the req_to_token pool and its Mamba pool, to decide
whether its ranks must agree on each prefill round; SGLang's own pools, whose capacity is fixed at
start-up and the same on every rank, do not declare it.

These tests install kvcached's patches over the REAL SGLang allocator and memory-pool classes of the
line under test and construct the REAL elastic classes; they fake only the hardware boundary: kvcached's
`interfaces` module (its CUDA extension: the virtual-memory tensors and the KVCacheManager, here CPU
tensors and a counter), the device check (CPU stands in for the GPU) and the parallel state (one rank).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import kvcached.integration.sglang as kvcached_sglang
import pytest
import sglang.srt.distributed as sglang_distributed
import sglang.srt.mem_cache.allocator as alloc_pkg
import sglang.srt.mem_cache.allocator.swa as swa_mod
import sglang.srt.mem_cache.memory_pool as mem_pool_mod
import torch
from class_snapshots import restore, snapshot
from kvcached.integration.sglang import patches
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

PAGE = 4
TOKENS = 16

# SGLang's own classes, taken before any test installs kvcached's.
PLAIN_TOKEN_ALLOCATOR = alloc_pkg.TokenToKVPoolAllocator
PLAIN_PAGED_ALLOCATOR = alloc_pkg.PagedTokenToKVPoolAllocator
PLAIN_MHA_POOL = mem_pool_mod.MHATokenToKVPool


class FakeKVCacheManager:
    """The KVCacheManager as these constructors see it: its capacity (and `clear`, which SGLang's
    allocators call on construction)."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.mappable = num_blocks  # what the GPU can still map: a co-tenant lowers it

    def clear(self) -> None:
        pass

    def available_size(self) -> int:
        return min(self.num_blocks, self.mappable)

    def virtual_available_size(self) -> int:
        return self.num_blocks


def _fake_interfaces() -> types.ModuleType:
    """kvcached's `interfaces`, the boundary to its CUDA extension, on CPU tensors."""
    kvi = types.ModuleType("kvcached.integration.sglang.interfaces")

    def init_kvcached(**kwargs: Any) -> None:
        pass

    def alloc_kv_cache(
        kvcache_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: str,
        num_layers: int,
        attention_type: str = "MHA",
        **kwargs: Any,
    ) -> Any:
        def buffers() -> list[torch.Tensor]:
            return [torch.zeros(kvcache_shape, dtype=dtype) for _ in range(num_layers)]

        return buffers() if attention_type == "MLA" else (buffers(), buffers())

    def alloc_mamba_states(
        *, num_slots: int, num_mamba_layers: int, cache_params: Any, device: str, group_id: int = 0
    ) -> tuple[list[torch.Tensor], torch.Tensor, dict[str, Any]]:
        conv = [
            torch.zeros((num_mamba_layers, num_slots, *shape), dtype=cache_params.dtype.conv)
            for shape in cache_params.shape.conv
        ]
        temporal = torch.zeros(
            (num_mamba_layers, num_slots, *cache_params.shape.temporal), dtype=cache_params.dtype.temporal
        )
        return conv, temporal, {"cell_size": 1, "is_contiguous": True}

    def get_kv_cache_manager(num_blocks: int, *args: Any, **kwargs: Any) -> FakeKVCacheManager:
        return FakeKVCacheManager(num_blocks)

    vars(kvi).update(
        init_kvcached=init_kvcached,
        alloc_kv_cache=alloc_kv_cache,
        alloc_mamba_states=alloc_mamba_states,
        get_kv_cache_manager=get_kv_cache_manager,
    )
    return kvi


@pytest.fixture
def elastic(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """kvcached's allocator and memory-pool patches on the real SGLang modules, undone afterwards."""
    kvi = _fake_interfaces()
    monkeypatch.setitem(sys.modules, kvi.__name__, kvi)
    monkeypatch.setattr(kvcached_sglang, "interfaces", kvi, raising=False)
    monkeypatch.setattr(patches, "_is_supported_gpu_device", lambda device: True)
    # One rank of one: the elastic pools ask SGLang's parallel state for their rank, which SGLang 0.5.20
    # asserts is set up (later lines no longer export these, and kvcached falls back to torch's).
    for name, value in (
        ("get_tensor_model_parallel_rank", 0),
        ("get_tensor_model_parallel_world_size", 1),
        ("get_pipeline_model_parallel_rank", 0),
    ):
        monkeypatch.setattr(sglang_distributed, name, lambda value=value: value, raising=False)

    touched = (
        alloc_pkg,
        swa_mod,
        swa_mod.SWATokenToKVPoolAllocator,
        mem_pool_mod,
        mem_pool_mod.HybridReqToTokenPool,
    )
    snapshots = [snapshot(obj) for obj in touched]
    try:
        assert patches.ElasticAllocatorPatch().apply(alloc_pkg)
        assert patches.ElasticSWAAllocatorPatch().apply(swa_mod)
        for patch in (
            patches.ElasticMemoryPoolPatch,
            patches.ElasticMLAMemoryPoolPatch,
            patches.ElasticMambaPoolPatch,
            patches.ElasticHybridLinearKVPoolPatch,
        ):
            assert patch().apply(mem_pool_mod), patch.__name__
        yield mem_pool_mod
    finally:
        for obj, saved in zip(touched, snapshots, strict=True):
            restore(obj, saved)


def _mha_pool(cls: Any, layer_num: int = 2) -> Any:
    return cls(
        size=TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        head_num=2,
        head_dim=8,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
    )


def _hybrid_req_to_token_pool() -> Any:
    cache_params = Mamba2CacheParams(
        shape=Mamba2StateShape.create(
            tp_world_size=1,
            intermediate_size=8,
            n_groups=1,
            num_heads=2,
            head_dim=4,
            state_size=4,
            conv_kernel=4,
        ),
        layers=[1],
    )
    return mem_pool_mod.HybridReqToTokenPool(
        size=4,
        mamba_size=4,
        mamba_spec_state_size=4,
        max_context_len=32,
        device="cpu",
        enable_memory_saver=False,
        cache_params=cache_params,
        mamba_layer_ids=[1],
        enable_mamba_extra_buffer=False,
    )


class FakeSWAKVPool(BaseSWAKVPool):  # type: ignore[misc]  # sglang is untyped
    """The SWA pool pair, as SGLang's SWA composite allocator sees it: two elastic pools."""

    def __init__(self) -> None:
        self.full_kv_pool = _mha_pool(mem_pool_mod.MHATokenToKVPool)
        self.swa_kv_pool = _mha_pool(mem_pool_mod.MHATokenToKVPool)

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        pass


FakeSWAKVPool.__abstractmethods__ = frozenset()


def _rank_local(obj: Any) -> Any:
    # The SGLang side's read.
    return getattr(obj, "rank_local_capacity", False)


def test_elastic_kv_pools_declare_rank_local_capacity(elastic: types.ModuleType) -> None:
    mha = _mha_pool(elastic.MHATokenToKVPool)
    mla = elastic.MLATokenToKVPool(
        size=TOKENS,
        page_size=PAGE,
        dtype=torch.bfloat16,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )

    assert type(mha).__name__ == "ElasticMHATokenToKVPool"
    assert type(mla).__name__ == "ElasticMLATokenToKVPool"
    assert _rank_local(mha) is True
    assert _rank_local(mla) is True


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_elastic_allocators_declare_rank_local_capacity(elastic: types.ModuleType, page_size: int) -> None:
    kvcache = _mha_pool(elastic.MHATokenToKVPool)
    if page_size == 1:
        allocator = alloc_pkg.TokenToKVPoolAllocator(TOKENS, torch.bfloat16, "cpu", kvcache, False)
        assert type(allocator).__name__ == "ElasticTokenToKVPoolAllocator"
    else:
        allocator = alloc_pkg.PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", kvcache, False)
        assert type(allocator).__name__ == "ElasticPagedTokenToKVPoolAllocator"

    assert _rank_local(allocator) is True
    assert _rank_local(allocator.get_kvcache()) is True


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_swa_sub_allocators_declare_rank_local_capacity(elastic: types.ModuleType, page_size: int) -> None:
    allocator = swa_mod.SWATokenToKVPoolAllocator(
        TOKENS, TOKENS, page_size, torch.bfloat16, "cpu", FakeSWAKVPool(), False
    )

    for sub in (allocator.full_attn_allocator, allocator.swa_attn_allocator):
        assert hasattr(sub, "kvcached_allocator")
        assert _rank_local(sub) is True


def test_elastic_mamba_pool_and_slot_allocator_declare_rank_local_capacity(elastic: types.ModuleType) -> None:
    req_to_token_pool = _hybrid_req_to_token_pool()

    assert type(req_to_token_pool.mamba_pool).__name__ == "ElasticMambaPool"
    assert type(req_to_token_pool.mamba_allocator).__name__ == "ElasticMambaSlotAllocator"
    assert _rank_local(req_to_token_pool.mamba_pool) is True
    assert _rank_local(req_to_token_pool.mamba_allocator) is True


def test_elastic_hybrid_linear_pool_declares_rank_local_capacity(elastic: types.ModuleType) -> None:
    req_to_token_pool = _hybrid_req_to_token_pool()
    kvcache = elastic.HybridLinearKVPool(
        size=TOKENS,
        dtype=torch.bfloat16,
        page_size=PAGE,
        head_num=2,
        head_dim=8,
        full_attention_layer_ids=[0],
        device="cpu",
        mamba_pool=req_to_token_pool.mamba_pool,
    )
    allocator = alloc_pkg.PagedTokenToKVPoolAllocator(TOKENS, PAGE, torch.bfloat16, "cpu", kvcache, False)

    assert type(kvcache).__name__ == "ElasticHybridLinearKVPool"
    assert _rank_local(kvcache.full_kv_pool) is True
    assert _rank_local(kvcache) is True
    assert _rank_local(allocator) is True


def test_plain_sglang_pools_do_not_declare_rank_local_capacity() -> None:
    kvcache = _mha_pool(PLAIN_MHA_POOL)
    token = PLAIN_TOKEN_ALLOCATOR(TOKENS, torch.bfloat16, "cpu", kvcache, False)
    paged = PLAIN_PAGED_ALLOCATOR(TOKENS, PAGE, torch.bfloat16, "cpu", kvcache, False)

    assert not hasattr(kvcache, "kvcached_allocator")
    for plain in (kvcache, token, paged):
        assert _rank_local(plain) is not True
