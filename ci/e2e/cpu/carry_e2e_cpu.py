"""Stand-ins at the kernel and hardware boundary for a real sglang server on CPU (e2e only).

Loaded by ci/e2e/hook/sitecustomize.py when CARRY_E2E_CPU=1, i.e. only in the e2e's server
processes (run_e2e.py --device cpu puts this folder on their PYTHONPATH); never in a unit-test
environment or a built wheel. Nothing in sglang's scheduler or mem-cache code changes:

- streams and events (torch.cpu's are no-ops, so on CPU a HiCache load would land inside
  start_loading and a missing wait could never show): `Event` completes when its record is
  reached on its stream; HiCache's two copy streams (L2TransferEngine's, and only those) are
  `CopyStream`s, which run their queued work later, in order, on a worker thread, each copy
  after COPY_DELAY_S; every other stream is host-synchronous, so waiting on an event from one
  (LayerLoadingEvent.wait in the forward) blocks the host until the copy landed;
- the two HiCache copy kernels the dense path calls (pool_host/mha.py binds them only on
  CUDA/HIP/XPU), in plain torch over the same raw rows, queued on the current stream;
- the host pool's allocation (the default pins and cudaHostRegisters it): plain memory.
The sgl_kernel CPU ops are the sibling package sgl_kernel/.

Every host wait is bounded (WAIT_TIMEOUT_S): a lost record fails loudly instead of hanging.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

COPY_DELAY_S = float(os.environ.get("CARRY_E2E_COPY_DELAY_S", "0.05"))
WAIT_TIMEOUT_S = 300.0


class Event:
    """torch.cpu.Event with CUDA's meaning: a wait covers the last record() made before it, and
    that record completes when its stream reaches it (at once on a host-synchronous stream)."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self._changed = threading.Condition()
        self._issued = 0
        self._completed = 0
        self._completed_at = 0.0

    def record(self, stream: Any = None) -> None:
        stream = current_stream() if stream is None else stream
        with self._changed:
            self._issued += 1
            target = self._issued
        if isinstance(stream, CopyStream):
            stream.enqueue(lambda: self._complete(target))
        else:
            self._complete(target)

    def _complete(self, target: int) -> None:
        with self._changed:
            self._completed = max(self._completed, target)
            self._completed_at = time.monotonic()
            self._changed.notify_all()

    def _wait_for(self, target: int) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: self._completed >= target, WAIT_TIMEOUT_S):
                raise RuntimeError(f"carry-e2e-cpu: an event was not reached within {WAIT_TIMEOUT_S} s")
        raise_copy_failures()

    def _pending_target(self) -> int:
        with self._changed:
            return self._issued

    def query(self) -> bool:
        with self._changed:
            return self._completed >= self._issued

    def synchronize(self) -> None:
        self._wait_for(self._pending_target())

    def wait(self, stream: Any = None) -> None:
        (current_stream() if stream is None else stream).wait_event(self)

    def elapsed_time(self, end: Event) -> float:
        return (end._completed_at - self._completed_at) * 1000.0


