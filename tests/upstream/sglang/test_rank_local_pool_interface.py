"""A rank-local pool takes the agreed deficit through its own interface, and no pool's method is
replaced (series entry "Allocation: a rank-local pool takes the agreed deficit through its own
interface; no pool is patched", sgl-project/sglang#34676).

Before the entry the rank agreement replaced `available_size` on the live objects of every
rank-local pool, so every reader in the process read the ledger without the pool knowing. Now a
rank-local pool offers `uniform_available_size()`, `real_available_size()` and
`agree_deficit(deficit)` (kvcached's elastic pools do; the harness's kvcached-shaped allocator
too), the agreement hands it the deficit each vote agreed, and a pool without the interface is
refused at start-up, naming what it lacks.

Expected: FAIL without the entry (the agreement replaces the allocator's `available_size`, hands
no deficit, and takes a pool with a uniform reading alone) and PASS with it.
"""

from __future__ import annotations

from typing import Any

import pytest
import scheduler_harness as sh
from test_prefill_unwind import _prompt

# What the agreement watches on a rank-local pool (a later entry: an allocation no vote covers is
# counted): it wraps these, calling through; every other method, the readings among them, stays
# the pool's own.
WATCHED = ("alloc", "alloc_extend", "alloc_decode")


def _methods(pool: Any) -> dict[str, Any]:
    return {name: value for name, value in vars(pool).items() if callable(value) and name not in WATCHED}


def test_the_agreement_replaces_no_method_of_a_pool_and_hands_it_the_deficit() -> None:
    with sh.build_harness(elastic=True) as h:
        allocator, physical = h.token_to_kv_pool_allocator, h.physical
        assert physical is not None
        before = _methods(allocator)
        assert h.scheduler._prefill_agreement is not None
        physical.take(40)  # a co-tenant holds 40 tokens of this GPU's memory
        h.add_request(_prompt(0))
        batch = h.run_round()
        assert batch is not None
        assert _methods(allocator) == before
        assert physical.agreed_deficit == 40  # one rank: its own deficit is the group's
        assert allocator.available_size() == physical.uniform() - 40 == physical.available()


def test_a_rank_local_pool_without_the_interface_is_refused_naming_what_it_lacks() -> None:
    with sh.build_harness() as h:
        allocator = h.token_to_kv_pool_allocator
        allocator.rank_local_capacity = True
        allocator.uniform_available_size = allocator.available_size
        with pytest.raises(
            ValueError, match=r"TokenToKVPoolAllocator \(real_available_size\(\), agree_deficit\(\)\)"
        ):
            h.scheduler._prefill_agreement  # noqa: B018  (the property is what refuses)
