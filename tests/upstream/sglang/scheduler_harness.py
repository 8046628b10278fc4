"""Drive the REAL sglang `Scheduler._get_new_batch_prefill_raw` on CPU, on every carried line
(0.5.20 to 0.5.23).

`build_harness()` makes a `Scheduler` with `Scheduler.__new__` (its __init__ loads a model, binds
ZMQ sockets and starts threads) and sets only the attributes that `_get_new_batch_prefill_raw`
and what it calls read. Everything below that method is upstream code: `PrefillAdder`,
`SchedulePolicy`, `Req`, `ScheduleBatch.init_new` / `prepare_for_extend`, `alloc_for_extend`, the
pools and allocators, `UnifiedRadixCache` (built by the upstream registry, as
`kv_cache_builder.build_kv_cache` does) and, with `hicache=True`, its `HybridCacheController`,
`LayerDoneCounter` and host pools.

Fakes sit only at the hardware / I-O boundary:
- `FakeDeviceModule` replaces `device_module` (torch.cpu has no-op streams and events) in
  `managers/cache_controller.py` and `mem_cache/l2_transfer.py`; its events and streams append
  to one ordered log (`Harness.device_log`), and its events can stay pending (`auto_complete`).
- `FakeL2TransferEngine` replaces `L2TransferEngine` in `cache_controller.py`: it logs each
  submission and, for a load, makes the same event calls as the real engine and calls
  `on_layer_done(layer)` for every layer, without copying data.
- `CpuModelWorker` stands in for the TP model worker (it owns the model and the GPU streams).
  The `ModelConfig` is real, read from a tiny Llama config.json; with `mamba=True` the pools
  are hybrid (layer 0 attention, layer 1 Mamba2) and the registry is told `is_hybrid_ssm`.
- The paged allocator's Triton kernel `alloc_extend_kernel` cannot launch without a GPU driver; it
  is swapped for upstream's own torch port `alloc_extend_naive` (what the NPU allocator runs), and
  `alloc_decode_kernel` (launched on every device up to 0.5.21) for `NaiveAllocDecodeKernel`.
- `cudaHostRegister` of the HiCache host pools (page-locking) is a no-op; the buffers are real.
- `Harness.arm_miss()` makes one real pool report a miss (its alloc returns None).
- With `device="cuda"` (tests/gpu/) nothing of the above is faked but the model worker: the
  pools live on the GPU, `device_module` is torch.cuda, and the real `L2TransferEngine` copies
  host->device on its own stream; `Harness.device` then synchronizes the real device.
- `FakeCacheLinker` can be set as `tree_cache.linker`: the external cache linker is I/O (it loads
  on its own thread from a remote store).

Between rounds, `Harness.prepare_next_round()` does what the event loop does before the next round
(HiCache event polling, caching the chunked request's last chunk, clearing batch_is_full once
requests finished) and `finish_request()` releases a request as the result processor does.

Where the upstream API differs between the lines, the harness feature-detects the imported tree
(never its version number): constructor keywords are passed by signature (`_construct`), and a
request's span is read through `prefix_len` / `extend_start` / `extend_end`. The tests' assertions
are the same on every line.

Line numbers in comments are for python/sglang/srt/managers/scheduler.py at 0.5.20 unless named.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import itertools
import json
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal
from unittest import mock

import torch
from sglang.srt import runtime_context
from sglang.srt.beam_search.coordinator import BeamCoordinator
from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.constrained.grammar_manager import GrammarManager
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.managers import cache_controller
from sglang.srt.managers import schedule_batch as schedule_batch_module
from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req, ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker
from sglang.srt.managers.scheduler_components.load_inquirer import SchedulerLoadInquirer
from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver
from sglang.srt.mem_cache import l2_transfer
from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    alloc_extend_naive,
)
from sglang.srt.mem_cache.allocator import paged as paged_allocator
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.memory_pool import (
    HybridLinearKVPool,
    HybridReqToTokenPool,
    MHATokenToKVPool,
    ReqToTokenPool,
)
from sglang.srt.mem_cache.pool_host import common as host_pool_common
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
from sglang.srt.observability.metrics_collector import SchedulerMetricsCollector
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.session.session_controller import Session
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

MissSite = Literal["req_rows", "token_slots", "paged_extend", "mamba_slot", "ping_pong"]

# A 2-layer model: layer 0 is full attention; with `mamba=True` layer 1 is a Mamba2 layer.
NUM_LAYERS = 2
KV_HEADS = 2
HEAD_DIM = 16
VOCAB = 1000
_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": NUM_LAYERS,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "torch_dtype": "float32",
    "eos_token_id": 2,
    "bos_token_id": 1,
}


# --------------------------------------------------------------------------------------------
# Hardware boundary: device events and streams
# --------------------------------------------------------------------------------------------
@dataclass
class DeviceLog:
    """Ordered record of every event/stream/transfer call; entries are (op, name) tuples."""

    entries: list[tuple[str, str]] = field(default_factory=list)

    def add(self, op: str, name: str) -> None:
        self.entries.append((op, name))

    def ops(self, op: str) -> list[str]:
        return [name for o, name in self.entries if o == op]

    def index(self, op: str, name: str) -> int:
        return self.entries.index((op, name))

    def clear(self) -> None:
        self.entries.clear()


class FakeEvent:
    """Stands in for torch.cuda.Event. A recorded event is pending until `synchronize()` (a host
    wait) or `FakeDeviceModule.complete_all()`; with `auto_complete` it completes on record.
    An event that was never recorded is complete, as on CUDA."""

    def __init__(self, device: FakeDeviceModule, enable_timing: bool = False) -> None:
        self._device = device
        self.name = f"ev{next(device.counter)}"
        self.recorded = False
        self.done = True
        device.events.append(self)

    def record(self, stream: Any = None) -> None:
        self.recorded = True
        self.done = self._device.auto_complete
        self._device.log.add("record", self.name)

    def query(self) -> bool:
        self._device.log.add("query", self.name)
        return self.done

    def synchronize(self) -> None:
        self._device.log.add("synchronize", self.name)
        self.done = True

    def wait(self, stream: Any = None) -> None:
        self._device.log.add("wait", f"{getattr(stream, 'name', 'current')}<-{self.name}")

    def elapsed_time(self, end_event: FakeEvent) -> float:
        return 0.0


class FakeStream:
    def __init__(self, device: FakeDeviceModule, name: str | None = None, **_: Any) -> None:
        self._device = device
        self.name = name or f"stream{next(device.counter)}"

    def wait_stream(self, other: FakeStream) -> None:
        self._device.log.add("wait_stream", f"{self.name}<-{getattr(other, 'name', other)}")

    def wait_event(self, event: FakeEvent) -> None:
        self._device.log.add("wait", f"{self.name}<-{event.name}")

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self._device)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self._device.log.add("stream_synchronize", self.name)


class FakeDeviceModule:
    """What `get_device_module()` returns, as far as cache_controller.py and l2_transfer.py use
    it: Event, Stream, stream(), current_stream(), synchronize()."""

    def __init__(self, log: DeviceLog, auto_complete: bool = True) -> None:
        self.log = log
        self.auto_complete = auto_complete
        self.counter = itertools.count()
        self.events: list[FakeEvent] = []
        self._current = FakeStream(self, name="current")

    def Event(self, enable_timing: bool = False, **_: Any) -> FakeEvent:
        return FakeEvent(self, enable_timing)

    def Stream(self, *args: Any, **kwargs: Any) -> FakeStream:
        return FakeStream(self)

    def current_stream(self, device: Any = None) -> FakeStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[FakeStream]:
        previous, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = previous

    def synchronize(self, device: Any = None) -> None:
        self.log.add("device_synchronize", "all")
        self.complete_all()

    def complete_all(self) -> None:
        """Let every copy in flight finish (what a real device does eventually)."""
        for event in self.events:
            event.done = True


class CudaDevice:
    """`Harness.device` for `device="cuda"`: the real device has no fake events to complete;
    letting the copies in flight finish is a device synchronize."""

    def __init__(self) -> None:
        self.events: list[Any] = []  # no fake events: spy_releases' pending list stays empty

    def complete_all(self) -> None:
        torch.cuda.synchronize()


def _sizes(transfers: list[l2_transfer.L2Transfer]) -> str:
    """Device indices per transfer, e.g. "32+1" (KV first, then Mamba or sidecars)."""
    return "+".join(str(len(t.device_indices)) for t in transfers)


class FakeL2TransferEngine:
    """Replaces `mem_cache/l2_transfer.py:L2TransferEngine`: same calls on events and callbacks,
    no copies. Each submission is kept in `submissions` and logged as ("d2h"|"h2d", sizes)."""

    def __init__(self, device: FakeDeviceModule, io_backend: str) -> None:
        self._device = device
        self.io_backend = io_backend
        self.device_to_host_stream = FakeStream(device, name="d2h")
        self.host_to_device_stream = FakeStream(device, name="h2d")
        self.submissions: list[tuple[str, list[l2_transfer.L2Transfer]]] = []

    def _start_event(self, start_event: FakeEvent | None) -> FakeEvent:
        # l2_transfer.py:115-120
        if start_event is None:
            start_event = self._device.Event()
            start_event.record()
        return start_event

    def _ack_events(self, kind: str) -> tuple[FakeEvent, FakeEvent]:
        """The completion pair of a submission, named <kind><n>.ack_start / .ack_finish."""
        n = sum(1 for k, _ in self.submissions if k == kind)
        ack_start, ack_finish = self._device.Event(), self._device.Event()
        ack_start.name, ack_finish.name = f"{kind}{n}.ack_start", f"{kind}{n}.ack_finish"
        return ack_start, ack_finish

    def submit_device_to_host(self, transfers: list[l2_transfer.L2Transfer]) -> Any:
        start_event = self._start_event(None)
        ack_start, ack_finish = self._ack_events("d2h")
        with self._device.stream(self.device_to_host_stream):
            start_event.wait(self.device_to_host_stream)
            ack_start.record()
            self.submissions.append(("d2h", transfers))
            self._device.log.add("d2h", _sizes(transfers))
            ack_finish.record()
        return l2_transfer.TransferCompletion(ack_start, ack_finish, False)

    def submit_host_to_device(
        self,
        transfers: list[l2_transfer.L2Transfer],
        *,
        layer_num: int | None = None,
        transfer_layer_id_max: int | None = None,
        start_event: FakeEvent | None = None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> Any:
        # Mirrors l2_transfer.py:74-113 with the per-layer copies left out. The layer count is
        # `layer_num` at 0.5.20, `transfer_layer_id_max` from 0.5.21 on.
        layer_count = layer_num if layer_num is not None else transfer_layer_id_max
        assert layer_count is not None, "submit_host_to_device without a layer count"
        start_event = self._start_event(start_event)
        ack_start, ack_finish = self._ack_events("h2d")
        with self._device.stream(self.host_to_device_stream):
            start_event.wait(self.host_to_device_stream)
            ack_start.record()
            self.submissions.append(("h2d", transfers))
            self._device.log.add("h2d", _sizes(transfers))
            for layer_id in range(layer_count):
                if on_layer_done is not None:
                    on_layer_done(layer_id)
            ack_finish.record()
        return l2_transfer.TransferCompletion(ack_start, ack_finish, False)


class FakeCacheLinker:
    """Stands in for the external cache linker (`UnifiedCacheLinkerWrapper` around e.g. the
    mooncake direct linker, storage/mooncake_store/mooncake_direct_linker.py), which loads on its
    own thread. Only the calls the prefill path makes on `tree_cache.linker` are answered: it
    has no hits of its own (`match` passes the tree's result through, `has_hit` is False) and
    `start_layer_wise_loading` reports `start_index`, the consumer index a linker load returns
    from `ready_to_load_host_cache` (unified_radix_cache.py:3339-3345)."""

    def __init__(self, start_index: int) -> None:
        self.start_index = start_index
        self.started = 0
        # 0.5.22 on, prefix_device_indices appends the KV a linker loaded privately for a
        # request; with no hits of its own this linker has none.
        self.private_load_indices: dict[str, torch.Tensor] = {}

    def match(self, key: Any, req: Any, result: Any) -> Any:
        return result

    def has_hit(self, rid: str) -> bool:
        return False

    def start_layer_wise_loading(self) -> int:
        self.started += 1
        return self.start_index

    def release_request(self, rid: str) -> None:
        pass

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class FakeTokenizerChannel:
    """The scheduler's channel to the tokenizer manager (a ZMQ socket): outputs are kept."""

    outputs: list[Any] = field(default_factory=list)

    def send_output(self, output: Any, req: Any = None) -> None:
        self.outputs.append(output)


@dataclass
class FakeIpcChannels:
    send_to_tokenizer: FakeTokenizerChannel = field(default_factory=FakeTokenizerChannel)


@dataclass
class MetricsReporterStub:
    """What the scheduler reads of SchedulerMetricsReporter when it counts something."""

    enable_metrics: bool
    metrics_collector: Any


class RecordingMetric:
    """prometheus_client stand-in for SchedulerMetricsCollector's injection hooks
    (`_counter_cls`, ...): every metric the collector creates is kept by name, with the sum of
    what it was given (Prometheus export is the I/O boundary)."""

    created: ClassVar[dict[str, RecordingMetric]] = {}

    def __init__(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.name = name
        self.total = 0.0
        RecordingMetric.created[name] = self

    def labels(self, **labels: Any) -> RecordingMetric:
        return self

    def inc(self, amount: float = 1) -> None:
        self.total += amount

    def set(self, value: float) -> None:
        self.total = value

    def observe(self, value: float) -> None:
        self.total += value


@dataclass
class CpuModelRunner:
    """The model runner attributes the scheduler reads during prefill scheduling."""

    attn_backend: Any  # scheduler.py:3827-3831 probes `extend_attention_block_m` on it
    forward_stream: Any  # scheduler.py:617-622 fences HiCache loads behind it
    prefill_aware_swa: bool = False  # scheduler.py:4020
    # A PD prefill server's bootstrap queue (disaggregation/prefill.py:174-260) reads the pool's
    # size and the KV dtype's name from the model runner.
    effective_max_total_num_tokens: int = 0
    effective_logical_max_total_num_tokens: int = 0
    kv_cache_dtype_str: str = "float32"


@dataclass
class CpuModelWorker:
    """Stands in for TpModelWorker (model weights, CUDA graphs, GPU streams)."""

    model_runner: CpuModelRunner
    hicache_layer_transfer_counter: Any = None

    def register_hicache_layer_transfer_counter(self, counter: Any) -> None:
        # Called by mem_cache/registry.py:195 when HiCache is attached (tp_worker.py:532-533).
        self.hicache_layer_transfer_counter = counter


class NaiveAllocExtendKernel:
    """Stands in for the Triton `alloc_extend_kernel` (no GPU driver to launch it): the launch
    `alloc_extend_kernel[grid](...)` of allocator/paged.py:206-214 runs upstream's own torch port
    of the kernel, `alloc_extend_naive`, which the NPU allocator uses. Like the kernel it only
    fills `out_indices`; PagedTokenToKVPoolAllocator.alloc_extend still decides hit or miss. It
    asserts when a request needs a new page and no page at all is free (paged.py:65-72)."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(
            prefix_lens: torch.Tensor,
            seq_lens: torch.Tensor,
            last_loc: torch.Tensor,
            free_pages: torch.Tensor,
            out_indices: torch.Tensor,
            bs_upper: int,
            page_size: int,
        ) -> None:
            alloc_extend_naive(
                prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, out_indices.device
            )

        return launch


class NaiveAllocDecodeKernel:
    """Stands in for the Triton `alloc_decode_kernel` (no GPU driver to launch it), which up to
    0.5.21 the paged allocator launches on every device (paged.py:247 at 0.5.20): a decode row
    whose new token starts a page takes the next free page, in row order, any other row the slot
    after its last. That is what upstream's own torch port of the kernel computes from 0.5.22
    (`alloc_decode_naive`); like the kernel it only fills `out_indices`, the allocator still
    decides hit or miss and takes the pages."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(
            seq_lens: torch.Tensor,
            last_loc: torch.Tensor,
            free_pages: torch.Tensor,
            out_indices: torch.Tensor,
            bs_upper: int,
            page_size: int,
        ) -> None:
            starts_a_page = ((seq_lens - 1) % page_size == 0).to(torch.int64)
            page_rank = torch.cumsum(starts_a_page, 0) - starts_a_page
            if int(starts_a_page.sum()):
                first_slot = free_pages[page_rank.clamp(max=len(free_pages) - 1)] * page_size
                out_indices.copy_(torch.where(starts_a_page.bool(), first_slot, last_loc + 1))
            else:
                out_indices.copy_(last_loc + 1)

        return launch


def _no_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
    """cudaHostRegister (pool_host/common.py:128-238) page-locks host pools for DMA: a driver
    call with nothing to do on CPU. The host buffer itself is allocated for real."""


# A request's prefill span. Up to 0.5.21 it is `prefix_indices` and `extend_range` (start, end);
# from 0.5.22 on `prefix_len` and `extend_end` (the extend starts at the prefix).
def prefix_len(req: Req) -> int:
    """Tokens of the request's matched (or already computed) prefix."""
    if hasattr(req, "prefix_indices"):
        return len(req.prefix_indices)
    return int(req.prefix_len)


def extend_start(req: Req) -> int:
    """Where the request's scheduled extend starts."""
    if hasattr(req, "extend_range"):
        return int(req.extend_range.start)
    return int(req.prefix_len)


def extend_end(req: Req) -> int:
    """Where the request's scheduled extend ends."""
    if hasattr(req, "extend_range"):
        return int(req.extend_range.end)
    return int(req.extend_end)


def num_prefill_unwinds(h: Harness) -> int:
    """Prefill batches the scheduler put back (a class attribute of the patched Scheduler;
    pristine has none)."""
    return int(getattr(h.scheduler, "num_prefill_unwinds", 0))


# --------------------------------------------------------------------------------------------
# Configuration and the harness object
# --------------------------------------------------------------------------------------------
class _Admitted(Exception):
    """Raised where a round's allocation would start, carrying its batch (admitted_batch)."""

    def __init__(self, batch: ScheduleBatch) -> None:
        super().__init__("admitted")
        self.batch = batch


@dataclass(frozen=True)
class HarnessConfig:
    page_size: int = 1
    hicache: bool = False
    mamba: bool = False
    ping_pong: bool = False  # --mamba-radix-cache-strategy extra_buffer (needs mamba)
    kv_tokens: int = 512  # device KV pool size (tokens)
    req_rows: int = 8  # ReqToTokenPool rows (= max_running_requests)
    mamba_slots: int = 24  # MambaPool slots
    chunked_prefill_size: int = 256
    max_prefill_tokens: int = 1024
    prefill_max_requests: int | None = None  # --prefill-max-requests: admission stops at this many
    context_len: int = 1024
    hicache_ratio: float = 2.0
    auto_complete_events: bool = True
    enable_overlap: bool = True  # the default (no --disable-overlap-schedule)
    # Parallel groups (torch.distributed initialised with gloo, the groups passed here; the
    # harness only builds what a single rank holds). As in the real scheduler they are distinct
    # objects (scheduler.py:1210-1214): the TP group, the attention-TP and attention-CP groups.
    tp_size: int = 1
    tp_cpu_group: Any = None
    attn_tp_cpu_group: Any = None
    attn_cp_cpu_group: Any = None
    enable_dp_attention: bool = False
    # The KV allocator declares that its free space is decided per rank (`rank_local_capacity`),
    # as kvcached's elastic pools are: the ranks must then agree on every prefill round.
    elastic: bool = False
    # "cuda": real pools, streams, events and copies on the GPU (no fake device; page_size 1,
    # since the paged allocator's Triton kernel is swapped only on CPU).
    device: str = "cpu"
    # The Mamba2 state per slot (num_heads x head_dim x state_size): the GPU tests make it tens
    # of MB so that loading it back takes milliseconds.
    mamba_heads: int = 2
    mamba_head_dim: int = 4
    mamba_state_size: int = 4
    # A PD prefill server (--disaggregation-mode prefill): requests wait in its bootstrap queue,
    # its KV goes through upstream's fake transfer backend (the network is the I/O boundary);
    # the queues are built when the event loop driver is installed (Scheduler.init_disaggregation).
    pd_prefill: bool = False
    enable_mixed_chunk: bool = False  # --enable-mixed-chunk


class PhysicalMemory:
    """The hardware boundary of a kvcached-shaped (rank-local) KV allocator: the GPU memory it maps
    on demand, shared with co-tenant engines. The allocator's own free list is its free virtual
    space (`uniform_available_size`, what its own allocations and frees change, alike on every
    rank); its real free space (`real_available_size`) is the least of that and what this GPU can
    still map, which is the virtual space less what co-tenants took; an allocation beyond the real free
    space misses, returning None having taken nothing (kvcached's contract). `taken` is read at
    every reading, so a test can make it drift between any two reads, as kvcached's TTL-cached
    physical reading does.

    Part of the free space can be memory this rank already holds mapped (`mapped_free`, kvcached's
    free blocks on its mapped pages): no co-tenant can take it, allocations use it first, and the
    allocator counts it (`guaranteed_available_size`). None by default. Frees do not add to it
    (kvcached keeps an emptied page mapped until that reading is taken again: more, never less)."""

    def __init__(self, allocator: Any) -> None:
        self.uniform: Callable[[], int] = allocator.available_size
        self.taken: Callable[[], int] = lambda: 0
        self.quarantined: Callable[[], int] = lambda: 0
        self.mapped_free = 0
        # Readings of the mapped free space taken: kvcached unmaps the pages emptied before one.
        self.guaranteed_readings = 0
        real_alloc = allocator.alloc

        def alloc(need_size: int, *args: Any, **kwargs: Any) -> Any:
            if need_size > self.available():
                return None
            self.mapped_free -= min(self.mapped_free, need_size)
            return real_alloc(need_size, *args, **kwargs)

        # A paged allocator hands out whole pages through alloc_extend / alloc_decode: each takes
        # the pages upstream's own count says (get_num_new_pages), from the mapped ones first,
        # and misses where they exceed the real free space.
        count_pages = getattr(sys.modules[type(allocator).__module__], "get_num_new_pages", None)
        for name in ("alloc_extend", "alloc_decode"):
            real_paged = getattr(allocator, name, None)
            if count_pages is not None and callable(real_paged):
                setattr(
                    allocator, name, self._paged(allocator, real_paged, count_pages, name == "alloc_decode")
                )

        # kvcached's rank-local pool interface: its own two readings, and the agreed deficit its
        # available_size() then reads by (None: the real reading).
        self.agreed_deficit: int | None = None
        allocator.uniform_available_size = lambda: self.uniform()  # read afresh: see part_own_reading()
        allocator.real_available_size = self.available
        allocator.agree_deficit = self.agree_deficit
        allocator.available_size = self.reading
        allocator.guaranteed_available_size = self.guaranteed
        allocator.alloc = alloc

    def _paged(
        self, allocator: Any, real: Callable[..., Any], count_pages: Callable[..., int], decode: bool
    ) -> Callable[..., Any]:
        signature = inspect.signature(real)

        def alloc_pages(*args: Any, **kwargs: Any) -> Any:
            called = signature.bind(*args, **kwargs).arguments
            lengths: dict[str, Any] = (
                {"decode": True} if decode else {"prefix_lens": called["prefix_lens_cpu"]}
            )
            need = count_pages(seq_lens=called["seq_lens_cpu"], page_size=allocator.page_size, **lengths)
            need *= allocator.page_size
            if need > self.available():
                return None
            self.mapped_free -= min(self.mapped_free, need)
            return real(*args, **kwargs)

        return alloc_pages

    def agree_deficit(self, deficit: int | None) -> None:
        self.agreed_deficit = deficit

    def reading(self) -> int:
        """What the allocator answers `available_size()`: the uniform reading less the ranks'
        agreed deficit where they agreed one, else the real free space."""
        if self.agreed_deficit is None:
            return self.available()
        return max(0, self.uniform() - self.agreed_deficit)

    def guaranteed(self) -> int:
        """The free space no co-tenant can take (kvcached: its free blocks on mapped pages)."""
        self.guaranteed_readings += 1
        return self.mapped_free

    def available(self) -> int:
        unmapped = max(0, self.uniform() - self.mapped_free)
        return self.mapped_free + max(0, unmapped - self.taken() - self.quarantined())

    def quarantine(self, tokens: Callable[[], int]) -> None:
        """This GPU sets aside `tokens()` (read at every reading) of the pages it has not mapped,
        as kvcached quarantines pages whose mapping failed, or a shrink takes them: on this rank
        alone, so only its real reading drops; its own reading, which counts from the pool's
        virtual size, moves by the pool's own calls alone."""
        self.quarantined = tokens

    def part_own_reading(self, tokens: Callable[[], int]) -> None:
        """This rank's own (uniform) reading lowered by `tokens()` (read at every reading): the
        one reading the ranks' agreement trusts to be alike made to differ, as a rank-local pool
        that breaks the interface's promise makes it (kvcached's did before it counted from its
        virtual size: a quarantine or a shrink lowered it on one GPU). What it lowers are pages
        not mapped: each new amount is taken, at the first reading that sees it, from the
        unmapped free space then (at most all of it) and held until the amount changes, so that
        the reading still moves by the pool's own calls."""
        own_reading = self.uniform
        asked, held = 0, 0

        def reading() -> int:
            nonlocal asked, held
            own, now_asked = own_reading(), tokens()
            if now_asked != asked:
                asked = now_asked
                held = min(asked, max(0, own - self.mapped_free))
            return own - held

        self.uniform = reading

    def hold_mapped(self, tokens: int) -> None:
        """This rank holds `tokens` of its free space mapped (at most all of it)."""
        self.mapped_free = min(tokens, self.uniform())

    def take(self, tokens: int) -> None:
        """A co-tenant maps `tokens` of this GPU's memory away (0: gives it all back)."""
        self.taken = lambda: tokens

    def drift(self, readings: Iterator[int]) -> None:
        """What co-tenants hold changes at every reading: the next of `readings` each time."""
        self.taken = lambda: next(readings)


def settled_by_earlier_rounds() -> contextlib.AbstractContextManager[Any]:
    """What a test lays down directly (a cached prefix) stands for what earlier agreed rounds left:
    the agreement's watch of rank-local pools, where the tree has one, counts it as agreed."""
    try:
        from sglang.srt.mem_cache.rank_agreement import agreed_allocation
    except ImportError:  # a tree without the watch
        return contextlib.nullcontext()
    settled: contextlib.AbstractContextManager[Any] = agreed_allocation("test setup")
    return settled


@dataclass
class Harness:
    cfg: HarnessConfig
    scheduler: Scheduler
    tree_cache: UnifiedRadixCache
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: Any
    device: FakeDeviceModule | CudaDevice
    device_log: DeviceLog
    transfer_engine: FakeL2TransferEngine | None
    build_seconds: float
    _stack: contextlib.ExitStack
    _rid_counter: Iterator[int] = field(default_factory=itertools.count)
    last_batch: ScheduleBatch | None = None  # the batch the last run_round returned
    physical: PhysicalMemory | None = None  # the KV allocator's GPU memory (elastic=True only)

    # ---- requests and rounds ------------------------------------------------------------
    def make_req(
        self,
        token_ids: list[int],
        rid: str | None = None,
        max_new_tokens: int = 8,
        session: Session | None = None,
    ) -> Req:
        """A real Req as handle_generate_request builds it (scheduler.py:2749-2792). With `session`
        it is a turn of that session, as Session.create_req passes it (session_controller.py)."""
        sched = self.scheduler
        sampling_params = SamplingParams(max_new_tokens=max_new_tokens)
        sampling_params.normalize(None)
        req = Req(
            rid or f"r{next(self._rid_counter)}",
            "",
            array("q", token_ids),
            sampling_params,
            eos_token_ids=sched.model_config.hf_eos_token_id,
            disagg_mode=sched.disaggregation_mode,
            vocab_size=sched.model_config.vocab_size,
            dllm_config=sched.dllm_config,
            session=session,
            session_id=session.session_id if session is not None else None,
        )
        sched.init_req_max_new_tokens(req)  # the real clamp, scheduler.py:2510
        return req

    def add_request(
        self,
        token_ids: list[int],
        rid: str | None = None,
        session: Session | None = None,
        max_new_tokens: int = 8,
    ) -> Req:
        """Queue a request through the real `_add_request_to_queue` (scheduler.py:3193-3206)."""
        req = self.make_req(token_ids, rid, max_new_tokens, session=session)
        self.scheduler._add_request_to_queue(req)
        if self.cfg.pd_prefill:  # it waits in the bootstrap queue until its transfer is set up
            assert self.scheduler.disagg_prefill_bootstrap_queue.queue[-1] is req
        else:
            assert self.scheduler.waiting_queue[-1] is req
        return req

    def admitted_batch(self) -> ScheduleBatch:
        """The batch the next round admits, stopped where its allocation would start: the real
        admission runs (`_get_new_batch_prefill_raw`: locks, Mamba slots, the new batch), then
        `alloc_for_extend` is not run. The test allocates the batch itself (prepare_for_extend,
        or allocate_for_extend where the series splits it). The scheduler's own bookkeeping of
        that round is left as it stopped: build a fresh harness for the next round."""

        def stop(batch: ScheduleBatch) -> Any:
            raise _Admitted(batch)

        with mock.patch.object(schedule_batch_module, "alloc_for_extend", stop):
            try:
                self.run_round()
            except _Admitted as admitted:
                return admitted.batch
        raise AssertionError("the round admitted no batch")

    def run_round(self) -> ScheduleBatch | None:
        """One prefill round: the real `get_new_batch_prefill` (no prefill delayer), which calls
        `_get_new_batch_prefill_raw` (scheduler.py:3740-3765). Updates `scheduler.running_batch`."""
        sched = self.scheduler
        plan = sched.get_new_batch_prefill(sched.running_batch)
        sched.running_batch = plan.running_batch
        self.last_batch = plan.batch_to_run
        return plan.batch_to_run

    def prepare_next_round(self) -> None:
        """What the event loop does between two prefill rounds, before the next
        `_get_new_batch_prefill_raw` (get_next_batch_to_run, scheduler.py:3562-3630), in its order:
        - the copies in flight finish (a real device gets there eventually), then the real
          `_process_hicache_events` polls them (:3566; `check_hicache_events`: writing_check /
          loading_check, which unlock loaded nodes);
        - the chunked request's previous chunk is cached with the real `stash_chunked_request`
          when it produced KV beyond its prefix, the same test as :3597-3598;
        - when requests of the last prefill batch finished (`finish_request`), the running batch is
          no longer full: the loop filters them out of the last batch and clears batch_is_full
          (:3626-3630). Without this, a round whose admission filled the rows would block every
          later round (:3772-3775), which the real loop does not.
        The rest of get_next_batch_to_run (merging the last batch into the running batch, decode)
        is left out: the harness finishes requests right after their prefill."""
        sched = self.scheduler
        self.device.complete_all()
        sched._process_hicache_events()
        chunked = sched.chunked_req
        if chunked is not None and extend_end(chunked) > prefix_len(chunked):
            sched.stash_chunked_request(chunked)
        last, self.last_batch = self.last_batch, None
        if last is not None and any(req.finished() for req in last.reqs):
            sched.running_batch.batch_is_full = False

    def finish_request(self, req: Req) -> None:
        """Finish a request right after its (last) prefill chunk, the way the batch result
        processor does for a finished request (batch_result_processor.py:372-380 at 0.5.20): a finish
        reason, then the real `release_kv_cache` (cache_finished_req: insert into the tree,
        unlock, free the row and what the tree does not keep)."""
        req.finished_reason = FINISH_LENGTH(length=0)
        if "checkpoint" in inspect.signature(release_kv_cache).parameters:
            # 0.5.22 on: a finished request's KV is kept in the tree (checkpoint=True), as
            # process_batch_result_prefill does for a finished request.
            release_kv_cache(req, self.tree_cache, checkpoint=True)
        else:
            release_kv_cache(req, self.tree_cache)
        self.flush_pending_backups()

    def flush_pending_backups(self) -> None:
        """0.5.21 on, write-through backups are queued and submitted once per step
        (process_batch_result ends with tree_cache.flush_pending_backups()); 0.5.20 submits
        them at once and has no such method."""
        flush = getattr(self.tree_cache, "flush_pending_backups", None)
        if flush is not None:
            flush()

    def open_streaming_session(self, token_ids: list[int]) -> Session:
        """A streaming session whose first turn ran and finished, so its slot holds the turn's
        row, KV and (with mamba) Mamba slot between turns: the real `Session(streaming=True)`,
        one real prefill round for the first turn, then `release_kv_cache`, which hands the
        request's KV record to the session slot (StreamingSession.try_cache_finished_req,
        session/streaming_session.py:267-327). A later `add_request(..., session=...)` whose
        tokens extend `token_ids` restores that record at match time (restore_to_req)."""
        assert not self.scheduler.waiting_queue, "open the session on an idle scheduler"
        session = Session(
            capacity_of_str_len=1 << 16, session_id=f"s{next(self._rid_counter)}", streaming=True
        )
        first = self.add_request(token_ids, session=session)
        batch = self.run_round()
        assert batch is not None and batch.reqs == [first], "the first turn must run alone"
        self.finish_request(first)
        # has_slot(), up to 0.5.21, is this lookup
        assert session.session_id in self.tree_cache.session.slots
        return session

    def session_slot(self, session: Session) -> Any:
        """The `SessionSlot` holding `session`'s state between turns."""
        return self.tree_cache.session.slots[session.session_id]

    @contextlib.contextmanager
    def spy_releases(self) -> Iterator[None]:
        """Put the releases an unwind makes into the device log, in order with the event calls:
        - every lock release, `tree_cache.dec_lock_ref`, as ("dec_lock_ref", "pending=<names>");
        - every Mamba free, `mamba_allocator.free(indices)`, as ("mamba_free", "<i,j> pending=<names>");
        - the consumer index `ready_to_load_host_cache` returns, as ("consumer", "<index>"): the
          batch's `hicache_consumer_index`, also when the batch is unwound and never returned.
        `pending=` lists the load events recorded and not complete at that moment, so a test can
        show what was released while a load was in flight. The real methods run; only instance
        attributes are shadowed, so every caller (scheduler, pools, tree components) is seen."""
        device, log = self.device, self.device_log

        def pending_loads() -> str:
            names = [e.name for e in device.events if e.recorded and not e.done and e.name.startswith("load")]
            return "pending=" + ",".join(names)

        def spy_lock(real: Callable[..., Any]) -> Callable[..., Any]:
            def dec_lock_ref(*args: Any, **kwargs: Any) -> Any:
                log.add("dec_lock_ref", pending_loads())
                return real(*args, **kwargs)

            return dec_lock_ref

        def spy_free(real: Callable[..., Any]) -> Callable[..., Any]:
            def free(indices: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                slots = ",".join(str(int(i)) for i in indices.flatten().tolist())
                log.add("mamba_free", f"{slots} {pending_loads()}")
                return real(indices, *args, **kwargs)

            return free

        def spy_consumer(real: Callable[[], int]) -> Callable[[], int]:
            def ready_to_load_host_cache() -> int:
                index = real()
                log.add("consumer", str(index))
                return index

            return ready_to_load_host_cache

        cache = self.tree_cache
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(cache, "dec_lock_ref", spy_lock(cache.dec_lock_ref)))
            stack.enter_context(
                mock.patch.object(
                    cache, "ready_to_load_host_cache", spy_consumer(cache.ready_to_load_host_cache)
                )
            )
            allocator = getattr(self.req_to_token_pool, "mamba_allocator", None)
            if allocator is not None:
                stack.enter_context(mock.patch.object(allocator, "free", spy_free(allocator.free)))
            yield

    def mamba_load_targets(self) -> set[int]:
        """The device Mamba slots the H2D loads submitted so far write into (the tree node's slot
        and the request's copy-on-write slot, unified_cache/components/mamba.py:730-755)."""
        if self.transfer_engine is None or not self.cfg.mamba:
            return set()
        mamba_pool = self.req_to_token_pool.mamba_pool
        return {
            int(i)
            for kind, transfers in self.transfer_engine.submissions
            if kind == "h2d"
            for t in transfers
            if t.device_pool is mamba_pool
            for i in t.device_indices.flatten().tolist()
        }

    def idle_leak_report(self) -> list[str]:
        """The scheduler's own idle memory check, run on this harness's pools: the real
        `SchedulerPoolStatsObserver` and `SchedulerInvariantChecker._check_all_pools`
        (available + evictable + protected + session-held == total, for the KV pool and, with
        mamba, the Mamba pool) and the row count of `_check_req_pool`, as
        `Scheduler.self_check_during_idle` runs them (scheduler.py:4752-4768 at 0.5.20). Returns the
        problems found; empty when nothing leaked. Call it when idle: no request holds pool
        memory outside the tree or a session."""
        sched = self.scheduler
        observer = _construct(
            SchedulerPoolStatsObserver,
            tree_cache=self.tree_cache,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            req_to_token_pool=self.req_to_token_pool,
            session_controller=None,
            hisparse_coordinator=None,
            is_hybrid_swa=False,
            is_hybrid_ssm=self.cfg.mamba,
            enable_hisparse=False,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            max_total_num_tokens=sched.max_total_num_tokens,
            get_last_batch=lambda: None,
            get_running_batch=lambda: sched.running_batch,
        )
        checker = _construct(
            SchedulerInvariantChecker,
            is_hybrid_swa=False,
            is_hybrid_ssm=self.cfg.mamba,
            disaggregation_mode=sched.disaggregation_mode,
            page_size=self.cfg.page_size,
            full_tokens_per_layer=None,
            swa_tokens_per_layer=None,
            max_total_num_tokens=sched.max_total_num_tokens,
            tree_cache=self.tree_cache,
            token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
            req_to_token_pool=self.req_to_token_pool,
            pool_stats_observer=observer,
            get_last_batch=lambda: None,
            get_running_batch=lambda: sched.running_batch,
            get_chunked_req=lambda: sched.chunked_req,
            scheduler_stage_metrics=None,
        )
        has_leak, messages = checker._check_all_pools(observer.get_pool_stats())
        problems = list(messages) if has_leak else []
        # _check_req_pool (invariant_checker.py:439-460) warns instead of raising by default.
        rows = len(self.req_to_token_pool.free_slots) + observer.session_held_req_count()
        if rows != self.req_to_token_pool.size:
            problems.append(f"[rows] free+session_held={rows}, total={self.req_to_token_pool.size}")
        return problems

    def reset(self) -> None:
        """Empty the queues and every pool, as `Scheduler.flush_cache` does when idle
        (scheduler.py:4986-4989), so a benchmark can run rounds on one harness."""
        sched = self.scheduler
        sched.waiting_queue.clear()
        sched.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)
        sched.chunked_req = None
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        self.req_to_token_pool.reset_aux_cache_allocator()
        self.device.complete_all()
        self.device_log.clear()

    def enable_metrics(self) -> dict[str, RecordingMetric]:
        """Turn the scheduler's metrics on with the real `SchedulerMetricsCollector`, its
        Prometheus classes swapped for `RecordingMetric`. Returns the metrics by name."""

        class RecordingCollector(SchedulerMetricsCollector):  # type: ignore[misc]  # sglang is untyped
            _counter_cls = _gauge_cls = _histogram_cls = _summary_cls = RecordingMetric

        RecordingMetric.created = {}
        # Some collectors register real Prometheus metrics too (0.5.23's GaugeHistogram): a second
        # harness in one process (a forked rank after a test that enabled metrics) would register
        # them twice.
        from prometheus_client import REGISTRY

        for registered, names in list(REGISTRY._collector_to_names.items()):
            if any(name.startswith("sglang:") for name in names):
                REGISTRY.unregister(registered)
        collector = RecordingCollector(
            labels={"model_name": "tiny", "moe_ep_rank": 0}, server_args=self.scheduler.server_args
        )
        reporter = self.scheduler.metrics_reporter
        if isinstance(reporter, MetricsReporterStub):
            self.scheduler.metrics_reporter = MetricsReporterStub(
                enable_metrics=True, metrics_collector=collector
            )
        else:  # the real reporter an event loop driver installed: its methods run, recorded
            reporter.enable_metrics = True
            reporter.metrics_collector = collector
        return RecordingMetric.created

    @contextlib.contextmanager
    def nothing_in_flight(self) -> Iterator[None]:
        """The event loop's state with nothing in flight, which the harness does not build: no
        last batch, no result queued (0.5.20: its one PP stage drained). What
        `Scheduler.is_fully_idle()` and `on_idle` read besides the queues and pools."""
        sched = self.scheduler
        with contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(sched, "last_batch", None, create=True))
            stack.enter_context(mock.patch.object(sched, "result_queue", collections.deque(), create=True))
            if hasattr(sched, "_pp_microbatches_drained"):
                stack.enter_context(mock.patch.object(sched, "_pp_microbatches_drained", lambda: True))
            yield

    # ---- pool state ---------------------------------------------------------------------
    def free_counts(self) -> dict[str, int]:
        """Each pool's own free count: for an elastic KV allocator its free list
        (`uniform_available_size`), which only its allocations and frees change, not what
        co-tenants hold of the GPU (the real reading, which may drift at every read)."""
        allocator = self.token_to_kv_pool_allocator
        counts = {
            "req_rows": self.req_to_token_pool.available_size(),
            "kv_tokens": getattr(allocator, "uniform_available_size", allocator.available_size)(),
        }
        mamba_allocator = getattr(self.req_to_token_pool, "mamba_allocator", None)
        if mamba_allocator is not None:
            counts["mamba_slots"] = mamba_allocator.available_size()
        if self.tree_cache.cache_controller is not None:
            counts["host_tokens"] = self.tree_cache.cache_controller.mem_pool_host.available_size()
        return counts

    @property
    def layer_done_counter(self) -> cache_controller.LayerDoneCounter:
        assert self.tree_cache.cache_controller is not None, "built without hicache"
        return self.tree_cache.cache_controller.layer_done_counter

    # ---- cached prefixes ----------------------------------------------------------------
    def cache_prefix(self, token_ids: list[int]) -> None:
        """Put `token_ids` in the radix tree with device KV (and a Mamba state with mamba=True),
        as caching a finished request does. A later request with this prefix matches it on
        device and admission locks it (`_req_inc_lock_ref`, schedule_policy.py:1092-1094).
        With hicache (write_through) the insert also starts the D2H backup."""
        assert len(token_ids) % self.cfg.page_size == 0, "whole pages only"
        with settled_by_earlier_rounds():
            indices = self.token_to_kv_pool_allocator.alloc(len(token_ids))
            assert indices is not None, "KV pool too small for the prefix"
            mamba_value = None
            if self.cfg.mamba:
                mamba_value = self.req_to_token_pool.mamba_allocator.alloc(1)
                assert mamba_value is not None, "no Mamba slot for the prefix"
        key = RadixKey(token_ids=array("q", token_ids))
        self.tree_cache.insert(InsertParams(key=key, value=indices, mamba_value=mamba_value))
        self.flush_pending_backups()

    def put_prefix_on_host(self, token_ids: list[int]) -> None:
        """Leave `token_ids` in the tree on host only, the way HiCache gets there: insert device
        KV (write-through backs it up, D2H), ack the write (`writing_check`), then evict the
        device copy (the node is demoted, the host copy kept). A later request with this prefix
        is a host hit: admission loads it back and `ready_to_load_host_cache` starts the load."""
        cache = self.tree_cache
        assert cache.cache_controller is not None, "put_prefix_on_host needs hicache=True"
        self.cache_prefix(token_ids)
        self.device.complete_all()  # the D2H copy finished
        cache.writing_check()
        # Eviction takes the least recently used nodes first: evict until this prefix is the one
        # that went (a later call would otherwise evict an older prefix instead).
        key = RadixKey(token_ids=array("q", token_ids))
        for _ in range(8):
            if _device_match_len(cache.match_prefix(MatchPrefixParams(key=key))) == 0:
                return
            cache.evict(EvictParams(num_tokens=len(token_ids), mamba_num=1 if self.cfg.mamba else 0))
        raise AssertionError("prefix still on device")

    # ---- miss injection -----------------------------------------------------------------
    @contextlib.contextmanager
    def arm_miss(self, site: MissSite, after: int = 0) -> Iterator[list[str]]:
        """Make one real pool report a miss inside `alloc_for_extend` only, i.e. after admission
        said yes (prepare_for_extend, schedule_batch.py:2677). The pool's alloc returns None
        from the `after`-th matching call on; admission and load-back (which allocate before
        alloc_for_extend) see the real pool. Only an instance attribute is shadowed; the free
        counts stay real, as with kvcached's elastic pools. Yields a list that gets one entry
        per miss reported."""
        target, name, matches = self._miss_target(site)
        real = getattr(target, name)
        matching_calls = itertools.count()
        armed = [False]
        reported: list[str] = []

        def maybe_miss(*args: Any, **kwargs: Any) -> Any:
            if armed[0] and matches(*args, **kwargs) and next(matching_calls) >= after:
                reported.append(site)
                return None
            return real(*args, **kwargs)

        real_alloc_for_extend = schedule_batch_module.alloc_for_extend

        def alloc_for_extend_armed(batch: ScheduleBatch) -> Any:
            armed[0] = True
            try:
                return real_alloc_for_extend(batch)
            finally:
                armed[0] = False

        with (
            mock.patch.object(target, name, maybe_miss),
            mock.patch.object(schedule_batch_module, "alloc_for_extend", alloc_for_extend_armed),
        ):
            yield reported

    def _miss_target(self, site: MissSite) -> tuple[Any, str, Callable[..., bool]]:
        """(object, method, which calls count) for each miss site of alloc_for_extend."""
        any_call: Callable[..., bool] = lambda *a, **k: True  # noqa: E731
        if site == "req_rows":
            # ReqToTokenPool.alloc -> alloc_rows (memory_pool.py:306) -> None ->
            # alloc_req_slots raises (allocation.py:321-330)
            return self.req_to_token_pool, "alloc_rows", any_call
        if site == "token_slots":  # allocation.py:158, raises at :169 (page_size 1)
            assert self.cfg.page_size == 1, "token_slots is the page_size 1 path"
            return self.token_to_kv_pool_allocator, "alloc", any_call
        if site == "paged_extend":  # allocation.py:211, raises at :238 (page_size > 1)
            assert self.cfg.page_size > 1, "paged_extend is the page_size > 1 path"
            return self.token_to_kv_pool_allocator, "alloc_extend", any_call
        assert self.cfg.mamba, f"{site} needs mamba=True"
        pool = self.req_to_token_pool
        if site == "mamba_slot":  # HybridReqToTokenPool.alloc: alloc(1), asserts at :1445
            return pool.mamba_allocator, "alloc", lambda need_size: need_size == 1
        if site == "ping_pong":  # _alloc_ping_pong_buffer: alloc(2), asserts at :1597
            assert self.cfg.ping_pong and pool.mamba_ping_pong_track_buffer_size == 2, (
                "ping_pong needs ping_pong=True and enable_overlap=True (2 track slots)"
            )
            return pool.mamba_allocator, "alloc", lambda need_size: need_size == 2
        raise ValueError(site)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------
