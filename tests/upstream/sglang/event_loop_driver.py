"""Run the REAL sglang scheduler event loop on CPU, on a `scheduler_harness` Harness: upstream's
own `dispatch_event_loop` picks the loop a server of the harness's configuration runs
(`event_loop_normal` with `enable_overlap=False`, `event_loop_overlap`, the default server's, with
`enable_overlap=True`: a batch's result is processed in the next iteration, after that one's batch
was launched, on the harness's fake device's streams and events), and the loop runs, unchanged and
uninterrupted from its prologue to its exit, on a thread of its own (`LOOP_THREAD_NAME`).

One `EventLoopDriver.step()` is one iteration of that loop. Every loop begins its iteration in
`Scheduler.ingest_requests`, whose receive (`request_receiver.recv_requests`, in a server the ZMQ
sockets and the TP broadcast of what arrived) is the I/O boundary: here it is an `IterationGate`
at which the loop waits for the test's next step. Test and loop take turns, never run together:
between two steps the loop waits in its receive, and the test queues requests
(`Harness.add_request`, where they would have arrived), delivers inputs the scheduler dispatches
itself (`deliver`: an `AbortReq` as the tokenizer sends it), drifts readings and reads state.
Whatever the loop raises (a scheduler stopping by name, upstream's leak check in `on_idle`) is
raised by the step. Every wait is bounded (`STEP_BOUND_S`): a loop stuck in a collective no peer
makes fails the step, naming that.

The only fake is the model forward: `Scheduler.model_worker` (the TP worker `run_batch` calls,
scheduler.py:5717) is a `FixedTokenWorker` whose `forward_batch_generation` returns, in the
`GenerationBatchResult` `process_batch_result` reads, a fixed next token for every request, after
doing what the real worker does at the device boundary before its forward (the HiCache consumer
index, tp_worker.py:637). Everything else is upstream code: the loop itself, `ingest_requests`,
`get_next_batch_to_run`, admission and allocation, `update_running_batch` / `prepare_for_decode`
(and with rank-local pools the decode vote and credit), `run_batch`'s relay through the real
`FutureMap`, the real `SchedulerBatchResultProcessor` (finish, `release_kv_cache`, streaming to a
fake channel) and, when idle, the real `on_idle` (the scheduler's own leak check).

Constructing `EventLoopDriver(h)` sets on the harness's scheduler only the attributes these methods read that
the harness did not set, with the values `Scheduler.__init__` gives them for a single-GPU CPU
server with `--disable-overlap-schedule` (`disable_overlap_schedule` is the harness's
`enable_overlap=False`); where `__init__` gets one from a real `init_*` method that reads only what
the harness holds, that method runs. The harness's metrics stub (no reporter methods) is replaced by
the real `SchedulerMetricsReporter` with metrics off, and its `future_map=None` by the real
`FutureMap` (0.5.23 relays every decode step's input ids through it). What was set is listed in
`EventLoopDriver.installed`. The process's ranks, which the real scheduler's process writes when it
builds its groups, are stated for the harness's life (the TP, attention-TP and attention-CP groups
as `GroupStandIn`s around the harness's gloo groups). Two spies note, calling through, whether an
iteration ran `on_idle` or was paused.

Where the tree differs (another sglang line), the driver checks for what it relies on (the loop
beginning its iteration in `ingest_requests`, which receives at `request_receiver`; the methods,
modules and constructor parameters it uses) and fails naming the missing piece
(EventLoopUnsupported) rather than guess. It feature-detects the line, never by version:
an attribute is set only where the tree's own `init_*` (or `__init__`) assigns it, read from that
method's source (`_Installer.set(..., by=...)`); constructors and `init_*` methods get the keywords
their signature names (`scheduler_harness._construct`); the ranks go to the tree's ParallelContext
where it has the field, else to `Scheduler.ps` as 0.5.20's __init__ builds it.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import importlib
import inspect
import textwrap
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import scheduler_harness as sh
import torch
from sglang.srt import runtime_context
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler

# What the driver relies on in each loop's source, in order: the iteration begins in
# ingest_requests (whose receive is the driver's gate) and ends with `last_batch` (what a step
# reports). A loop that changed there fails naming it (EventLoopUnsupported).
_LOOP_HOOKS = ("while True:", "self.ingest_requests(", "self.last_batch = batch")
_INGEST_HOOK = "self.request_receiver.recv_requests("
LOOP_THREAD_NAME = "scheduler-event-loop"
# The longest one iteration may take (two ranks: the peer's iteration too).
STEP_BOUND_S = 150.0
# The longest the loop waits at its receive for the test's next step.
LOOP_WAIT_S = 600.0

NEXT_TOKEN = 7


class EventLoopUnsupported(RuntimeError):
    """The imported sglang tree lacks something the driver replays."""


class LoopExited(RuntimeError):
    """The scheduler's loop returned (`gracefully_exit`)."""


