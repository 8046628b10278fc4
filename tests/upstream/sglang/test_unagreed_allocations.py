"""An allocation from a rank-local pool that no vote of the ranks' agreement covers is found the
first time it runs (series entry "Scheduler: an allocation from a rank-local pool that no vote
covers is counted and named", sgl-project/sglang#34676).

The ranks of a group part when one of them allocates from a pool whose free space is per rank
(kvcached's) where no vote settles the allocation: it reads its own free space, its peers theirs.
Reviews found such paths one by one (HiCache's buffer_only load-back, dLLM's batches); the agreement
now watches every allocating method of every rank-local pool, and an allocation made outside the
sites it settles (a prefill round, a decode step, a HiCache load-back) is counted per caller and
logged, rate-limited, naming its callers, in sglang:num_unagreed_allocations_total; with
SGLANG_RANK_AGREEMENT_STRICT (every test here, tests/upstream/conftest.py) it raises.

The paths are driven for real on a harness with a kvcached-shaped rank-local KV allocator: dLLM's
`_create_dllm_batch` (its plain `prepare_for_extend`), and the HiCache controller's `load` as
buffer mode's pipeline calls it (`BufferModePipeline._allocate_and_queue_load_back`, outside the
agreed load-back). Both are refused at start-up with more than one rank per group (the refusal
entry); the watch is what finds the next one.

Expected: FAIL without the entry (no watch: the allocations pass unseen) and PASS with it.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import scheduler_harness as sh
import torch
from sglang.srt.managers.scheduler import Scheduler
from test_prefill_unwind import _prompt


def _watch_started(h: sh.Harness) -> Any:
    """The scheduler's agreement (built at start-up; the watch with it)."""
    agreement = h.scheduler._prefill_agreement
    assert agreement is not None
    return agreement


def _dllm_batch(h: sh.Harness) -> None:
    """dLLM's batch creation, as get_new_batch_dllm calls it, for one admitted request."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    req = h.make_req(_prompt(0, 24), rid="dllm")
    req.init_next_round_input(h.tree_cache)
    # What admission (PrefillAdder) sets for a whole prompt with no cached prefix.
    if hasattr(req, "set_extend_range"):  # up to 0.5.21
        req.set_extend_range(0, len(req.origin_input_ids))
    else:
        req.extend_end = len(req.origin_input_ids)
    sched = h.scheduler
    Scheduler._create_dllm_batch(sched, [req], ForwardMode.EXTEND, None, sched.running_batch)


def test_a_dllm_batch_allocated_outside_the_votes_is_found_naming_its_caller() -> None:
    with sh.build_harness(elastic=True) as h:
        _watch_started(h)
        with pytest.raises(Exception, match="outside every vote") as raised:
            _dllm_batch(h)
    assert type(raised.value).__name__ == "UnagreedAllocation"
    assert "_create_dllm_batch" in str(raised.value) and "prepare_for_extend" in str(raised.value)


def test_a_buffer_mode_load_back_outside_the_agreed_one_is_found() -> None:
    with sh.build_harness(elastic=True, hicache=True) as h:
        _watch_started(h)
        controller = h.tree_cache.cache_controller
        with pytest.raises(Exception, match="outside every vote") as raised:
            controller.load(host_indices=torch.arange(4), node_id=1)
        controller.load_queue.clear()
    assert type(raised.value).__name__ == "UnagreedAllocation"


def test_the_agreed_sites_allocate_unseen() -> None:
    """A prefill round and its decode steps allocate inside the sites the agreement settles:
    nothing is counted (the whole suite runs strict, so any other agreed path shows the same)."""
    with sh.build_harness(elastic=True) as h:
        agreement = _watch_started(h)
        sched = h.scheduler
        sched.enable_skip_finishing_decode = False
        sched.decode_offload_manager = None
        h.add_request(_prompt(1))
        batch = h.run_round()
        assert batch is not None
        sched.running_batch = batch
        for req in batch.reqs:
            req.output_ids.append(7)
        assert sched.update_running_batch(batch) is not None
        assert agreement.unagreed.count == 0


def test_a_server_counts_and_logs_it(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Not strict (a server): counted per caller, in the Prometheus counter, and one warning
    naming the callers; the allocation itself goes ahead."""
    monkeypatch.setenv("SGLANG_RANK_AGREEMENT_STRICT", "0")
    with sh.build_harness(elastic=True) as h:
        metrics = h.enable_metrics()
        agreement = _watch_started(h)
        with caplog.at_level(logging.WARNING):
            h.make_req(_prompt(2))
            indices = h.token_to_kv_pool_allocator.alloc(8)
            indices_again = h.token_to_kv_pool_allocator.alloc(8)
        assert indices is not None and indices_again is not None
        counted = dict(agreement.unagreed.by_caller)
    assert sum(counted.values()) == 2 and len(counted) == 2
    assert all("test_unagreed_allocations.py" in caller for caller in counted)
    assert metrics["sglang:num_unagreed_allocations_total"].total == 2
    warnings = [r.getMessage() for r in caplog.records if "outside every vote" in r.getMessage()]
    assert len(warnings) == 1 and "TokenToKVPoolAllocator.alloc()" in warnings[0]
