"""kvcached's elastic allocators report every miss the way the carried SGLang prefill unwind handles it.

The unwind (sglang-carry, `AllocationMiss`) sees a miss where SGLang's own allocators show one: `alloc`,
`alloc_extend` and `alloc_decode` return None, having taken nothing. These tests build the REAL kvcached
elastic allocators on the REAL SGLang allocator classes of the line under test (the SWA composite
included) and fake only the boundaries: the KVCacheManager (whose contract is: block ids, or None with
nothing taken), the device check (CPU stands in for the GPU) and the Triton allocator kernels (SGLang's
own CPU reference, `alloc_extend_naive`, computes them).

A composite allocation that misses on one sub-pool must give back what the other sub-pool took; a miss
after SGLang's availability check is what an elastic pool adds (another engine mapped the last physical
pages), so the checks report capacity while the KVCacheManager misses.

The SGLang version gate is checked too: kvcached patches exactly the SGLang releases this project
carries a series for and runs these tests against (and local builds of them), and refuses every other.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sglang
import sglang.srt.mem_cache.allocator as alloc_pkg
import sglang.srt.mem_cache.allocator.swa as swa_mod
import torch
from class_snapshots import restore, snapshot
from kvcached.integration.sglang import patches
from kvcached.integration.version_utils import VersionManager
from packaging.version import Version
from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive
from sglang.srt.mem_cache.base_swa_memory_pool import BaseSWAKVPool

from sglang_carry.project import Project

ROOT = Path(__file__).resolve().parents[3]

PAGE = 4
NUM_PAGES = 8


class FakeKVCacheManager:
    """KVCacheManager at its contract: `alloc` gives block ids, or on a miss None having taken nothing.

    `miss` models another engine taking the last physical pages: `available_size` still reports the
    logical capacity (as kvcached's does), but `alloc` misses.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.miss = False
        self.clear()

    def clear(self) -> None:
        # Block 0 is kvcached's reserved null block.
        self.free_ids = list(range(1, self.num_blocks + 1))
        self.in_use: set[int] = set()

    def available_size(self) -> int:
        return len(self.free_ids)

    def alloc(self, need_size: int) -> list[int] | None:
        if self.miss or need_size > len(self.free_ids):
            return None
        ids, self.free_ids = self.free_ids[:need_size], self.free_ids[need_size:]
        self.in_use.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for block_id in ids:
            assert block_id in self.in_use, f"block {block_id} freed but not in use"
            self.in_use.remove(block_id)
            self.free_ids.append(block_id)


class FakeElasticKVPool:
    """An elastic KV pool, as the elastic allocators see it: its KVCacheManager."""

    def __init__(self, num_blocks: int) -> None:
        self.kvcached_allocator = FakeKVCacheManager(num_blocks)


class FakeSWAKVPool(BaseSWAKVPool):  # type: ignore[misc]  # sglang is untyped
    """The SWA pool pair, as SGLang's SWA composite allocator sees it."""

    def __init__(self, num_blocks: int) -> None:
        self.full_kv_pool = FakeElasticKVPool(num_blocks)
        self.swa_kv_pool = FakeElasticKVPool(num_blocks)
        self.full_to_swa_index_mapping: torch.Tensor | None = None

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor) -> None:
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        assert self.full_to_swa_index_mapping is not None
        return self.full_to_swa_index_mapping[kv_indices]


FakeSWAKVPool.__abstractmethods__ = frozenset()


def _alloc_extend_on_cpu(
    pre_lens_ptr: Any,
    seq_lens_ptr: Any,
    last_loc_ptr: Any,
    free_page_ptr: Any,
    out_indices: Any,
    bs_upper: Any,
    page_size: Any,
) -> None:
    alloc_extend_naive(
        pre_lens_ptr, seq_lens_ptr, last_loc_ptr, free_page_ptr, out_indices, page_size, out_indices.device
    )


def _alloc_decode_on_cpu(
    seq_lens_ptr: Any,
    last_loc_ptr: Any,
    free_page_ptr: Any,
    out_indices: Any,
    bs_upper: Any,
    page_size: Any,
) -> None:
    # A decode step is an extend by one token.
    alloc_extend_naive(
        seq_lens_ptr - 1,
        seq_lens_ptr,
        last_loc_ptr,
        free_page_ptr,
        out_indices,
        page_size,
        out_indices.device,
    )


