"""Drive the REAL sglang `Scheduler.event_loop_normal` iteration on CPU, on a `scheduler_harness`
Harness; `OverlapEventLoopDriver` drives `event_loop_overlap`'s (the default server's loop: a
batch's result is processed in the next iteration, after that one's batch was launched), with the
harness's fake device's streams and events.

One `EventLoopDriver.step()` is one pass of `event_loop_normal`'s body (scheduler.py:2144-2175 at
0.5.23), with the same calls in the same order and the same updates of `running_batch`,
`cur_batch_for_debug` and `last_batch`:

    self.ingest_requests()
    plan = self.get_next_batch_to_run(running_batch=self.running_batch, last_batch=self.last_batch)
    self.running_batch = plan.running_batch
    batch = plan.batch_to_run
    self.cur_batch_for_debug = batch
    if batch: result = self.run_batch(batch); self.process_batch_result(batch, result)
    else: self._sched_idled = True; self.on_idle()
    self.last_batch = batch

The receive step is the real `ingest_requests` (every loop's first call: it hands the agreed
ledger back after an idle iteration, dispatches what arrived, runs the pending flushes), at a
request receiver where nothing arrives (`NoArrivals`, in place of the ZMQ sockets and the TP
broadcast): a test queues its requests itself (`Harness.add_request`) between steps, where the
loop would have received them.

The only fake is the model forward: `Scheduler.model_worker` (the TP worker `run_batch` calls,
scheduler.py:5717) is a `FixedTokenWorker` whose `forward_batch_generation` returns, in the
`GenerationBatchResult` `process_batch_result` reads, a fixed next token for every request, after
doing what the real worker does at the device boundary before its forward (the HiCache consumer
index, tp_worker.py:637). Everything else is upstream code: `get_next_batch_to_run`, admission and
allocation, `update_running_batch` / `prepare_for_decode` (and with rank-local pools the decode
vote and credit), `run_batch`'s relay through the real `FutureMap`, the real
`SchedulerBatchResultProcessor` (finish, `release_kv_cache`, streaming to a fake channel) and, when
idle, the real `on_idle` (the scheduler's own leak check).

Constructing `EventLoopDriver(h)` sets on the harness's scheduler only the attributes these methods read that
the harness did not set, with the values `Scheduler.__init__` gives them for a single-GPU CPU
server with `--disable-overlap-schedule` (`disable_overlap_schedule` is the harness's
`enable_overlap=False`); where `__init__` gets one from a real `init_*` method that reads only what
the harness holds, that method runs. The harness's metrics stub (no reporter methods) is replaced by
the real `SchedulerMetricsReporter` with metrics off, and its `future_map=None` by the real
`FutureMap` (0.5.23 relays every decode step's input ids through it). What was set is listed in
`EventLoopDriver.installed`. The process's ranks, which the real scheduler's process writes when it
builds its groups, are stated for the harness's life (the TP, attention-TP and attention-CP groups
as `GroupStandIn`s around the harness's gloo groups).

Where the tree differs (another sglang line), the driver checks for what it calls (the loop's body,
by source; the methods, modules and constructor parameters it uses) and fails naming the missing
piece (EventLoopUnsupported) rather than guess. It feature-detects the line, never by version:
an attribute is set only where the tree's own `init_*` (or `__init__`) assigns it, read from that
method's source (`_Installer.set(..., by=...)`); constructors and `init_*` methods get the keywords
their signature names (`scheduler_harness._construct`); the ranks go to the tree's ParallelContext
where it has the field, else to `Scheduler.ps` as 0.5.20's __init__ builds it. event_loop_normal's
body is the same on 0.5.20-0.5.23. Every loop it runs is bounded (`run_until_idle`).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import scheduler_harness as sh
import torch
from sglang.srt import runtime_context
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler

# The calls both loops' bodies begin with, in order (the driver's _next_batch).
_LOOP_HEAD = (
    "if self.gracefully_exit:",
    "self.ingest_requests()",
    "if self._engine_paused:",
    "self._record_scheduler_state_for_paused_engine()",
    "self.get_next_batch_to_run(",
    "self.running_batch = plan.running_batch",
    "batch = plan.batch_to_run",
    "self.cur_batch_for_debug = batch",
)
# The calls of event_loop_normal's body this driver replays, in order (a guard against a tree whose
# loop changed: the driver would then replay a loop that no longer exists).
_LOOP_CALLS = (
    *_LOOP_HEAD,
    "self.run_batch(batch)",
    "self.process_batch_result(batch, result)",
    "self._sched_idled = True",
    "self.on_idle()",
    "self.last_batch = batch",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY",
    "self.invariant_checker.self_check_during_busy()",
)

# The calls of event_loop_overlap's body OverlapEventLoopDriver replays, in order (the same guard).
_OVERLAP_LOOP_CALLS = (
    "self.result_queue",
    "def pop_and_process():",
    "self.result_queue.popleft()",
    "self.process_batch_result(tmp_batch, tmp_result)",
    *_LOOP_HEAD,
    "self.is_disable_overlap_for_batch(",
    "if disable_overlap_for_batch:",
    "pop_and_process()",
    "self.run_batch(batch)",
    "self._apply_war_barrier()",
    "self.result_queue.append((batch.copy(), batch_result))",
    "self._sched_idled = True",
    "if self.last_batch:",
    "if not disable_overlap_for_batch:",
    "pop_and_process()",
    "elif batch is None:",
    "self.on_idle()",
    "self.launch_batch_sample_if_needed(batch_result, batch)",
    "self.last_batch = batch",
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY",
    "self.invariant_checker.self_check_during_busy()",
)

NEXT_TOKEN = 7


class EventLoopUnsupported(RuntimeError):
    """The imported sglang tree lacks something the driver replays."""


class LoopExited(RuntimeError):
    """event_loop_normal would have left its loop (`gracefully_exit`)."""


@dataclass(frozen=True)
class Iteration:
    """What one loop iteration ran: its batch's forward mode and requests (None: no batch), and
    the tokens its prefill computed (0 for a decode step)."""

    forward_mode: str | None
    rids: tuple[str, ...]
    extend_tokens: int = 0

    @staticmethod
    def of(batch: ScheduleBatch | None) -> Iteration:
        if batch is None:
            return Iteration(None, ())
        mode = batch.forward_mode
        tokens = int(batch.extend_num_tokens or 0) if mode.is_extend() else 0
        return Iteration(mode.name, tuple(req.rid for req in batch.reqs), tokens)


@dataclass
class FixedTokenWorker:
    """The model forward: `forward_batch_generation` as `TpModelWorker` answers it
    (tp_worker.py:622-760), with the model replaced by a fixed next token for every request.
    Attribute reads other than the forward go to the harness's CPU worker."""

    inner: Any
    next_token: int = NEXT_TOKEN
    forwards: list[Iteration] = field(default_factory=list)

    def forward_batch_generation(self, batch: ScheduleBatch, **kwargs: Any) -> Any:
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        # tp_worker.py:637: the HiCache consumer index the model's layers wait on.
        counter = getattr(self.inner, "hicache_layer_transfer_counter", None)
        if counter is not None:
            counter.set_consumer(batch.hicache_consumer_index)
        self.forwards.append(Iteration.of(batch))
        rows = len(batch.reqs)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=torch.zeros(rows, 1)),
            next_token_ids=torch.full((rows,), self.next_token, dtype=torch.int64),
            can_run_cuda_graph=False,
        )

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copying): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