# Building
# --------------------------------------------------------------------------------------------
def _use_the_fake_transfer_backend(cfg: HarnessConfig) -> None:
    """A PD prefill server's KV transfer through upstream's fake backend (disaggregation/fake:
    no network, a send succeeds). Publishing refuses 'fake' on a prefill server (its hook asserts
    it is for a decode server's warm-up), so it is set after publishing."""
    if cfg.pd_prefill:
        runtime_context.get_context().override("harness PD transfer", disaggregation_transfer_backend="fake")


def _publish(cfg: HarnessConfig, model_dir: Path) -> ServerArgs:
    """Publish the process-wide config bags the upstream code reads (get_memory(), ...)."""

    def make(strategy: str) -> ServerArgs:
        return ServerArgs(
            model_path=str(model_dir),
            device="cpu",
            skip_tokenizer_init=True,
            # torch_native: write_cache_indices / get_last_loc take their torch paths
            # (mem_cache/allocation.py:68-71, 107-137) instead of Triton kernels.
            attention_backend="torch_native",
            page_size=cfg.page_size,
            chunked_prefill_size=cfg.chunked_prefill_size,
            max_prefill_tokens=cfg.max_prefill_tokens,
            prefill_max_requests=cfg.prefill_max_requests,
            max_running_requests=cfg.req_rows,
            context_length=cfg.context_len,
            disable_overlap_schedule=not cfg.enable_overlap,
            enable_hierarchical_cache=cfg.hicache,
            hicache_ratio=cfg.hicache_ratio,
            # "direct" + "page_first_direct": the host pools' torch indexing paths, no CUDA kernels;
            # MambaPoolHost accepts only page_first* layouts (pool_host/mamba.py:55-58).
            hicache_io_backend="direct",
            hicache_mem_layout="page_first_direct",
            mamba_radix_cache_strategy=strategy,
            tp_size=cfg.tp_size,
            disaggregation_mode="prefill" if cfg.pd_prefill else "null",
            enable_mixed_chunk=cfg.enable_mixed_chunk,
        )

    if not cfg.ping_pong:
        server_args = make("no_buffer")
        runtime_context.publish(server_args, role="scheduler")
        _use_the_fake_transfer_backend(cfg)
        return server_args
    try:
        server_args = make("extra_buffer")
        runtime_context.publish(server_args, role="scheduler")
    except (ValueError, AssertionError):
        # 0.5.21 on, publishing validates the strategy against the model's architecture and
        # the platform (model_hook.handle_mamba_radix_cache: a hybrid-Mamba arch, CUDA-like
        # hardware). The harness's model is a Llama config with Mamba pools on a CPU, so it
        # publishes no_buffer and then resolves the leaves extra_buffer resolves to.
        server_args = make("no_buffer")
        runtime_context.publish(server_args, role="scheduler")
        runtime_context.get_context().override("harness ping-pong", mamba_radix_cache_strategy="extra_buffer")
        mamba_bag = runtime_context.get_exec().mamba
        if not mamba_bag.enable_mamba_extra_buffer:
            # A derived leaf, computed at publish: set it as publish would have.
            mamba_bag._set("enable_mamba_extra_buffer", True)
    return server_args