class LoopStopped(BaseException):
    """Raised at the loop's receive to end its thread (the harness closed, or the test left)."""


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
            _wait_for_each_layers_load(counter)
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


def _wait_for_each_layers_load(counter: Any) -> None:
    """What the model's layers do with a HiCache load in flight: each layer's forward waits
    (stream-ordered) for that layer's load (`LayerDoneCounter.wait_until`, called by the attention
    layers). The fixed-token forward finishes at once, so the loads it waited on have finished:
    their fake events are done (as a forward's completion implies on a device)."""
    for layer in range(counter.num_layers):
        counter.wait_until(layer)
    if counter.consumer_index >= 0:
        for event in counter.events[counter.consumer_index].load_events:
            if getattr(event, "recorded", False):
                event.done = True


def loop_name(overlap: bool, pd_prefill: bool = False) -> str:
    """The loop `dispatch_event_loop` runs for a server of this kind (no pipeline parallelism)."""
    return f"event_loop_{'overlap' if overlap else 'normal'}{'_disagg_prefill' if pd_prefill else ''}"


def check_tree(overlap: bool = False, pd_prefill: bool = False) -> None:
    """The imported tree's loop (`loop_name`) and `ingest_requests` have what the driver relies
    on, in order (EventLoopUnsupported naming the first they lack)."""
    from sglang.srt.managers import scheduler as scheduler_module

    if not callable(getattr(scheduler_module, "dispatch_event_loop", None)):
        raise EventLoopUnsupported("this sglang tree has no scheduler.dispatch_event_loop")
    loop = loop_name(overlap, pd_prefill)
    for method, hooks in ((loop, _LOOP_HOOKS), ("ingest_requests", (_INGEST_HOOK,))):
        if not callable(getattr(Scheduler, method, None)):
            raise EventLoopUnsupported(f"this sglang tree's Scheduler has no {method}")
        source = inspect.getsource(getattr(Scheduler, method))
        at = 0
        for hook in hooks:
            found = source.find(hook, at)
            if found < 0:
                raise EventLoopUnsupported(
                    f"{method} of this tree no longer makes {hook!r} where the driver expects it"
                )
            at = found + len(hook)


