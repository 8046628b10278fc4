"""A rank-local Mamba pool under a prefix cache is refused at start-up where more than one rank
schedules a batch together, by name (series entry "Scheduler: refuse a rank-local Mamba pool under
a prefix cache", sgl-project/sglang#34676).

The prefix cache (the radix cache, on unless --disable-radix-cache) allocates Mamba slots outside
the votes the ranks agree on: a checkpoint's slot (prepare_for_caching_req), which a checkpoint
that finds none skips by each rank's own allocation, so one rank keeps a node's state its peer
lacks and the trees part; a HiCache load-back's (prepare_load_back), which asserts on the rank that
misses alone; with extra_buffer_lazy also the ping-pong slots after the decode vote. kvcached's
elastic Mamba pool is rank-local (each GPU maps its own memory), so with two ranks and a prefix
cache each such allocation could miss on one rank alone. Without a prefix cache a Mamba slot comes
only with its request, inside the voted round: that starts.

Two forked gloo ranks with distinct group objects, the Mamba pool's readings counted alike and
drifting as in test_rank_local_refusals.py.

Expected: the refusal test FAILS without the entry (the scheduler starts, the agreement built) and
PASSES with it, both ranks refusing alike; the test without a prefix cache passes either way.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import scheduler_harness as sh
from test_rank_agreement import TwoRanks, counted_alike, run_two_ranks
from test_rank_local_refusals import _mamba_pool, _start_up


def _rank_local_mamba(h: sh.Harness, rank: int) -> dict[str, Any]:
    """The Mamba pool rank-local (as kvcached's is) under the prefix cache (the default)."""
    pool = _mamba_pool(h)
    pool.rank_local_capacity = True
    counted_alike(pool)
    return _start_up(h)


def _rank_local_mamba_without_a_prefix_cache(h: sh.Harness, rank: int) -> dict[str, Any]:
    """As _rank_local_mamba, started with --disable-radix-cache."""
    with mock.patch.object(h.scheduler, "server_args", _WithoutRadixCache(h.scheduler.server_args)):
        return _rank_local_mamba(h, rank)


class _WithoutRadixCache:
    """The scheduler's server arguments, read-only from 0.5.23 on, as --disable-radix-cache."""

    disable_radix_cache = True

    def __init__(self, server_args: Any) -> None:
        self._server_args = server_args

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server_args, name)


SCENARIOS = {
    "tp_rank_local_mamba": _rank_local_mamba,
    "tp_rank_local_mamba_no_prefix_cache": _rank_local_mamba_without_a_prefix_cache,
}
CONFIGS = {name: {"mamba": True} for name in SCENARIOS}


@pytest.fixture(scope="module")
def two_ranks() -> TwoRanks:
    return run_two_ranks(list(SCENARIOS), SCENARIOS, {}, CONFIGS)


def test_a_rank_local_mamba_pool_under_a_prefix_cache_is_refused_by_name(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_rank_local_mamba")
    assert ranks[0] == ranks[1]
    refused = ranks[0]["refused"]
    assert refused is not None and "with a prefix cache and 2 ranks scheduling together" in refused, ranks[0]
    assert "--disable-radix-cache" in refused, refused


def test_a_rank_local_mamba_pool_without_a_prefix_cache_starts(two_ranks: TwoRanks) -> None:
    ranks = two_ranks.scenario("tp_rank_local_mamba_no_prefix_cache")
    assert ranks[0] == ranks[1] == {"refused": None, "agreed": True}, ranks


def test_one_rank_alone_is_never_refused() -> None:
    with sh.build_harness(elastic=True, mamba=True) as h:
        assert _rank_local_mamba(h, 0) == {"refused": None, "agreed": True}