def _build_pools(cfg: HarnessConfig, model_config: ModelConfig) -> tuple[ReqToTokenPool, Any]:
    max_context_len = model_config.context_len + 4  # kv_cache_configurator adds a small extra
    if cfg.mamba:
        cache_params = Mamba2CacheParams(
            shape=Mamba2StateShape.create(
                tp_world_size=cfg.tp_size,
                intermediate_size=cfg.mamba_heads * cfg.mamba_head_dim,
                n_groups=1,
                num_heads=cfg.mamba_heads,
                head_dim=cfg.mamba_head_dim,
                state_size=cfg.mamba_state_size,
                conv_kernel=4,
            ),
            layers=[1],
        )
        req_to_token_pool: ReqToTokenPool = HybridReqToTokenPool(
            size=cfg.req_rows,
            mamba_size=cfg.mamba_slots,
            mamba_spec_state_size=cfg.req_rows,
            max_context_len=max_context_len,
            device=cfg.device,
            enable_memory_saver=False,
            cache_params=cache_params,
            mamba_layer_ids=[1],
            enable_mamba_extra_buffer=cfg.ping_pong,
            enable_overlap_schedule=cfg.enable_overlap,
        )
        kvcache: Any = HybridLinearKVPool(
            size=cfg.kv_tokens,
            dtype=torch.float32,
            page_size=cfg.page_size,
            head_num=KV_HEADS,
            head_dim=HEAD_DIM,
            full_attention_layer_ids=[0],
            device=cfg.device,
            mamba_pool=req_to_token_pool.mamba_pool,
        )
    else:
        req_to_token_pool = ReqToTokenPool(
            size=cfg.req_rows, max_context_len=max_context_len, device=cfg.device, enable_memory_saver=False
        )
        kvcache = MHATokenToKVPool(
            size=cfg.kv_tokens,
            page_size=cfg.page_size,
            dtype=torch.float32,
            head_num=KV_HEADS,
            head_dim=HEAD_DIM,
            layer_num=NUM_LAYERS,
            device=cfg.device,
            enable_memory_saver=False,
        )
    if cfg.page_size == 1:
        allocator: Any = TokenToKVPoolAllocator(
            cfg.kv_tokens, dtype=torch.float32, device=cfg.device, kvcache=kvcache, need_sort=False
        )
    else:
        allocator = PagedTokenToKVPoolAllocator(
            cfg.kv_tokens,
            page_size=cfg.page_size,
            dtype=torch.float32,
            device=cfg.device,
            kvcache=kvcache,
            need_sort=False,
        )
    return req_to_token_pool, allocator