class EventLoopDriver:
    """Runs the scheduler's own event loop (`dispatch_event_loop`: event_loop_normal here) on a
    harness's scheduler, one iteration per `step()` (see the module docstring)."""

    overlap = False  # the loop a server runs with --disable-overlap-schedule

    def __init__(self, h: sh.Harness, next_token: int = NEXT_TOKEN) -> None:
        self.pd_prefill = h.cfg.pd_prefill
        check_tree(self.overlap, self.pd_prefill)
        self.h = h
        self.scheduler = h.scheduler
        self.worker = FixedTokenWorker(h.scheduler.tp_worker, next_token)
        self.installed: list[str] = []
        self.detokenizer = sh.FakeTokenizerChannel()  # what the scheduler streams out
        self.iterations: list[Iteration] = []
        self.receiver = IterationGate()
        # Whether the last step ran on_idle (the scheduler's own idle check), or was paused.
        self.ran_on_idle = False
        self._paused = False
        self._thread: threading.Thread | None = None
        self._outcome: BaseException | None = None
        _install(self, h)
        # The harness's leak report, read in the loop after its last on_idle that found the
        # scheduler fully idle (between two steps the loop has begun its next iteration: from its
        # first call the pools read the agreed ledger again, not the idle reading).
        self.idle_leaks: list[str] | None = None
        self._spy_on("on_idle", "ran_on_idle", after=self._read_idle_leaks)
        self._spy_on("_record_scheduler_state_for_paused_engine", "_paused")
        h._stack.callback(self.stop)

    def _spy_on(self, method: str, flag: str, after: Callable[[], None] | None = None) -> None:
        """The scheduler's own `method`, called through, noting in `flag` that this iteration ran
        it (and then calling `after`)."""
        real = getattr(self.scheduler, method)

        def noted(*args: Any, **kwargs: Any) -> Any:
            setattr(self, flag, True)
            result = real(*args, **kwargs)
            if after is not None:
                after()
            return result

        setattr(self.scheduler, method, noted)

    def _read_idle_leaks(self) -> None:
        if self.is_idle():
            self.idle_leaks = [str(leak) for leak in self.h.idle_leak_report()]

    # -- the loop's thread ---------------------------------------------------------------------
    @property
    def loop(self) -> str:
        return loop_name(self.overlap, self.pd_prefill)

    def _run_loop(self) -> None:
        from sglang.srt.managers import scheduler as scheduler_module

        try:
            scheduler_module.dispatch_event_loop(self.scheduler)
        except LoopStopped:
            pass
        except BaseException as error:  # the scheduler's loop raised: step() raises it
            self._outcome = error
        else:
            self._outcome = LoopExited("the scheduler's loop returned (gracefully_exit)")
        finally:
            self.receiver.loop_ended()

    def start(self) -> None:
        """Start the scheduler's loop on its own thread (a server runs it on the scheduler
        process's main thread); it runs up to its first receive and waits there."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run_loop, name=LOOP_THREAD_NAME, daemon=True)
        self.receiver.loop_thread = self._thread
        with _the_scheduler_thread_is(self._thread):
            self._thread.start()
            self.receiver.wait_for_the_loop(STEP_BOUND_S)

    def stop(self) -> None:
        """End the loop at its receive (when the harness closes); a loop stuck elsewhere is left
        to its daemon thread, and named."""
        if self._thread is None or not self._thread.is_alive():
            return
        self.receiver.stop()
        self._thread.join(timeout=STEP_BOUND_S)

    def step(self) -> Iteration:
        """One iteration of the scheduler's loop: from its receive (where what the test queued
        and delivered arrives) to its next one. An exception the loop raised is raised here."""
        self.start()
        if self._outcome is not None:
            raise self._outcome
        self.ran_on_idle = self._paused = False
        assert self._thread is not None
        with _the_scheduler_thread_is(self._thread):
            self.receiver.run_one_iteration(STEP_BOUND_S)
        if self._outcome is not None:
            raise self._outcome
        it = Iteration("PAUSED", ()) if self._paused else Iteration.of(self.scheduler.last_batch)
        self.iterations.append(it)
        return it

    def deliver(self, *inputs: Any) -> None:
        """What the scheduler receives at the start of the next iteration (an AbortReq, a
        tokenized request), dispatched by its own `process_input_requests`."""
        self.receiver.deliver(inputs)

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
    """Runs `event_loop_overlap` (the default server's loop: a batch's result is processed in the
    NEXT iteration, after that iteration's batch was launched, so its admission and decode step
    are prepared before the previous batch's requests finish; 0.5.22 on, a request whose last
    token is still in flight is not decoded again).

    The device boundary is the harness's fake device: the schedule, forward and copy streams are
    its FakeStreams, `copy_done` its FakeEvent."""

    overlap = True

    def __init__(self, h: sh.Harness, next_token: int = NEXT_TOKEN) -> None:
        super().__init__(h, next_token)
        # 0.5.22 on the loop skips a finishing request's decode; before, it runs one more decode
        # step for it, whose token is thrown away.
        self.skips_finishing_decode = "self.enable_skip_finishing_decode = True" in inspect.getsource(
            Scheduler.event_loop_overlap
        )


@contextlib.contextmanager
def _the_scheduler_thread_is(thread: threading.Thread) -> Iterator[None]:
    """Upstream's rank-consensus checker, where it is on, takes the loop's thread for the
    scheduler's while the loop runs: it accepts records from the thread that configured it (in a
    server the scheduler process's main thread, which runs the loop), so that no other thread's
    record interleaves. Test and loop take turns, so there is one scheduler thread at a time."""
    from sglang.srt.utils import rank_consensus_checker as checker

    if not checker.enabled():
        yield
        return
    test_thread = checker._scheduler_thread
    checker._scheduler_thread = thread
    try:
        yield
    finally:
        checker._scheduler_thread = test_thread


class IterationGate:
    """The scheduler's request receiver (its ZMQ sockets and the TP broadcast of what arrived):
    every loop's iteration begins by calling it, so here the loop waits for the test's next step
    (strictly in turn: the test reads and queues while the loop waits, never while it runs), and
    receives what the test delivered, and rank 0's timeout aborts the scheduler hands it."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._receives = 0  # receives the loop entered
        self._granted = 0  # iterations the test let run
        self._stopping = False
        self._ended = False
        self._delivered: list[Any] = []
        self.loop_thread: threading.Thread | None = None

    def recv_requests(self, local_reqs: list[Any] | None = None) -> list[Any]:
        if threading.current_thread() is not self.loop_thread:  # a test calling ingest_requests itself
            with self._turn:
                arrived, self._delivered = self._delivered, []
            return list(local_reqs or []) + arrived
        with self._turn:
            self._receives += 1
            self._turn.notify_all()
            if not self._turn.wait_for(
                lambda: self._granted >= self._receives or self._stopping, LOOP_WAIT_S
            ):
                raise LoopStopped(f"no step for {LOOP_WAIT_S} s: the test left its loop")
            if self._stopping:
                raise LoopStopped("the harness closed")
            arrived, self._delivered = self._delivered, []
        return list(local_reqs or []) + arrived

    def deliver(self, inputs: tuple[Any, ...]) -> None:
        with self._turn:
            self._delivered.extend(inputs)

    def _parked(self) -> bool:
        return self._ended or self._receives == self._granted + 1

    def wait_for_the_loop(self, bound_s: float) -> None:
        with self._turn:
            if not self._turn.wait_for(self._parked, bound_s):
                raise AssertionError(f"the scheduler's loop did not reach its receive within {bound_s} s")

    def run_one_iteration(self, bound_s: float) -> None:
        with self._turn:
            if self._ended:
                return
            self._granted += 1
            self._turn.notify_all()
            if not self._turn.wait_for(self._parked, bound_s):
                raise AssertionError(
                    f"the scheduler's loop did not reach its next receive within {bound_s} s "
                    "(stuck in an iteration: a collective no peer makes?)"
                )

    def stop(self) -> None:
        with self._turn:
            self._stopping = True
            self._turn.notify_all()

    def loop_ended(self) -> None:
        with self._turn:
            self._ended = True
            self._turn.notify_all()


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