def check_tree(overlap: bool = False) -> None:
    """The imported tree's loop (event_loop_overlap with `overlap`, else event_loop_normal) makes
    the calls the driver replays, in its order (EventLoopUnsupported naming the first it lacks)."""
    methods: tuple[str, ...] = ("get_next_batch_to_run", "run_batch", "process_batch_result", "on_idle")
    if overlap:
        methods += ("is_disable_overlap_for_batch", "_apply_war_barrier", "launch_batch_sample_if_needed")
    missing = [name for name in methods if not callable(getattr(Scheduler, name, None))]
    if missing:
        raise EventLoopUnsupported(f"this sglang tree's Scheduler has no {missing}")
    params = inspect.signature(Scheduler.get_next_batch_to_run).parameters
    if "running_batch" not in params or "last_batch" not in params:
        raise EventLoopUnsupported(
            "get_next_batch_to_run(running_batch, last_batch) returning a plan is the loop this "
            f"driver replays; this tree's takes {list(params)}"
        )
    loop = "event_loop_overlap" if overlap else "event_loop_normal"
    source = inspect.getsource(getattr(Scheduler, loop))
    at = 0
    for call in _OVERLAP_LOOP_CALLS if overlap else _LOOP_CALLS:
        found = source.find(call, at)
        if found < 0:
            raise EventLoopUnsupported(
                f"{loop} of this tree no longer makes {call!r} where the driver expects it"
            )
        at = found + len(call)