def build_harness(cfg: HarnessConfig | None = None, **overrides: Any) -> Harness:
    """Build the pools, tree cache and a Scheduler ready for `_get_new_batch_prefill_raw`.

    `overrides` are HarnessConfig fields. Publishes a config for this process and patches module
    globals until `Harness.close()` (or the `with` block) ends: one harness at a time."""
    cfg = dataclasses.replace(cfg or HarnessConfig(), **overrides)
    if cfg.ping_pong and not cfg.mamba:
        raise ValueError("ping_pong needs mamba=True")
    if cfg.device not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, not {cfg.device!r}")
    if cfg.device == "cuda" and cfg.page_size != 1:
        raise ValueError("device='cuda' runs page_size 1 (the paged Triton kernel is not set up)")
    t0 = time.perf_counter()
    stack = contextlib.ExitStack()
    try:
        return _build(cfg, stack, t0)
    except BaseException:
        stack.close()
        raise


def _build(cfg: HarnessConfig, stack: contextlib.ExitStack, t0: float) -> Harness:
    saved_context = runtime_context.snapshot_context()
    stack.callback(runtime_context.restore_context, saved_context)
    model_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sched-harness-")))
    (model_dir / "config.json").write_text(json.dumps(_TINY_LLAMA))
    server_args = _publish(cfg, model_dir)

    log = DeviceLog()
    engines: list[FakeL2TransferEngine] = []
    device: FakeDeviceModule | CudaDevice
    forward_stream: Any
    if cfg.device == "cuda":
        # The real device: torch.cuda events and streams, the real L2TransferEngine, real
        # page-locked host pools.
        device = CudaDevice()
        forward_stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    else:
        fake = device = FakeDeviceModule(log, auto_complete=cfg.auto_complete_events)
        forward_stream = FakeStream(fake, "forward")

        def make_engine(io_backend: str) -> FakeL2TransferEngine:
            engines.append(FakeL2TransferEngine(fake, io_backend))
            return engines[-1]

        # Patched for the harness's lifetime: LayerDoneCounter's events are made at construction
        # (cache_controller.py:55-58), the rest when a transfer is submitted.
        stack.enter_context(mock.patch.object(cache_controller, "device_module", fake))
        stack.enter_context(mock.patch.object(l2_transfer, "device_module", fake))
        stack.enter_context(mock.patch.object(cache_controller, "L2TransferEngine", make_engine))
        stack.enter_context(
            mock.patch.object(paged_allocator, "alloc_extend_kernel", NaiveAllocExtendKernel())
        )
        stack.enter_context(
            mock.patch.object(paged_allocator, "alloc_decode_kernel", NaiveAllocDecodeKernel())
        )
        stack.enter_context(mock.patch.object(host_pool_common, "_cuda_host_register", _no_host_register))

    model_config = ModelConfig.from_server_args(server_args)  # what init_model_config does (:781)
    req_to_token_pool, allocator = _build_pools(cfg, model_config)
    physical = None
    if cfg.elastic:
        allocator.rank_local_capacity = True
        physical = PhysicalMemory(allocator)
    worker = CpuModelWorker(
        CpuModelRunner(
            attn_backend=object(),
            forward_stream=forward_stream,
            effective_max_total_num_tokens=cfg.kv_tokens,
            effective_logical_max_total_num_tokens=cfg.kv_tokens,
        )
    )

    # kv_cache_builder.py:303-355: the params and the registry call build_kv_cache makes.
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=cfg.page_size,
        # kv_cache_builder.py:316-321
        tp_cache_group=cfg.attn_tp_cpu_group if cfg.enable_dp_attention else cfg.tp_cpu_group,
        attn_cp_cache_group=cfg.attn_cp_cpu_group,
        attn_tp_cache_group=cfg.attn_tp_cpu_group,
        eviction_policy=runtime_context.get_memory().radix_eviction_policy,
        enable_mamba_extra_buffer=runtime_context.get_exec().mamba.enable_mamba_extra_buffer,
        chunked_prefill_size=cfg.chunked_prefill_size,
    )
    tree_cache = create_tree_cache(
        _construct(
            TreeCacheBuildContext,
            server_args=server_args,
            params=params,
            is_hybrid_swa=False,
            is_hybrid_ssm=cfg.mamba,
            enable_hierarchical_cache=cfg.hicache,
            disable_radix_cache=False,
            effective_chunked_prefill_size=cfg.chunked_prefill_size,  # up to 0.5.21
            tp_worker=worker,
            model_config=model_config,
            tp_size=cfg.tp_size,
            tp_rank=0,
            tp_group=None,
        )
    )
    assert isinstance(tree_cache, UnifiedRadixCache), type(tree_cache)
    stack.callback(_shutdown_tree_cache, tree_cache)

    if tree_cache.cache_controller is not None and cfg.device == "cpu":
        _name_load_events(tree_cache.cache_controller.layer_done_counter)
    sched = _make_scheduler(cfg, server_args, model_config, worker, req_to_token_pool, allocator, tree_cache)
    return Harness(
        cfg=cfg,
        scheduler=sched,
        tree_cache=tree_cache,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        device=device,
        device_log=log,
        transfer_engine=engines[0] if engines else None,
        build_seconds=time.perf_counter() - t0,
        _stack=stack,
        physical=physical,
    )


