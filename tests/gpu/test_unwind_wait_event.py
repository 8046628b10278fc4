"""On a real GPU: the unwind's wait blocks on the batch's real CUDA finish_event, and only on it.

The CPU tests fake the device event; this checks the same method against torch.cuda events and
a busy copy stream (tests/conftest.py skips it without CUDA, fails it with CARRY_REQUIRE_GPU=1).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.gpu

BUSY_CYCLES = 500_000_000  # a few hundred ms of device time standing in for the layer copies


def test_unwind_waits_for_the_real_finish_event_of_its_own_slot() -> None:
    from sglang.srt.managers.cache_controller import LayerDoneCounter
    from sglang.srt.managers.scheduler import Scheduler

    if not hasattr(Scheduler, "_wait_for_batch_host_load"):
        pytest.skip("this tree has no unwind wait (pristine, or without its series entry)")

    counter = LayerDoneCounter(num_layers=2)
    # torch.cuda.Stream and torch.cuda._sleep are unannotated.
    copy_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(copy_stream):
        counter.events[2].complete(0)
        counter.events[2].complete(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(copy_stream):
        torch.cuda._sleep(BUSY_CYCLES)  # type: ignore[no-untyped-call]
        counter.events[0].complete(0)
        counter.events[0].complete(1)
    assert not counter.events[0].finish_event.query(), "the load must still be in flight"

    # Only the attributes _wait_for_batch_host_load reads: the controller's real LayerDoneCounter.
    scheduler = Scheduler.__new__(Scheduler)
    scheduler.enable_hierarchical_cache = True
    scheduler.tree_cache = SimpleNamespace(
        linker=None, cache_controller=SimpleNamespace(layer_done_counter=counter)
    )
    started = time.perf_counter()
    scheduler._wait_for_batch_host_load(SimpleNamespace(hicache_consumer_index=0), None)
    waited = time.perf_counter() - started

    assert counter.events[0].finish_event.query()
    assert waited > 0.01, "the wait returned before the copy stream finished"
    scheduler._wait_for_batch_host_load(SimpleNamespace(hicache_consumer_index=-1), None)