class EventLoopDriver:
    """Runs `event_loop_normal`'s iteration on a harness's scheduler (see the module docstring)."""

    overlap = False  # the loop a server runs with --disable-overlap-schedule

    def __init__(self, h: sh.Harness, next_token: int = NEXT_TOKEN) -> None:
        check_tree(self.overlap)
        self.h = h
        self.scheduler = h.scheduler
        self.worker = FixedTokenWorker(h.scheduler.tp_worker, next_token)
        self.installed: list[str] = []
        self.detokenizer = sh.FakeTokenizerChannel()  # what the scheduler streams out
        self.iterations: list[Iteration] = []
        # Whether the last step ran on_idle (the scheduler's own idle check).
        self.ran_on_idle = False
        _install(self, h)

    def step(self) -> Iteration:
        """One iteration of event_loop_normal (scheduler.py:2146-2175 at 0.5.23), without
        receiving requests."""
        s = self.scheduler
        paused, batch = self._next_batch()
        if paused is not None:
            return paused
        self.ran_on_idle = False
        if batch:
            result = s.run_batch(batch)
            s.process_batch_result(batch, result)
        else:
            s._sched_idled = True
            s.on_idle()
            self.ran_on_idle = True
        return self._end(batch)

    def _next_batch(self) -> tuple[Iteration | None, ScheduleBatch | None]:
        """The head of both loops' iteration, nothing arriving: (the PAUSED iteration,
        None) where the engine is paused, else (None, the batch get_next_batch_to_run planned)."""
        s = self.scheduler
        if s.gracefully_exit:
            raise LoopExited("the scheduler was asked to exit (gracefully_exit)")
        s.ingest_requests()  # nothing arrives: the test queues its requests itself
        if s._engine_paused:
            s._record_scheduler_state_for_paused_engine()
            it = Iteration("PAUSED", ())
            self.iterations.append(it)
            return it, None
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        s.cur_batch_for_debug = plan.batch_to_run
        return None, plan.batch_to_run

    def _end(self, batch: ScheduleBatch | None) -> Iteration:
        """The tail of both loops' iteration: `last_batch`, the strict check where it is on."""
        from sglang.srt.managers import scheduler as scheduler_module

        s = self.scheduler
        s.last_batch = batch
        if scheduler_module.envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY.get():
            s.invariant_checker.self_check_during_busy()
        it = Iteration.of(batch)
        self.iterations.append(it)
        return it

    def is_idle(self) -> bool:
        """The scheduler's own test (is_fully_idle): nothing running, queued or in flight."""
        return bool(self.scheduler.is_fully_idle())

    def run_until(self, done: Callable[[], bool], max_iterations: int) -> list[Iteration]:
        """Step until `done()` holds after a step; at most `max_iterations` steps (AssertionError
        past that, with the last iterations)."""
        ran: list[Iteration] = []
        for _ in range(max_iterations):
            ran.append(self.step())
            if done():
                return ran
        raise AssertionError(f"not done after {max_iterations} iterations; the last: {ran[-6:]}")

    def run_until_idle(self, max_iterations: int = 200) -> list[Iteration]:
        """Step until an iteration ran `on_idle` (the scheduler's own idle leak check among it)
        with the scheduler fully idle; at most `max_iterations` steps. (The overlap loop runs it
        only in an iteration that follows one without a batch: the one before processed the
        last batch's result.)"""
        return self.run_until(lambda: self.ran_on_idle and self.is_idle(), max_iterations)

    def run(self, iterations: int) -> list[Iteration]:
        return [self.step() for _ in range(iterations)]


class OverlapEventLoopDriver(EventLoopDriver):
    """Runs `event_loop_overlap`'s iteration (scheduler.py:2199-2272 at 0.5.23; the same body on
    0.5.20-0.5.23): a batch's result is processed in the NEXT iteration, after that iteration's
    batch was launched, so its admission and decode step are prepared before the previous
    batch's requests finish (and the skip of a finishing request's decode, 0.5.22 on).

    The device boundary is the harness's fake device: the schedule, forward and copy streams are
    its FakeStreams, `copy_done` its FakeEvent. Its constructor runs the loop's prologue (a fresh
    result queue; enable_skip_finishing_decode where this tree's loop sets it)."""

    overlap = True

    def __init__(self, h: sh.Harness, next_token: int = NEXT_TOKEN) -> None:
        super().__init__(h, next_token)
        s = self.scheduler
        s.result_queue = collections.deque()
        # 0.5.22 on: a request whose last token is still in flight is not decoded again. Before,
        # the loop runs one more decode step for it, whose token is thrown away.
        self.skips_finishing_decode = "self.enable_skip_finishing_decode = True" in inspect.getsource(
            Scheduler.event_loop_overlap
        )
        if self.skips_finishing_decode:
            s.enable_skip_finishing_decode = True

    def _pop_and_process(self) -> None:
        s = self.scheduler
        done_batch, done_result = s.result_queue.popleft()
        s.process_batch_result(done_batch, done_result)

    def step(self) -> Iteration:
        """One iteration of event_loop_overlap, without receiving requests."""
        s = self.scheduler
        paused, batch = self._next_batch()
        if paused is not None:
            return paused
        disable_overlap_for_batch = s.is_disable_overlap_for_batch(batch, last_batch=s.last_batch)
        if disable_overlap_for_batch:
            self._pop_and_process()
            if s.enable_unified_memory:
                with contextlib.suppress(Exception):
                    s.token_to_kv_pool_allocator.flush_opportunistic()
        if batch:
            batch_result = s.run_batch(batch)
            s._apply_war_barrier()
            s.result_queue.append((batch.copy(), batch_result))
        else:
            batch_result = None
            s._sched_idled = True
        self.ran_on_idle = False
        if s.last_batch:
            if not disable_overlap_for_batch:
                self._pop_and_process()
        elif batch is None:
            s.on_idle()
            self.ran_on_idle = True
        if s.is_generation:
            s.launch_batch_sample_if_needed(batch_result, batch)
        return self._end(batch)