def _name_load_events(counter: cache_controller.LayerDoneCounter) -> None:
    """Readable names in the device log: load<slot>.start / load<slot>.layer<i>; the slot's
    `finish_event` is its last layer (cache_controller.py:66-68)."""
    for slot, loading_event in enumerate(counter.events):
        loading_event.start_event.name = f"load{slot}.start"
        for layer, event in enumerate(loading_event.load_events):
            event.name = f"load{slot}.layer{layer}"


def _shutdown_tree_cache(tree_cache: UnifiedRadixCache) -> None:
    if tree_cache.cache_controller is not None:
        tree_cache.shutdown()


def _device_match_len(match: Any) -> int:
    """Device-resident tokens of a MatchResult: `device_indices` up to 0.5.21,
    `device_prefix_len` from 0.5.22 on."""
    if hasattr(match, "device_prefix_len"):
        return int(match.device_prefix_len)
    return len(match.device_indices)


def _kv_shard_widening(allocator: Any) -> int:
    """What build_kv_cache sets from upstream's page_interleave_shard_size (0.5.21 on)."""
    try:
        from sglang.srt.mem_cache.allocator.page_interleave import page_interleave_shard_size
    except ImportError:  # 0.5.20: no page interleaving, nothing reads it
        return 1
    return int(page_interleave_shard_size(allocator))