class Unserved:
    """A scheduler component a test never reaches (a weight updater, ...): each of its methods
    raises, naming itself."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Callable[..., Any]:
        def unserved(*args: Any, **kwargs: Any) -> Any:
            raise EventLoopUnsupported(f"{self._name}.{attribute} is not served by the event loop driver")

        return unserved


def _component_reads(init: str) -> list[str]:
    """The attributes of `self` whose own attributes `Scheduler.<init>` reads (`self.NAME.x`)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(Scheduler, init))))
    names: list[str] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and isinstance(node.value.value, ast.Name)
            and node.value.value.id == "self"
            and node.value.attr not in names
        ):
            names.append(node.value.attr)
    return names


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
    """A TP rank's place in each group of the harness (no pipeline, no data parallelism), the
    attention groups' widths as the groups are built (TP, context parallel across the attention-CP
    group, or DP attention: each rank's attention its own), and the groups the scheduler's
    components read (the profiler takes the TP group's CPU group)."""
    tp, attn_tp, attn_cp = (
        GroupStandIn.of(group) for group in (cfg.tp_cpu_group, cfg.attn_tp_cpu_group, cfg.attn_cp_cpu_group)
    )
    attn_dp_size = tp.world_size // (attn_tp.world_size * attn_cp.world_size)
    return {
        "tp_group": tp,
        "attn_tp_group": attn_tp,
        "attn_cp_group": attn_cp,
        "tp_rank": tp.rank_in_group,
        "pp_rank": 0,
        "attn_tp_rank": attn_tp.rank_in_group,
        "attn_tp_size": attn_tp.world_size,
        "attn_cp_rank": attn_cp.rank_in_group,
        "attn_cp_size": attn_cp.world_size,
        "attn_dp_rank": tp.rank_in_group // (attn_tp.world_size * attn_cp.world_size),
        "attn_dp_size": attn_dp_size,
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
    #    boundary (ZMQ sockets and the TP broadcast of what arrived), here the driver's gate: the
    #    loop waits there for the next step and receives what the test delivered; a test queues
    #    its requests between iterations, where they would have arrived.
    i.set("request_receiver", lambda: driver.receiver, by="init_request_receiver")
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
    # init_request_dispatcher (:1939): what process_input_requests dispatches each input to (an
    # AbortReq to abort_request, a tokenized request to handle_generate_request, ...).
    # The components it binds a handler of that no test input reaches (weight updates, profiling,
    # ...) are stand-ins that raise when called (`Unserved`).
    for name in _component_reads("init_request_dispatcher"):
        if i.missing(name):
            i.replace(name, Unserved(name), "no input of a test reaches it")
    i.call("init_request_dispatcher", ("_request_dispatcher",))
    # -- a PD prefill server's queues (init_disaggregation :1617-1754, real: the bootstrap and
    #    in-flight queues, the metadata buffers, upstream's fake transfer backend's KV manager).
    if cfg.pd_prefill:
        s.init_disaggregation()
        i.names.append(
            "disagg_prefill_bootstrap_queue, disagg_prefill_inflight_queue, ... (init_disaggregation)"
        )
        # prefill.py:1496 records a CUDA event for a cached prefix sent early: the device boundary
        # (on a real GPU, its own events).
        if isinstance(h.device, sh.FakeDeviceModule):
            h._stack.enter_context(mock.patch.object(torch.cuda, "Event", h.device.Event))
    driver.installed = i.names