class StreamContextStandIn:
    """What `device_module.stream(stream)` returns on a real device: a context that can be entered
    again and again (the loop keeps one per stream), here around the fake device's `stream()`."""

    def __init__(self, device: Any, stream: Any) -> None:
        self.device, self.stream = device, stream
        self._entered: list[Any] = []

    def __enter__(self) -> Any:
        context = self.device.stream(self.stream)
        self._entered.append(context)
        return context.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._entered.pop().__exit__(*exc)


# --------------------------------------------------------------------------------------------
# What __init__ would have set
# --------------------------------------------------------------------------------------------
class NoArrivals:
    """The scheduler's request receiver (its ZMQ sockets and the TP broadcast of what arrived), at
    which nothing arrives but what the scheduler itself hands it (rank 0's timeout aborts)."""

    def recv_requests(self, local_reqs: list[Any] | None = None) -> list[Any]:
        return list(local_reqs or [])


class _Installer:
    """Sets what the loop reads and the harness did not: each name once, listed in `names`."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.names: list[str] = []
        self._assigned: dict[str, set[str]] = {}

    def missing(self, name: str) -> bool:
        return not hasattr(self.s, name)

    def assigned_by(self, init: str) -> set[str]:
        """The attributes this tree's `Scheduler.<init>` assigns on `self`, read from its source."""
        if init not in self._assigned:
            self._assigned[init] = _assigned_by(init)
        return self._assigned[init]

    def set(self, name: str, make: Callable[[], Any], by: str) -> None:
        """`name` = make(), where the harness did not set it and this tree's `Scheduler.<by>` sets
        it (a line whose `<by>` does not set `name` has no such attribute to read)."""
        if self.missing(name) and name in self.assigned_by(by):
            setattr(self.s, name, make())
            self.names.append(name)

    def call(self, init: str, sets: tuple[str, ...], **args: Any) -> None:
        """Run the real `Scheduler.<init>()`, which sets `sets`, where none of them is set yet;
        with those of `args` its signature names (what __init__ passes it on lines where it takes
        parameters)."""
        present = [name for name in sets if not self.missing(name)]
        if present:
            raise EventLoopUnsupported(f"{init} would overwrite {present}, which the harness set")
        method = getattr(self.s, init, None)
        if not callable(method):
            raise EventLoopUnsupported(f"this sglang tree's Scheduler has no {init}()")
        sh._construct(method, **args)
        self.names.extend(f"{name} ({init})" for name in sets)

    def replace(self, name: str, value: Any, why: str) -> None:
        setattr(self.s, name, value)
        self.names.append(f"{name} (replaced: {why})")


def _upstream(module: str, name: str | None = None) -> Any:
    """An upstream module, or a name in it; EventLoopUnsupported naming what this tree lacks."""
    try:
        found = importlib.import_module(module)
    except ImportError as error:
        raise EventLoopUnsupported(f"this sglang tree has no {module} ({error})") from error
    if name is None:
        return found
    if not hasattr(found, name):
        raise EventLoopUnsupported(f"this sglang tree has no {module}.{name}")
    return getattr(found, name)


def _upstream_name(module: Any, name: str) -> Any:
    if not hasattr(module, name):
        raise EventLoopUnsupported(f"this sglang tree has no {module.__name__}.{name}")
    return getattr(module, name)


def _assigned_by(init: str) -> set[str]:
    """The attributes `Scheduler.<init>` of this tree assigns on `self` (`self.NAME = ...`,
    `self.NAME: T = ...`, also within a tuple target), read from its source."""
    method = getattr(Scheduler, init, None)
    if not callable(method):
        raise EventLoopUnsupported(f"this sglang tree's Scheduler has no {init}()")
    tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
    names: set[str] = set()
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if (
                    isinstance(part, ast.Attribute)
                    and isinstance(part.value, ast.Name)
                    and part.value.id == "self"
                ):
                    names.add(part.attr)
    return names


def _rank_in(group: Any) -> int:
    if group is None or not torch.distributed.is_initialized():
        return 0
    return int(torch.distributed.get_rank(group))


@dataclass(frozen=True)
class GroupStandIn:
    """What the scheduler's components read of a `GroupCoordinator` (its CPU group, width and this
    rank's place), for the harness's gloo groups; the device communicators are not built."""

    cpu_group: Any
    world_size: int
    rank_in_group: int

    @staticmethod
    def of(group: Any) -> GroupStandIn:
        if group is None or not torch.distributed.is_initialized():
            return GroupStandIn(group, 1, 0)
        return GroupStandIn(group, torch.distributed.get_world_size(group), _rank_in(group))