def _construct(cls: Callable[..., Any], **kwargs: Any) -> Any:
    """Call an upstream constructor whose keyword parameters differ between the carried sglang
    lines with those of `kwargs` it takes. A parameter it requires that `kwargs` lacks is a line
    the harness does not know yet: fail naming it rather than guess."""
    params = inspect.signature(cls).parameters
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
        and name not in kwargs
    ]
    if missing:
        raise TypeError(f"{cls.__name__} of this sglang line needs {missing}: extend the harness")
    return cls(**{k: v for k, v in kwargs.items() if k in params})


def _make_scheduler(
    cfg: HarnessConfig,
    server_args: ServerArgs,
    model_config: ModelConfig,
    worker: CpuModelWorker,
    req_to_token_pool: ReqToTokenPool,
    allocator: Any,
    tree_cache: UnifiedRadixCache,
) -> Scheduler:
    """A Scheduler holding exactly what `_get_new_batch_prefill_raw` (:3757-4071), the helpers it
    calls on `self` (get_num_allocatable_reqs :3710, _add_request_to_queue :3193) and the
    harness's request path (init_req_max_new_tokens :2510) read. `:N` = scheduler.py line N."""
    memory, schedule = runtime_context.get_memory(), runtime_context.get_schedule()
    s = Scheduler.__new__(Scheduler)

    # -- model, pools, cache (init_model_config :781, build_kv_cache :582-616) ---------------
    s.server_args = server_args  # read by the init_* methods called below
    s.model_config = model_config  # :4002 ScheduleBatch.init_new; Req vocab/eos in make_req
    s.tp_worker = worker  # :3827 attn_backend, :4020 model_runner.prefill_aware_swa
    s.req_to_token_pool = req_to_token_pool  # :3717, :3869 mamba_allocator, :3891, :3999
    s.token_to_kv_pool_allocator = allocator  # :3836 PrefillAdder, :4000 init_new
    s.tree_cache = tree_cache  # :3835, :3872 buffer_pipeline, :3962, :4001, :4015 load
    s.is_hybrid_swa = False  # :3768
    # 0.5.21 on: init_req_max_new_tokens reads these (build_kv_cache sets them from its result).
    s.sliding_window_size = None
    s.kv_shard_widening = _kv_shard_widening(allocator)
    # -- worker info (init_model_worker :1164-1177, from TpModelWorker.get_worker_info) -----
    s.max_total_num_tokens = allocator.size  # :2537 init_req_max_new_tokens
    s.max_prefill_tokens = schedule.max_prefill_tokens  # :3839 PrefillAdder
    s.max_running_requests = cfg.req_rows  # :3844 PrefillAdder
    s.max_queued_requests = schedule.max_queued_requests  # :3261 _abort_on_queued_limit
    s.max_req_len = min(model_config.context_len - 1, allocator.size - 1)  # :2536
    s.device = cfg.device  # :4060 (mixed chunk with spec only)
    s.min_free_slots_delayer = None  # :3780; resolve_min_free_slots(None, ...) is None (:1181)
    # -- parsed args (__init__ :467-512) ------------------------------------------------------
    s.page_size = schedule.page_size  # :3834 PrefillAdder; :2531, :2539
    s.enable_overlap = cfg.enable_overlap  # :4003 init_new, :4054
    s.spec_algorithm = SpeculativeAlgorithm.from_string(runtime_context.get_spec().speculative_algorithm)
    #   ^ :4004 init_new, :4054
    s.enable_hierarchical_cache = memory.enable_hierarchical_cache  # :3942, :4012
    s.enable_unified_cache_external_linker = memory.enable_unified_cache_external_linker  # :3943, :4012
    s.enable_hicache_storage = memory.hicache_storage_backend is not None  # :3900, :3920, :3978
    s.enable_lmcache = getattr(memory, "enable_lmcache", False)  # 0.5.21 on: _prefetch_kvcache
    s.enable_lora = runtime_context.get_lora().enable_lora  # :3856, :3875, :3936
    s.max_new_tokens_limit = None  # :2517 (SGLANG_MAX_NEW_TOKENS_LIMIT unset)
    s.schedule_policy = schedule.schedule_policy  # init_schedule_policy
    s.enable_priority_scheduling = schedule.enable_priority_scheduling  # :4028, :3231
    s.schedule_low_priority_values_first = schedule.schedule_low_priority_values_first  # :3232
    s.abort_on_priority_when_disabled = schedule.abort_on_priority_when_disabled  # :3239
    s.priority_scheduling_preemption_threshold = schedule.priority_scheduling_preemption_threshold
    #   ^ :3842 PrefillAdder
    # -- run state (init_running_status :1272, init_disaggregation :1459) -------------------
    s.disaggregation_mode = DisaggregationMode(runtime_context.get_disagg().disaggregation_mode)
    #   ^ :3888, :3200 _add_request_to_queue
    s.waiting_queue = []  # :3773, :3806, :3871, :3981
    s.rust_server = None  # send_abort_output (0.5.23): the zmq channel, not the Rust egress
    s.enable_hisparse = False  # 0.5.23 :607 (memory args; the unwind refuses HiSparse)
    # The unwind's back-off sleeps with nothing running; a harness never sleeps it (tests that
    # check it put a fake clock here).
    s._prefill_unwind_sleep = lambda seconds: None
    s.running_batch = ScheduleBatch(reqs=[], batch_is_full=False)  # :3719; run_round passes it
    s.processed_tokens_counter = 0  # :3808 calc_priority, :3206
    s.dynamic_chunk_sizer = None  # :3819 (maybe_init_dynamic_chunk_sizer: PP only)
    s.future_map = None  # :4062 (mixed chunk with spec only)
    s.hisparse_coordinator = None  # 0.5.22 on: init_new's batch field (init_hisparse_coordinator)
    # -- real init_* methods that read only the above and the published config ------------
    s.init_chunked_prefill()  # chunked_prefill_size :3818, chunked_req :3774, is_mixed_chunk :3841
    s.init_diffusion_llm()  # dllm_config :3847
    s.init_schedule_policy()  # policy :3805, enable_priority_preemption :3768, max_prefill_bs
    #                           :3843, new_token_ratio_tracker :3838, prefill_delayer (None)
    s.init_deterministic_inference_config()  # truncation_align_size :3933
    # get_num_allocatable_reqs reads get_parallel().pp_max_micro_batch_size (:3716); the real
    # init_model_worker fills the default the same way (:1190-1196).
    runtime_context.get_context().override(
        "scheduler.pp_max_micro_batch_size_default", pp_max_micro_batch_size=max(cfg.req_rows, 1)
    )
    # -- collaborators: real classes; constructors that need TP/PP groups are skipped ------
    grammar = GrammarManager.__new__(GrammarManager)  # __init__ needs the dp-tp group
    grammar.grammar_queue = []  # :3763 has_waiting_grammars()
    s.grammar_manager = grammar
    s.beam_coordinator = BeamCoordinator(  # :3721 pending_member_rows()
        model_config=model_config,
        spec_algorithm=s.spec_algorithm,
        dllm_enabled=s.dllm_config is not None,
        max_req_len=s.max_req_len,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree_cache,
        future_map=None,
    )
    s.load_inquirer = _construct(  # :4029 _get_num_pending_tokens()
        SchedulerLoadInquirer,
        disaggregation_mode=s.disaggregation_mode,
        ps=None,  # 0.5.20 only
        server_args=server_args,
        max_total_num_tokens=s.max_total_num_tokens,
        max_running_requests=s.max_running_requests,
        pool_stats_observer=None,
        tp_worker=worker,
        token_to_kv_pool_allocator=allocator,
        spec_algorithm=s.spec_algorithm,
        get_running_batch=lambda: s.running_batch,
        get_waiting_queue=lambda: s.waiting_queue,
        waiting_queue_prefix_matched=lambda: s.policy.waiting_queue_prefix_matched(s.waiting_queue),
        get_recent_cache_hit_rate=lambda: 0.0,
        get_stats=lambda: None,
        get_chunked_req=lambda: s.chunked_req,
        get_disagg_prefill_bootstrap_queue=lambda: None,
        get_disagg_prefill_inflight_queue=lambda: None,
        get_disagg_decode_prealloc_queue=lambda: None,
        get_disagg_decode_transfer_queue=lambda: None,
        get_spec_total_num_accept_tokens=lambda: 0,
        get_spec_total_num_forward_ct=lambda: 0,
        get_total_prefill_uncached_tokens=lambda: 0,
        get_total_prefill_busy_us=lambda: 0,
        get_decode_moment_totals=lambda: [0.0] * 6,
        get_waiting_storage_span=getattr(tree_cache, "waiting_storage_span", None),  # 0.5.23 on
    )
    # -- distributed handles: not read by the pristine method; a patched unwind that agrees
    #    across TP ranks would use them (init_model_worker :1198-1201 sets them from the groups).
    s.tp_cpu_group = cfg.tp_cpu_group
    s.attn_tp_cpu_group = cfg.attn_tp_cpu_group
    s.attn_cp_cpu_group = cfg.attn_cp_cpu_group
    s.enable_dp_attention = cfg.enable_dp_attention
    # I/O boundary: what the scheduler sends to the tokenizer (aborts) is kept, not sent.
    s.ipc_channels = FakeIpcChannels()
    # Metrics off, as by default; a test turns them on with `enable_metrics()`.
    s.metrics_reporter = MetricsReporterStub(enable_metrics=False, metrics_collector=None)
    # :617-622: HiCache loads are fenced behind the forward stream.
    if tree_cache.cache_controller is not None:
        tree_cache.cache_controller.load_fence_stream = worker.model_runner.forward_stream
    return s
