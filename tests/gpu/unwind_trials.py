"""One unwound prefill round on the GPU, for the hazard and cost tests.

The harness (tests/upstream/sglang/scheduler_harness.py) with `device="cuda"`: the real
Scheduler prefill round, real pools on the GPU, the real HiCache controller and
`HiCacheController.start_loading`, the real `LayerDoneCounter` and `L2TransferEngine` (host->device
copies on its own CUDA stream, fenced behind the forward stream). Only the model worker is a
stand-in; its forward stream gets a long kernel (`torch.cuda._sleep`) where a forward is in flight.

A trial:
1. every device slot and KV page holds LOADED; a prefix is cached, written through to host
   (so its host copy holds LOADED) and evicted from the device; then the device pools are zeroed;
2. a request that hits that prefix on host (its load-back takes a Mamba slot and KV pages, and
   `start_loading` queues the copies) and a fresh request are admitted; the fresh request's token
   allocation misses inside `prepare_for_extend`, so the round unwinds;
3. right after the unwind returns, every load target the unwind freed is taken by the next owner,
   which writes its own state (OWNED) on its own stream;
4. after the device drained: a freed target that does not hold OWNED everywhere is torn (the
   load landed after, or into the middle of, the new owner's write).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast
from unittest import mock

import scheduler_harness as sh
import torch
from sglang.srt.managers.scheduler import Scheduler

LOADED = 1.0  # what the host copy holds, so what a load writes
OWNED = 2.0  # what the freed target's next owner writes
PREFIX = list(range(100, 164))  # 64 tokens
FRESH = list(range(1000, 1020))
# Mamba2 state of 128 heads x 64 x 512 float32 = 16 MiB a slot: its copy takes milliseconds.
GPU_HARNESS: dict[str, Any] = {
    "device": "cuda",
    "hicache": True,
    "mamba": True,
    "mamba_heads": 128,
    "mamba_head_dim": 64,
    "mamba_state_size": 512,
    "mamba_slots": 6,
    "req_rows": 4,
    "kv_tokens": 512,
}


def sleep_cycles(ms: float) -> int:
    """Clock cycles for `torch.cuda._sleep` to spin about `ms` milliseconds on this device."""
    rate_khz = getattr(torch.cuda.get_device_properties(0), "clock_rate", 0) or 1_500_000
    return int(ms * rate_khz)


@dataclass
class LoadCapture:
    """The device indices every host->device submission writes into, by pool."""

    mamba: set[int] = field(default_factory=set)
    kv: set[int] = field(default_factory=set)


@contextlib.contextmanager
def capture_loads(h: sh.Harness) -> Iterator[LoadCapture]:
    """Record the targets of the real engine's submissions (the real method still runs)."""
    controller = h.tree_cache.cache_controller
    assert controller is not None
    engine = controller.l2_transfer_engine
    real = engine.submit_host_to_device
    mamba_pool = h.req_to_token_pool.mamba_pool
    captured = LoadCapture()

    def submit_host_to_device(transfers: list[Any], **kwargs: Any) -> Any:
        for t in transfers:
            target = captured.mamba if t.device_pool is mamba_pool else captured.kv
            target.update(int(i) for i in t.device_indices.flatten().tolist())
        return real(transfers, **kwargs)

    with mock.patch.object(engine, "submit_host_to_device", submit_host_to_device):
        yield captured


def _mamba_state(h: sh.Harness) -> torch.Tensor:
    return cast(torch.Tensor, h.req_to_token_pool.mamba_pool.mamba_cache.temporal)  # [layers, slots, ...]


def _kv_buffers(h: sh.Harness) -> list[torch.Tensor]:
    kvcache = h.token_to_kv_pool_allocator.get_kvcache()
    full = getattr(kvcache, "full_kv_pool", kvcache)
    return [*full.k_buffer, *full.v_buffer]


def fill_device(h: sh.Harness, value: float) -> None:
    _mamba_state(h).fill_(value)
    for buf in _kv_buffers(h):
        buf.fill_(value)
    torch.cuda.synchronize()


def free_mamba_slots(h: sh.Harness) -> set[int]:
    return {int(i) for i in h.req_to_token_pool.mamba_allocator.free_slots.tolist()}


def free_kv_slots(h: sh.Harness) -> set[int]:
    allocator = h.token_to_kv_pool_allocator
    free = {int(i) for i in allocator.free_pages.tolist()}
    release = getattr(allocator, "release_pages", None)
    if release is not None:
        free |= {int(i) for i in release.tolist()}
    return free