def _parallel_fields() -> frozenset[str]:
    """The names `ParallelContext.override` accepts in this tree."""
    fields = getattr(runtime_context, "_parallel_fields", None)  # 0.5.21 on
    if callable(fields):
        return frozenset(fields())
    return frozenset(_upstream_name(runtime_context, "_PARALLEL_FIELDS"))  # 0.5.20


def _parallel_state(scheduler_module: Any, ranks: dict[str, Any]) -> Any:
    """`Scheduler.ps` as 0.5.20's __init__ builds it (scheduler.py:655-685 at 0.5.20), from this
    process's ranks; the MoE ranks as the launcher computes them for a TP rank
    (entrypoints/engine.py:1904-1926 at 0.5.20, `_compute_parallelism_ranks`), gpu_id 0."""
    ParallelState = _upstream_name(scheduler_module, "ParallelState")
    world_info = _upstream_name(scheduler_module, "compute_dp_attention_world_info")
    p = runtime_context.get_parallel()
    tp_rank = ranks["tp_rank"]
    attn_tp_rank, attn_tp_size, attn_dp_rank, attn_dp_size = world_info(
        p.enable_dp_attention, tp_rank, p.tp_size, p.dp_size, p.attn_cp_size
    )
    moe_group = p.tp_size // p.moe_dp_size
    return ParallelState(
        tp_rank=tp_rank,
        tp_size=p.tp_size,
        pp_rank=ranks["pp_rank"],
        pp_size=p.pp_size,
        dp_rank=ranks["dp_rank"],
        dp_size=p.dp_size,
        attn_tp_rank=attn_tp_rank,
        attn_tp_size=attn_tp_size,
        attn_cp_rank=ranks["attn_cp_rank"],
        attn_cp_size=p.attn_cp_size,
        attn_dcp_rank=tp_rank % p.dcp_size,
        attn_dcp_size=p.dcp_size,
        attn_dp_rank=attn_dp_rank,
        attn_dp_size=attn_dp_size,
        moe_ep_rank=tp_rank % moe_group // (moe_group // p.ep_size),
        moe_ep_size=p.ep_size,
        moe_dp_rank=tp_rank // moe_group,
        moe_dp_size=p.moe_dp_size,
        gpu_id=0,
    )


def _ranks(cfg: sh.HarnessConfig) -> dict[str, Any]:
    """A TP rank's place in each group of the harness (no pipeline, no data parallelism), and the
    groups the scheduler's components read (the profiler takes the TP group's CPU group)."""
    return {
        "tp_group": GroupStandIn.of(cfg.tp_cpu_group),
        "attn_tp_group": GroupStandIn.of(cfg.attn_tp_cpu_group),
        "attn_cp_group": GroupStandIn.of(cfg.attn_cp_cpu_group),
        "tp_rank": _rank_in(cfg.tp_cpu_group),
        "pp_rank": 0,
        "attn_tp_rank": _rank_in(cfg.attn_tp_cpu_group),
        "attn_cp_rank": _rank_in(cfg.attn_cp_cpu_group),
        "attn_dp_rank": 0,
        "dp_rank": None,
    }


