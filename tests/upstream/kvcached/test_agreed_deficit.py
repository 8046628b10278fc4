"""Every elastic pool takes the free space its SGLang ranks agreed through its own interface (series
entry "sglang: a rank-local pool takes its ranks' agreed deficit through its own interface",
sgl-project/sglang#34676).

The carried SGLang scheduler agrees, at points every rank reaches alike, on each rank-local pool's
deficit (its uniform reading minus its real one, the most any rank had), and until the next vote
every decision reads the pool's uniform reading less that deficit. The scheduler used to replace
`available_size` on the live pool objects to that end; now each pool offers
`real_available_size()` and `agree_deficit(deficit)`, and its own `available_size()` reads by the
agreed deficit where one was handed to it. These tests install kvcached's patches over the REAL
SGLang classes (test_rank_local_capacity.py's fixture, faking only kvcached's CUDA boundary) and
hand the pools to the REAL scheduler's RankAgreement.

Expected: FAIL without the entry (no `real_available_size`, no `agree_deficit`: the agreement
refuses the pools) and PASS with it.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
from test_rank_local_capacity import PAGE, elastic
from test_uniform_capacity import _scheduler_reads, elastic_pools

__all__ = ["elastic"]  # the fixture, shared with test_rank_local_capacity.py


def _pools(elastic: types.ModuleType, page_size: int) -> tuple[Any, Any, list[Any]]:
    allocator, req_to_token_pool = elastic_pools(elastic, page_size)
    managers = (allocator.kvcached_allocator, req_to_token_pool.mamba_pool.kvcached_allocator)
    for manager in managers:
        manager.mappable = 1  # a co-tenant maps this GPU's memory away: real < uniform
    return allocator, req_to_token_pool, _scheduler_reads(allocator, req_to_token_pool)


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_every_rank_local_pool_reads_by_the_deficit_handed_to_it(
    elastic: types.ModuleType, page_size: int
) -> None:
    _, req_to_token_pool, read = _pools(elastic, page_size)
    for pool in read:
        name = type(pool).__name__
        uniform, real = pool.uniform_available_size(), pool.real_available_size()
        assert real < uniform, name
        assert pool.available_size() == real, name  # no deficit handed: as it is
        pool.agree_deficit(uniform - real + 3)  # a peer rank had 3 fewer
        assert pool.available_size() == max(0, real - 3), name
        # No rank short of memory: the agreed deficit is 0, and the pool reads its uniform
        # reading, not this rank's own (lower) real one.
        pool.agree_deficit(0)
        assert pool.available_size() == uniform, name
        assert pool.real_available_size() == real, name
        pool.agree_deficit(None)
        assert pool.available_size() == real, name
    # The slot allocator's real reading is its Mamba pool's real one, never the pool's agreed one.
    mamba_pool, slots = req_to_token_pool.mamba_pool, req_to_token_pool.mamba_allocator
    mamba_pool.agree_deficit(mamba_pool.uniform_available_size())
    assert mamba_pool.available_size() == 0
    assert slots.real_available_size() == mamba_pool.real_available_size() > 0
    mamba_pool.agree_deficit(None)


@pytest.mark.parametrize("page_size", [1, PAGE])
def test_the_schedulers_agreement_hands_each_pool_the_voted_deficit(
    elastic: types.ModuleType, page_size: int
) -> None:
    """One rank's vote (the group of one): every pool then reads its uniform reading less its own
    deficit, its real reading; idle, each reads as it is; resumed, by the deficit again."""
    from sglang.srt.mem_cache.rank_agreement import RankAgreement

    _, _, read = _pools(elastic, page_size)
    read = list({id(pool): pool for pool in read}.values())  # a pool read twice is agreed once
    agreement = RankAgreement(lambda vote: None, read)
    deficits = agreement.deficits()
    agreement.vote(agreement.ballot(missed=False, fingerprint=0, batch_size=0))
    for pool, deficit in zip(read, deficits, strict=True):
        assert pool.available_size() == pool.uniform_available_size() - deficit, type(pool).__name__
        assert getattr(pool, "_agreed_deficit", None) == deficit
    agreement.read_real_while_idle()
    assert all(getattr(pool, "_agreed_deficit", 0) is None for pool in read)
    agreement.resume()
    assert [getattr(pool, "_agreed_deficit", None) for pool in read] == list(deficits)


def test_the_slot_allocator_reads_a_pool_without_the_agreed_interface_by_its_available_size(
    elastic: types.ModuleType,
) -> None:
    """kvcached's own suite (tests/test_sglang_mamba_slot_allocator.py) stands a pool of
    available_size, alloc, free and clear in for the ElasticMambaPool: the slot allocator reads
    that pool's available_size() as its real free slots, as before the entry (it read a
    real_available_size() the stand-in lacks, and five of kvcached's own tests failed)."""
    _, req_to_token_pool, _ = _pools(elastic, 1)

    class SlotsOnlyPool:
        def available_size(self) -> int:
            return 5

    slots = type(req_to_token_pool.mamba_allocator)(8, "cpu", SlotsOnlyPool())
    assert slots.real_available_size() == 5
    assert slots.available_size() == 5  # no deficit handed: as it is
