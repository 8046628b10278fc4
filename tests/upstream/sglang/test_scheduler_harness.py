"""Smoke tests of the CPU harness around the real `Scheduler._get_new_batch_prefill_raw`.

They pass on the pristine 0.5.20 tree and on every patched one: they check the harness, not a fix.
"""

from __future__ import annotations

from typing import Any

import pytest
import scheduler_harness as sh

PREFIX = list(range(100, 132))  # 32 tokens: whole pages for page_size 1 and 4

CONFIGS = {
    "page1": {},
    "page4": {"page_size": 4},
    "mamba": {"mamba": True},
    "mamba_ping_pong": {"mamba": True, "ping_pong": True},
}


def _prompt(i: int, length: int) -> list[int]:
    return list(range(10 + 100 * i, 10 + 100 * i + length))


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_three_requests_allocate(config: dict[str, Any]) -> None:
    with sh.build_harness(**config) as h:
        lengths = [20, 21, 24]
        reqs = [h.add_request(_prompt(i, n)) for i, n in enumerate(lengths)]
        before = h.free_counts()

        batch = h.run_round()

        assert batch is not None and batch.reqs == reqs
        assert batch.hicache_consumer_index == -1  # no HiCache: scheduler.py:4012 not taken
        assert h.scheduler.waiting_queue == []
        after = h.free_counts()
        assert before["req_rows"] - after["req_rows"] == 3
        page = h.cfg.page_size
        assert before["kv_tokens"] - after["kv_tokens"] == sum(-(-n // page) * page for n in lengths)
        if h.cfg.mamba:
            per_req = 3 if h.cfg.ping_pong else 1  # state slot + 2 ping-pong track slots
            assert before["mamba_slots"] - after["mamba_slots"] == 3 * per_req
        assert all(r.kv.req_pool_idx is not None for r in reqs)


HICACHE_CONFIGS = {
    "page1": {"hicache": True},
    "page4": {"hicache": True, "page_size": 4},
    "mamba_ping_pong": {"hicache": True, "mamba": True, "ping_pong": True},
}


@pytest.mark.parametrize("config", HICACHE_CONFIGS.values(), ids=HICACHE_CONFIGS.keys())
def test_host_hit_starts_a_load(config: dict[str, Any]) -> None:
    with sh.build_harness(**config) as h:
        h.put_prefix_on_host(PREFIX)
        h.device_log.clear()
        hit = h.add_request([*PREFIX, 7, 8, 9])
        miss = h.add_request(_prompt(1, 20))

        batch = h.run_round()

        assert batch is not None and batch.reqs == [hit, miss]
        assert batch.hicache_consumer_index >= 0
        slot = batch.hicache_consumer_index
        assert sh.prefix_len(hit) == len(PREFIX)  # loaded back, not recomputed
        log = h.device_log
        layers = [f"load{slot}.layer{i}" for i in range(h.layer_done_counter.num_layers)]
        # start_loading (cache_controller.py:941-978): reuse check, start event, fence, copies.
        assert log.entries[0] == ("query", layers[-1])
        assert log.ops("record")[0] == f"load{slot}.start"
        assert ("wait_stream", "h2d<-forward") in log.entries
        assert [name for name in log.ops("record") if name.startswith(f"load{slot}.layer")] == layers
        assert log.index("record", f"load{slot}.start") < log.index("record", layers[0])
        assert h.transfer_engine is not None and h.transfer_engine.submissions[-1][0] == "h2d"


def test_load_stays_pending_until_synchronized() -> None:
    """With auto_complete_events=False a started load is in flight until a host wait, which is
    what an unwind must order its frees behind (the slot's finish_event, its last layer)."""
    with sh.build_harness(hicache=True, auto_complete_events=False) as h:
        h.put_prefix_on_host(PREFIX)
        h.add_request([*PREFIX, 7, 8, 9])

        batch = h.run_round()

        assert batch is not None and batch.hicache_consumer_index >= 0
        finish = h.layer_done_counter.events[batch.hicache_consumer_index].finish_event
        assert finish.query() is False
        finish.synchronize()
        assert finish.query() is True
        assert ("synchronize", finish.name) in h.device_log.entries


def test_close_restores_patches_and_context() -> None:
    from sglang.srt import runtime_context
    from sglang.srt.managers import cache_controller

    real_device_module = cache_controller.device_module
    with sh.build_harness(hicache=True) as h:
        assert cache_controller.device_module is h.device
        assert runtime_context.get_memory().enable_hierarchical_cache
    assert cache_controller.device_module is real_device_module