def _install(driver: EventLoopDriver, h: sh.Harness) -> None:
    """`:N` = scheduler.py line N at 0.5.23."""
    scheduler_module = _upstream("sglang.srt.managers.scheduler")
    overlap_utils = _upstream("sglang.srt.managers.overlap_utils")
    components = "sglang.srt.managers.scheduler_components"
    SchedulerBatchResultProcessor = _upstream(
        f"{components}.batch_result_processor", "SchedulerBatchResultProcessor"
    )
    SchedulerDPAttnAdapter = _upstream(f"{components}.dp_attn", "SchedulerDPAttnAdapter")
    SchedulerKvEventsPublisher = _upstream(f"{components}.kv_events_publisher", "SchedulerKvEventsPublisher")
    SchedulerLogprobResultProcessor = _upstream(
        f"{components}.logprob_result_processor", "SchedulerLogprobResultProcessor"
    )
    NgramEmbeddingManager = _upstream(
        "sglang.srt.model_executor.model_runner_components.ngram_embedding_manager", "NgramEmbeddingManager"
    )
    SessionController = _upstream("sglang.srt.session.session_controller", "SessionController")
    SchedulerFlushWrapper = _upstream(f"{components}.flush_wrapper", "SchedulerFlushWrapper")

    s = h.scheduler
    if s.enable_overlap and not driver.overlap:
        raise EventLoopUnsupported(
            "event_loop_normal runs with --disable-overlap-schedule: build the harness with "
            "enable_overlap=False (or drive event_loop_overlap: OverlapEventLoopDriver)"
        )
    if driver.overlap and not s.enable_overlap:
        raise EventLoopUnsupported("event_loop_overlap runs with enable_overlap=True (the harness's default)")
    if getattr(s.metrics_reporter, "enable_metrics", False):
        raise EventLoopUnsupported("install the driver before Harness.enable_metrics()")
    cfg = h.cfg
    rt = runtime_context
    i = _Installer(s)
    # This process's ranks, which the real scheduler's process writes when it builds its groups
    # (bootstrap.init_parallel_runtime, :655): for the harness's life.
    # ParallelContext.override updates its dict in place and puts a copy back on exit, while the
    # harness's restore_context (which runs after, at close) puts back the object it snapshotted:
    # the mutated one. Overriding on a copy leaves the snapshotted dict as it was.
    # A rank the tree's ParallelContext does not hold (0.5.20: dp_rank) its scheduler keeps in
    # `Scheduler.ps` (0.5.20 __init__:665), set below.
    ranks = _ranks(cfg)
    known = _parallel_fields()
    held = {name: value for name, value in ranks.items() if name in known}
    parallel = rt.get_parallel()
    parallel._overrides = dict(parallel._overrides)
    h._stack.enter_context(parallel.override(**held))
    if len(held) < len(ranks) and "ps" not in i.assigned_by("__init__"):
        raise EventLoopUnsupported(
            f"this tree's ParallelContext has no {sorted(set(ranks) - known)}, nor its Scheduler a ps"
        )
    i.set("ps", lambda: _parallel_state(scheduler_module, ranks), by="__init__")  # 0.5.20 only
    # The `ps` keyword of 0.5.20's component constructors (dropped by _construct where absent).
    ps: dict[str, Any] = {"ps": s.ps} if hasattr(s, "ps") else {}

    # Each `i.set(name, ..., by=init)` only where this tree's `init` sets `name` (see
    # _Installer.set): the lines differ in what __init__ sets.
    # -- __init__'s parsed args (:639-664) ------------------------------------------------------
    i.set("enable_pdmux", lambda: rt.get_disagg().enable_pdmux, by="__init__")
    i.set("enable_overlap_mlx", lambda: False, by="__init__")  # not disable_overlap_schedule...
    i.set("enable_unified_memory", lambda: rt.get_memory().enable_unified_memory, by="__init__")
    # :663 from 0.5.22; 0.5.20-0.5.21 set enable_dp_attention there instead, which the harness set.
    i.set("attn_dp_enabled", lambda: rt.get_parallel().attn_dp_enabled, by="__init__")
    i.set("is_generation", lambda: s.model_config.is_generation, by="init_tokenizer")  # :1031
    # -- model worker (init_model_worker :1246-1346) ------------------------------------------
    i.set("draft_worker", lambda: None, by="maybe_init_draft_worker")  # no speculative decoding
    #   :1344 model_worker = tp_worker: the fake forward
    i.set("model_worker", lambda: driver.worker, by="init_model_worker")
    # :1383 the TP group (a GroupStandIn; 0.5.20's SchedulerDPAttnAdapter takes it)
    i.set("tp_group", lambda: ranks["tp_group"], by="init_model_worker")
    # :1395-1396 the request-plane group: no DP attention here, so the TP group (0.5.20-0.5.21 pick
    # it by enable_dp_attention; their init_profiler reads it).
    i.set(
        "dp_tp_cpu_group",
        lambda: cfg.attn_tp_cpu_group if s.enable_dp_attention else cfg.tp_cpu_group,
        by="init_model_worker",
    )
    i.set("require_mlp_sync", scheduler_module.require_mlp_sync, by="init_moe_gemm_config")  # :1154
    i.set("decode_offload_manager", lambda: None, by="__init__")  # :786 (not a PD decode server)
    i.set("is_hybrid_ssm", lambda: cfg.mamba, by="__init__")  # :741 build_kv_cache result
    i.set("full_tokens_per_layer", lambda: None, by="__init__")  # :743 (no SWA)
    i.set("swa_tokens_per_layer", lambda: None, by="__init__")  # :744
    # -- running status (init_running_status :1463-1486); the harness set the queue and batch -
    i.set("gracefully_exit", lambda: False, by="init_running_status")
    i.set("last_batch", lambda: None, by="init_running_status")
    # :1475 from 0.5.22 (event_loop_overlap sets it True); not in 0.5.20-0.5.21.
    i.set("enable_skip_finishing_decode", lambda: False, by="init_running_status")
    i.set("forward_ct", lambda: 0, by="init_running_status")
    i.set("return_health_check_ipcs", collections.deque, by="init_running_status")
    i.set("session_controller", lambda: SessionController(s.tree_cache), by="init_running_status")
    # -- what ingest_requests reads (the loop's first call): the request receiver is the I/O
    #    boundary (ZMQ sockets and the TP broadcast of what arrived), here one at which nothing
    #    arrives: a test queues its requests between iterations, where they would have arrived.
    i.set("request_receiver", NoArrivals, by="init_request_receiver")
    i.set("_deferred_input_requests", list, by="init_running_status")  # 0.5.23
    i.set(
        "flush_wrapper",
        lambda: sh._construct(
            SchedulerFlushWrapper,
            flush_cache=s.flush_cache,
            is_fully_idle=s.is_fully_idle,
            send_output=getattr(s, "send_control_output", None),
            # Up to 0.5.21 it answers a flush that waited on the ZMQ channels, the I/O boundary:
            # no flush is requested here.
            ipc_channels=getattr(s, "ipc_channels", None),
        ),
        by="init_running_status",
    )
    i.set("external_corpus_manager", lambda: None, by="maybe_init_draft_worker")  # no speculative
    i.set("forward_sleep_time", lambda: None, by="init_running_status")
    i.set("_engine_paused", lambda: False, by="init_running_status")
    # -- IPC (init_ipc_channels :974) and idle sleep (init_idle_sleeper :999) ------------------
    i.set("load_snapshot_writer", lambda: None, by="init_ipc_channels")
    i.call("init_idle_sleeper", ("idle_sleeper",))
    # -- metrics (init_metrics_collector, init_metrics_reporter :1546, :785) ------------------
    # 0.5.20's init_metrics_collector and SchedulerMetricsReporter take the process's ranks.
    rank_args = {name: ranks[name] for name in ("tp_rank", "pp_rank", "dp_rank")}
    i.call("init_metrics_collector", ("metrics_collector_context", "metrics_collector"), **rank_args)
    reporter = sh._construct(
        scheduler_module.SchedulerMetricsReporter,
        **ps,
        **rank_args,
        scheduler=s,
        metrics_collector_context=s.metrics_collector_context,
        metrics_collector=s.metrics_collector,
    )
    i.replace("metrics_reporter", reporter, "the harness's stub has no reporter methods")
    i.set("scheduler_stage_metrics", lambda: reporter.scheduler_stage_metrics, by="__init__")  # :799
    # -- the FutureMap (init_overlap :1782-1803, built in either mode): every batch's next input ids
    #    are relayed through it (run_batch :5716-5724: _relay_forward_payload stashes them, the next
    #    resolve_forward_inputs gathers them).
    if s.future_map is None:
        attn_backends = (s.tp_worker.model_runner.attn_backend,)  # no draft worker
        future_map = s.spec_algorithm.create_future_map(
            s.device,
            s.req_to_token_pool,
            needs_cpu_seq_lens=overlap_utils.decide_needs_cpu_seq_lens(attn_backends),
            needs_confidence_relay=overlap_utils.decide_needs_confidence_relay(),
        )
        i.replace("future_map", future_map, "the harness's None: no batch ran before")
        # init_beam_coordinator (:2765) builds the coordinator with it.
        s.beam_coordinator.future_map = future_map
    # -- the overlap loop's streams (init_model_worker :1297 and :1348-1362, init_overlap
    #    :1848-1880, run_event_loop :2144): the harness's fake device, whose forward stream the
    #    model runner holds. The write-after-read barrier is CUDA's (is_cuda()), off here.
    if driver.overlap:
        device = h.device
        if not isinstance(device, sh.FakeDeviceModule):
            raise EventLoopUnsupported("OverlapEventLoopDriver drives the harness's CPU fake device")
        i.set("device_module", lambda: device, by="init_overlap")
        i.set("schedule_stream", lambda: device.Stream(), by="init_model_worker")
        i.set("forward_stream", lambda: s.tp_worker.model_runner.forward_stream, by="init_model_worker")
        i.set("forward_stream_ctx", lambda: StreamContextStandIn(device, s.forward_stream), by="init_overlap")
        i.set("copy_stream", lambda: device.Stream(), by="init_overlap")
        i.set("copy_stream_ctx", lambda: StreamContextStandIn(device, s.copy_stream), by="init_overlap")
        i.set("enable_async_d2h_copy", lambda: False, by="init_overlap")
        i.set("async_d2h_worker", lambda: None, by="init_overlap")
        i.set("_confidence_budget_prepare", lambda: None, by="init_overlap")
        i.set("batch_record_buf", lambda: [None] * 2, by="init_overlap")
        i.set("batch_record_ct", lambda: 0, by="init_overlap")
        i.set("_war_barrier_enabled", lambda: False, by="run_event_loop")
    # -- components ----------------------------------------------------------------------------
    i.call("maybe_init_scripted_scheduler_hook", ("scripted_scheduler_hook",))
    i.call("init_profiler", ("profiler_manager",))
    i.set(  # maybe_init_ngram_embedding (:1878): the model runner's, off for this model
        "ngram_embedding_manager",
        lambda: NgramEmbeddingManager.from_model(
            model=None,
            model_config=s.model_config,
            req_to_token_pool=s.req_to_token_pool,
            max_running_requests=s.max_running_requests,
            device=s.device,
        ),
        by="maybe_init_ngram_embedding",
    )
    i.set(  # init_dp_attn_adapter (:2633); the weight updater's offload_tags start empty
        "dp_attn_adapter",
        lambda: sh._construct(
            SchedulerDPAttnAdapter,
            **ps,
            model_runner=s.tp_worker.model_runner,
            req_to_token_pool=s.req_to_token_pool,
            token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
            tree_cache=s.tree_cache,
            offload_tags=set(),
            model_config=s.model_config,
            enable_overlap=s.enable_overlap,
            spec_algorithm=s.spec_algorithm,
            get_require_mlp_sync=lambda: s.require_mlp_sync,
            tp_group=s.tp_group,
        ),
        by="init_dp_attn_adapter",
    )
    i.call("init_pool_stats_observer", ("pool_stats_observer",))
    i.call("init_invariant_checker", ("invariant_checker",))
    i.set(  # init_kv_events_publisher (:2697); no kv events configured, so nothing is sent
        "kv_events_publisher",
        lambda: sh._construct(
            SchedulerKvEventsPublisher,
            **ps,
            kv_events_config=rt.get_observability().kv_events_config,
            # 0.5.20 (init_kv_events_publisher :2527-2540 there) also takes ps's ranks.
            **{
                name: getattr(s.ps, name)
                for name in ("attn_tp_rank", "attn_cp_rank", "attn_dp_rank", "dp_rank")
                if ps
            },
            tree_cache=s.tree_cache,
            send_metrics_from_scheduler=None,
            max_running_requests=s.max_running_requests,
            max_total_num_tokens=s.max_total_num_tokens,
            get_stats=lambda: s.metrics_reporter.stats,
        ),
        by="init_kv_events_publisher",
    )
    i.call("init_load_publisher", ("load_publisher",))
    # init_load_inquirer (:2716-2728): the step counters _record_step_counters keeps (the prefill
    # end time from 0.5.21, the pause windows from 0.5.23).
    inquirer = "init_load_inquirer"
    i.set("total_prefill_uncached_tokens", lambda: 0, by=inquirer)
    i.set("total_prefill_busy_us", lambda: 0, by=inquirer)
    i.set("decode_moment_totals", lambda: [0.0] * 6, by=inquirer)
    i.set("_prev_step", lambda: None, by=inquirer)
    i.set("_prev_prefill_end_ts", lambda: None, by=inquirer)
    i.set("_sched_idled", lambda: False, by=inquirer)
    i.set(
        "_pause_intervals",
        lambda: collections.deque(maxlen=_upstream_name(scheduler_module, "PAUSE_WINDOWS_MAX")),
        by=inquirer,
    )
    i.set("_pause_started_at", lambda: None, by=inquirer)
    i.set(  # init_output_streamer (:2772): to the detokenizer, a fake channel (I/O boundary)
        "output_streamer",
        lambda: sh._construct(
            s.get_output_streamer_class(),
            **ps,
            send_to_detokenizer=driver.detokenizer,
            tree_cache=s.tree_cache,
            server_args=s.server_args,
            is_generation=s.is_generation,
            spec_algorithm=s.spec_algorithm,
            disaggregation_mode=s.disaggregation_mode,
            enable_hicache_storage=lambda: s.enable_hicache_storage or s.enable_lmcache,
            rust_server=s.rust_server,
        ),
        by="init_output_streamer",
    )
    i.set(  # init_batch_result_processor (:2802), with the harness's beam coordinator
        "batch_result_processor",
        lambda: sh._construct(
            SchedulerBatchResultProcessor,
            **ps,
            is_generation=s.is_generation,
            disaggregation_mode=s.disaggregation_mode,
            enable_overlap=s.enable_overlap,
            enable_overlap_mlx=s.enable_overlap_mlx,
            model_config=s.model_config,
            token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
            tree_cache=s.tree_cache,
            hisparse_coordinator=s.hisparse_coordinator,
            req_to_token_pool=s.req_to_token_pool,
            decode_offload_manager=s.decode_offload_manager,
            metrics_collector=s.metrics_collector,
            metrics_reporter=s.metrics_reporter,
            draft_worker=s.draft_worker,
            model_worker=s.model_worker,
            logprob_result_processor=sh._construct(
                SchedulerLogprobResultProcessor, **ps, model_config=s.model_config
            ),
            output_streamer=s.output_streamer,
            beam_coordinator=s.beam_coordinator,
            abort_request=s.abort_request,
        ),
        by="init_batch_result_processor",
    )
    # -- what abort_request reads (a client's abort, as the tokenizer sends it) --------------------
    i.set("_pending_chunked_abort_req", lambda: None, by="init_running_status")
    i.set("enable_continuous_input_polling", lambda: False, by="init_running_status")
    i.set("result_queue", collections.deque, by="init_running_status")
    i.set("mm_receiver", lambda: None, by="init_disaggregation")  # not an EPD language-only server
    if i.missing("grammar_manager"):
        i.call("init_grammar_manager", ("grammar_manager",))
    driver.installed = i.names