class CpuKernel:
    """The Triton launch boundary `kernel[grid](...)`, run on CPU."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __getitem__(self, grid: Any) -> Any:
        return self.fn


@pytest.fixture
def elastic(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """kvcached's allocator patches applied to the real SGLang allocator modules, undone afterwards."""
    monkeypatch.setattr(patches, "_is_supported_gpu_device", lambda device: True)
    kernels = importlib.import_module("sglang.kernels.ops.memory.allocator")
    monkeypatch.setattr(kernels, "alloc_extend_kernel", CpuKernel(_alloc_extend_on_cpu))
    monkeypatch.setattr(kernels, "alloc_decode_kernel", CpuKernel(_alloc_decode_on_cpu))

    touched = (alloc_pkg, swa_mod, swa_mod.SWATokenToKVPoolAllocator)
    snapshots = [snapshot(obj) for obj in touched]
    try:
        assert patches.ElasticAllocatorPatch().apply(alloc_pkg)
        assert patches.ElasticSWAAllocatorPatch().apply(swa_mod)
        yield types.SimpleNamespace(
            token=alloc_pkg.ElasticTokenToKVPoolAllocator,
            paged=alloc_pkg.ElasticPagedTokenToKVPoolAllocator,
            swa=swa_mod.SWATokenToKVPoolAllocator,
        )
    finally:
        for obj, saved in zip(touched, snapshots, strict=True):
            restore(obj, saved)