class HostStream:
    """Every stream but HiCache's copy streams: its work runs on the host as it is issued."""

    def __init__(self, priority: int = 0, **_: Any) -> None:
        self.priority = priority

    def wait_event(self, event: Event) -> None:
        event._wait_for(event._pending_target())

    def wait_stream(self, stream: Any) -> None:
        if isinstance(stream, CopyStream):
            stream.synchronize()

    def record_event(self, event: Event | None = None) -> Event:
        event = Event() if event is None else event
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> HostStream:
        _enter(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _exit()


class CopyStream(HostStream):
    """A HiCache copy stream: what is queued on it runs later, in order, on its own worker."""

    def __init__(self, name: str, delay_s: float = COPY_DELAY_S) -> None:
        super().__init__()
        self.name, self.delay_s = name, delay_s
        self._work: queue.Queue[tuple[Callable[[], None], bool]] = queue.Queue()
        self._failure: BaseException | None = None
        threading.Thread(target=self._run, name=f"carry-e2e-{name}", daemon=True).start()

    def enqueue(self, work: Callable[[], None], delayed: bool = False) -> None:
        self.raise_failure()
        self._work.put((work, delayed))

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise RuntimeError(f"carry-e2e-cpu: {self.name} failed earlier: {self._failure!r}")

    def _run(self) -> None:
        while True:
            work, delayed = self._work.get()
            try:
                if delayed:
                    time.sleep(self.delay_s)
                work()
            except BaseException as error:  # surfaced on the next enqueue, never swallowed
                self._failure = error
            finally:
                self._work.task_done()

    def wait_event(self, event: Event) -> None:
        target = event._pending_target()
        self.enqueue(lambda: event._wait_for(target))

    def wait_stream(self, stream: Any) -> None:
        if isinstance(stream, CopyStream) and stream is not self:
            self.wait_event(stream.record_event())

    def synchronize(self) -> None:
        self.record_event().synchronize()

    def query(self) -> bool:
        return self._work.unfinished_tasks == 0


_DEFAULT_STREAM = HostStream()
_local = threading.local()


def current_stream(device: Any = None) -> HostStream:
    stack: list[HostStream] = getattr(_local, "streams", [])
    return stack[-1] if stack else _DEFAULT_STREAM


def _enter(stream: HostStream) -> None:
    if not hasattr(_local, "streams"):
        _local.streams = []
    _local.streams.append(stream)


def _exit() -> None:
    _local.streams.pop()


class StreamContext:
    """`torch.cpu.stream(s)`: re-enterable, as sglang keeps one and enters it every batch."""

    def __init__(self, selected: HostStream | None) -> None:
        self.selected = selected

    def __enter__(self) -> None:
        if self.selected is not None:
            _enter(self.selected)

    def __exit__(self, *exc: object) -> None:
        if self.selected is not None:
            _exit()


def stream(selected: HostStream | None) -> StreamContext:
    return StreamContext(selected)


_copy_streams: list[CopyStream] = []


def raise_copy_failures() -> None:
    """After any wait: a copy that failed must not pass for one that landed."""
    for copy_stream in _copy_streams:
        copy_stream.raise_failure()


def synchronize(device: Any = None) -> None:
    for copy_stream in _copy_streams:
        copy_stream.synchronize()


def on_current_stream(work: Callable[[], None]) -> None:
    """Run a copy as a kernel launch would: queued on a copy stream, else at once."""
    selected = current_stream()
    if isinstance(selected, CopyStream):
        selected.enqueue(work, delayed=True)
    else:
        work()


# --------------------------------------------------------------------------------------------
# The HiCache copy kernels (sgl_kernel.kvcacheio), over raw rows as the CUDA kernels see them
# --------------------------------------------------------------------------------------------
def rows_at(address: int, rows: int, row_bytes: int) -> torch.Tensor:
    """`rows` rows of `row_bytes` bytes at a raw address (a device layer's data pointer)."""
    buffer = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(rows, row_bytes)


def byte_rows(tensor: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """A tensor's memory as rows of bytes (a view: a non-contiguous tensor fails loudly)."""
    return tensor.view(torch.uint8).view(-1, row_bytes)


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
) -> None:
    """Load one layer: host page-first rows (all layers of a token together) to a device layer."""
    src_at, dst_at = src_indices.long().clone(), dst_indices.long().clone()
    start = layer_id * item_size

    def copy() -> None:
        for src, dst in ((src_k, dst_k), (src_v, dst_v)):
            byte_rows(dst, item_size)[dst_at] = byte_rows(src, src_layout_dim)[
                src_at, start : start + item_size
            ]

    on_current_stream(copy)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
) -> None:
    """Back up every layer: device layers (by data pointer) to host page-first rows."""
    src_at, dst_at = src_indices.long().clone(), dst_indices.long().clone()
    if src_at.numel() == 0:
        return
    rows = int(src_at.max()) + 1
    pointers = [(int(k), int(v)) for k, v in zip(src_k_layers.tolist(), src_v_layers.tolist(), strict=True)]

    def copy() -> None:
        for layer, (k_address, v_address) in enumerate(pointers[:num_layers]):
            start = layer * item_size
            for address, dst in ((k_address, dst_k), (v_address, dst_v)):
                source = rows_at(address, rows, item_size)[src_at]
                byte_rows(dst, dst_layout_dim)[dst_at, start : start + item_size] = source

    on_current_stream(copy)


COPY_KERNELS = {
    "transfer_kv_per_layer_pf_lf": transfer_kv_per_layer_pf_lf,
    "transfer_kv_all_layer_lf_pf": transfer_kv_all_layer_lf_pf,
}


# --------------------------------------------------------------------------------------------
# Patches, each applied right after its module has run (the hook's AfterImport)
# --------------------------------------------------------------------------------------------
def patch_torch_cpu(module: Any) -> None:
    module.Event, module.Stream = Event, HostStream
    module.current_stream, module.stream, module.synchronize = current_stream, stream, synchronize


def patch_l2_transfer(module: Any) -> None:
    engine = module.L2TransferEngine
    real_init = engine.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self.device_to_host_stream = CopyStream("device-to-host")
        self.host_to_device_stream = CopyStream("host-to-device")
        _copy_streams.extend([self.device_to_host_stream, self.host_to_device_stream])

    engine.__init__ = __init__


def patch_host_pool_kernels(module: Any) -> None:
    for name, kernel in COPY_KERNELS.items():
        if not hasattr(module, name):  # bound only on CUDA/HIP/XPU
            setattr(module, name, kernel)


def patch_host_allocation(module: Any) -> None:
    registered_ranges = getattr(module, "_CUDA_HOST_REGISTERED_RANGES_ATTR", None)

    def alloc_plain(dims: tuple[int, ...], dtype: torch.dtype, device: str, *args: Any, **kwargs: Any) -> Any:
        buffer = torch.zeros(dims, dtype=dtype, device="cpu")
        if registered_ranges is not None:
            setattr(buffer, registered_ranges, [])  # nothing for destroy() to unregister
        return buffer

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain


def patch_host_pool_pinning(module: Any) -> None:
    """Page-locking host memory needs the CUDA driver; on CPU a host pool's pages are plain memory
    (alloc_plain), so the pool must not ask for pinned tensors later either: HiCache's L3 page reads
    allocate their bounce pages with the pool's pin_memory (pool_host/mha.py,
    get_dummy_flat_data_page), which raises "Found no NVIDIA driver" on a CPU torch."""
    pool = module.HostKVCache
    real_init = pool.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        self.pin_memory = False

    pool.__init__ = __init__


def install() -> dict[str, Callable[[Any], None]]:
    """Patch torch.cpu now (torch is imported by this module); return the module patches."""
    patch_torch_cpu(torch.cpu)
    return dict(PATCHES)


PATCHES: dict[str, Callable[[Any], None]] = {
    "sglang.srt.mem_cache.l2_transfer": patch_l2_transfer,
    "sglang.srt.mem_cache.pool_host.mha": patch_host_pool_kernels,
    "sglang.srt.mem_cache.pool_host.common": patch_host_allocation,
    "sglang.srt.mem_cache.pool_host.base": patch_host_pool_pinning,
}