@dataclass
class Trial:
    freed_mamba: list[int]
    freed_kv: list[int]
    torn_mamba: bool
    torn_kv: bool
    wait_seconds: float  # host time in the unwind's wait (0.0 when not timed)


def setup_host_prefix(h: sh.Harness) -> None:
    h.reset()
    fill_device(h, LOADED)
    h.put_prefix_on_host(PREFIX)  # write-through (D2H of LOADED), then evicted from the device
    fill_device(h, 0.0)


def unwind_once(
    h: sh.Harness,
    forward_ms: float,
    other_stream_ms: float = 0.0,
    wait: Callable[..., None] | None = None,
) -> Trial:
    """One trial (module docstring). `forward_ms`: a forward kernel in flight when the round
    starts (the load is fenced behind it). `other_stream_ms`: device work on another stream,
    queued after the load started (a device-wide synchronize waits for it, the event does not).
    `wait`: replaces Scheduler._wait_for_batch_host_load (None: the tree's own)."""
    setup_host_prefix(h)
    forward = h.scheduler.tp_worker.model_runner.forward_stream
    # torch.cuda.Stream, torch.cuda.Event and torch.cuda._sleep are unannotated (here and below).
    other, writer = torch.cuda.Stream(), torch.cuda.Stream()  # type: ignore[no-untyped-call]
    h.add_request([*PREFIX, 7, 8, 9])
    h.add_request(FRESH)
    real_ready = h.tree_cache.ready_to_load_host_cache

    def ready_to_load_host_cache() -> int:
        index: int = real_ready()
        if other_stream_ms:
            with torch.cuda.stream(other):
                torch.cuda._sleep(sleep_cycles(other_stream_ms))  # type: ignore[no-untyped-call]
        return index

    real_wait = Scheduler._wait_for_batch_host_load
    waited = [0.0]

    def timed_wait(self: Scheduler, batch: Any, miss: Any = None) -> None:
        started = time.perf_counter()
        (wait or real_wait)(self, batch, miss)
        waited[0] += time.perf_counter() - started

    if forward_ms:
        with torch.cuda.stream(forward):
            torch.cuda._sleep(sleep_cycles(forward_ms))  # type: ignore[no-untyped-call]
    with (
        capture_loads(h) as loads,
        mock.patch.object(h.tree_cache, "ready_to_load_host_cache", ready_to_load_host_cache),
        mock.patch.object(Scheduler, "_wait_for_batch_host_load", timed_wait),
        h.arm_miss("token_slots") as reported,
    ):
        batch = h.run_round()
        # Right after the unwind returned: the next owner takes what was freed and writes.
        freed_mamba = sorted(loads.mamba & free_mamba_slots(h))
        freed_kv = sorted(loads.kv & free_kv_slots(h))
        with torch.cuda.stream(writer):
            if freed_mamba:
                _mamba_state(h)[:, freed_mamba] = OWNED
            if freed_kv:
                for buf in _kv_buffers(h):
                    buf[freed_kv] = OWNED
    assert batch is None and reported == ["token_slots"], "the round must unwind on the injected miss"
    assert loads.mamba and loads.kv, "the host hit must load a Mamba slot and KV pages back"
    torch.cuda.synchronize()
    torn_mamba = bool(freed_mamba) and not bool((_mamba_state(h)[:, freed_mamba] == OWNED).all())
    torn_kv = bool(freed_kv) and not all(bool((buf[freed_kv] == OWNED).all()) for buf in _kv_buffers(h))
    return Trial(freed_mamba, freed_kv, torn_mamba, torn_kv, waited[0])


def no_wait(self: Scheduler, batch: Any, miss: Any = None) -> None:
    """Series entry 0002 removed: the unwind releases at once."""


def device_sync_wait(self: Scheduler, batch: Any, miss: Any = None) -> None:
    """The alternative the cost test compares with: a device-wide synchronize."""
    if batch.hicache_consumer_index >= 0:
        torch.cuda.synchronize()


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000.0


def forward_kernel_ms(forward_ms: float, runs: int = 5) -> float:
    """What `forward_ms` of `torch.cuda._sleep` takes on this device, timed with CUDA events."""
    times: list[float] = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        torch.cuda._sleep(sleep_cycles(forward_ms))  # type: ignore[no-untyped-call]
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