def _cpu(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _swa_allocator(elastic: types.SimpleNamespace, page_size: int) -> Any:
    kvcache = FakeSWAKVPool(NUM_PAGES)
    allocator = elastic.swa(
        NUM_PAGES * page_size,
        NUM_PAGES * page_size,
        page_size,
        torch.bfloat16,
        "cpu",
        kvcache,
        False,
    )
    assert isinstance(allocator.full_attn_allocator, elastic.token if page_size == 1 else elastic.paged)
    assert isinstance(allocator.swa_attn_allocator, elastic.token if page_size == 1 else elastic.paged)
    return allocator


def _managers(allocator: Any) -> dict[str, FakeKVCacheManager]:
    return {
        "full": allocator.full_attn_allocator.kvcached_allocator,
        "swa": allocator.swa_attn_allocator.kvcached_allocator,
    }


def _extend(allocator: Any) -> Any:
    # One request, no prefix, 6 new tokens: 2 new pages on each sub-pool.
    return allocator.alloc_extend(_cpu(0), _cpu(0), _cpu(6), _cpu(6), _cpu(-1), 6)


def _decode(allocator: Any) -> Any:
    # One request whose 5th token opens a new page.
    return allocator.alloc_decode(_cpu(5), _cpu(5), _cpu(PAGE - 1))


# -- token allocator (page_size == 1) ------------------------------------------------------------


def test_token_allocator_reports_a_miss_as_none(elastic: types.SimpleNamespace) -> None:
    kvcache = FakeElasticKVPool(16)
    allocator = elastic.token(16, torch.bfloat16, "cpu", kvcache, False)
    kvcache.kvcached_allocator.miss = True

    assert allocator.alloc(3) is None
    assert kvcache.kvcached_allocator.in_use == set()


def test_token_allocator_still_allocates(elastic: types.SimpleNamespace) -> None:
    kvcache = FakeElasticKVPool(16)
    allocator = elastic.token(16, torch.bfloat16, "cpu", kvcache, False)

    assert allocator.alloc(3).tolist() == [1, 2, 3]


# -- paged allocator (page_size > 1): already returns None; guard it -----------------------------


@pytest.mark.parametrize("path", ["alloc", "alloc_extend", "alloc_decode"])
def test_paged_allocator_reports_a_miss_as_none(elastic: types.SimpleNamespace, path: str) -> None:
    kvcache = FakeElasticKVPool(NUM_PAGES)
    allocator = elastic.paged(NUM_PAGES * PAGE, PAGE, torch.bfloat16, "cpu", kvcache, False)
    kvcache.kvcached_allocator.miss = True

    calls = {
        "alloc": lambda: allocator.alloc(2 * PAGE),
        "alloc_extend": lambda: _extend(allocator),
        "alloc_decode": lambda: _decode(allocator),
    }
    assert calls[path]() is None
    assert kvcache.kvcached_allocator.in_use == set()


# -- SWA composite: two sub-allocations, all or nothing ------------------------------------------


@pytest.mark.parametrize("missing", ["full", "swa"])
def test_swa_alloc_miss_returns_none_and_gives_back_the_other_pool(
    elastic: types.SimpleNamespace, missing: str
) -> None:
    allocator = _swa_allocator(elastic, page_size=1)
    managers = _managers(allocator)
    managers[missing].miss = True

    assert allocator.alloc(3) is None
    assert managers["full"].in_use == set()
    assert managers["swa"].in_use == set()


def _extend_swa_tail(allocator: Any) -> Any:
    # The same extend with SWA KV for its last 2 tokens only: 2 full pages, 1 SWA page.
    return allocator.alloc_extend_swa_tail(_cpu(0), _cpu(0), _cpu(6), _cpu(6), _cpu(-1), 6, 2)


@pytest.mark.parametrize("missing", ["full", "swa"])
@pytest.mark.parametrize("path", ["alloc_extend", "alloc_extend_swa_tail", "alloc_decode"])
def test_swa_paged_miss_returns_none_and_gives_back_the_other_pool(
    elastic: types.SimpleNamespace, path: str, missing: str
) -> None:
    allocator = _swa_allocator(elastic, page_size=PAGE)
    managers = _managers(allocator)
    managers[missing].miss = True

    calls = {"alloc_extend": _extend, "alloc_extend_swa_tail": _extend_swa_tail, "alloc_decode": _decode}
    assert calls[path](allocator) is None
    assert managers["full"].in_use == set()
    assert managers["swa"].in_use == set()


def test_swa_allocations_without_a_miss_keep_their_pages(elastic: types.SimpleNamespace) -> None:
    allocator = _swa_allocator(elastic, page_size=PAGE)
    managers = _managers(allocator)

    out = _extend(allocator)
    assert out is not None
    assert out.tolist() == [4, 5, 6, 7, 8, 9]
    assert managers["full"].in_use == {1, 2}
    assert managers["swa"].in_use == {1, 2}
    assert allocator.full_to_swa_index_mapping[out].tolist() == [4, 5, 6, 7, 8, 9]


def test_swa_allocation_that_fails_without_a_miss_stays_loud(elastic: types.SimpleNamespace) -> None:
    allocator = _swa_allocator(elastic, page_size=1)

    def broken(*args: Any, **kwargs: Any) -> None:
        raise ValueError("not a miss")

    allocator.set_full_to_swa_mapping = broken
    with pytest.raises(ValueError, match="not a miss"):
        allocator.alloc(3)


# -- the SGLang version gate ---------------------------------------------------------------------


def carried_sglang_lines() -> list[str]:
    project = Project(ROOT)
    sglang_pins = project.pins()["sglang"]
    return sorted(
        (release.version for release in sglang_pins.releases if project.has_series(release)),
        key=Version,
    )


def test_sglang_gate_admits_exactly_the_carried_lines() -> None:
    assert sorted(patches.SGLANG_TESTED_RELEASES, key=Version) == carried_sglang_lines()


@pytest.mark.parametrize("line", carried_sglang_lines())
@pytest.mark.parametrize("local", ["", "+carry.3"])
def test_sglang_gate_admits_a_carried_line_and_its_local_builds(line: str, local: str) -> None:
    assert patches.sglang_is_tested(line + local)


@pytest.mark.parametrize(
    "version",
    [
        "0.4.9",
        "0.5.19",
        "0.5.20rc1",
        "0.5.20.post1",
        "0.5.21.dev0",
        "0.5.22rc1",
        "0.5.23.post1",
        "0.5.24",
        "0.6.0",
        "not-a-version",
        None,
    ],
)
def test_sglang_gate_refuses_every_other_version(version: str | None) -> None:
    assert not patches.sglang_is_tested(version)


@pytest.mark.parametrize(
    ("version", "patched"), [(carried_sglang_lines()[-1], True), ("0.5.19", False), ("0.5.24", False)]
)
def test_autopatch_patches_only_the_tested_sglang(
    monkeypatch: pytest.MonkeyPatch, version: str, patched: bool
) -> None:
    monkeypatch.delenv("KVCACHED_AUTOPATCH", raising=False)
    autopatch = importlib.import_module("kvcached.integration.sglang.autopatch")

    managers: list[Any] = []

    class RecordingPatchManager:
        def __init__(self, library: str) -> None:
            managers.append(self)

        def register_patches_with_versions(self, patch_list: list[Any]) -> None:
            pass

        def apply_all_patches(self) -> dict[str, bool]:
            return {}

    monkeypatch.setattr(autopatch, "PatchManager", RecordingPatchManager)
    monkeypatch.setattr(
        VersionManager.get_instance(), "detect_version", lambda library, force_refresh=False: version
    )
    monkeypatch.setenv("KVCACHED_AUTOPATCH", "1")

    autopatch._patch_sglang(sglang)

    assert bool(managers) is patched
