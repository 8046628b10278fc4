"""Drive the REAL sglang `Scheduler.event_loop_normal` iteration on CPU, on a `scheduler_harness`
Harness.

One `EventLoopDriver.step()` is one pass of `event_loop_normal`'s body (scheduler.py:2144-2175 at
0.5.23), with the same calls in the same order and the same updates of `running_batch`,
`cur_batch_for_debug` and `last_batch`:

    plan = self.get_next_batch_to_run(running_batch=self.running_batch, last_batch=self.last_batch)
    self.running_batch = plan.running_batch
    batch = plan.batch_to_run
    self.cur_batch_for_debug = batch
    if batch: result = self.run_batch(batch); self.process_batch_result(batch, result)
    else: self._sched_idled = True; self.on_idle()
    self.last_batch = batch

The receive step (`ingest_requests`) is left out: a test queues its requests itself
(`Harness.add_request`) between steps, where the loop would have received them.

The only fake is the model forward: `Scheduler.model_worker` (the TP worker `run_batch` calls,
scheduler.py:5717) is a `FixedTokenWorker` whose `forward_batch_generation` returns, in the
`GenerationBatchResult` `process_batch_result` reads, a fixed next token for every request, after
doing what the real worker does at the device boundary before its forward (the HiCache consumer
index, tp_worker.py:637). Everything else is upstream code: `get_next_batch_to_run`, admission and
allocation, `update_running_batch` / `prepare_for_decode` (and with rank-local pools the decode
vote and credit), `run_batch`'s relay through the real `FutureMap`, the real
`SchedulerBatchResultProcessor` (finish, `release_kv_cache`, streaming to a fake channel) and, when
idle, the real `on_idle` (the scheduler's own leak check).

`install_event_loop(h)` sets on the harness's scheduler only the attributes these methods read that
the harness did not set, with the values `Scheduler.__init__` gives them for a single-GPU CPU
server with `--disable-overlap-schedule` (`disable_overlap_schedule` is the harness's
`enable_overlap=False`); where `__init__` gets one from a real `init_*` method that reads only what
the harness holds, that method runs. The harness's metrics stub (no reporter methods) is replaced by
the real `SchedulerMetricsReporter` with metrics off, and its `future_map=None` by the real
`FutureMap` (0.5.23 relays every decode step's input ids through it). What was set is listed in
`EventLoopDriver.installed`.

Where the tree differs (another sglang line), the driver checks for what it calls and fails naming
the missing piece rather than guess. Every loop it runs is bounded (`run_until_idle`).
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import scheduler_harness as sh
import torch
from sglang.srt.managers.schedule_batch import ScheduleBatch
from sglang.srt.managers.scheduler import Scheduler

# The calls of event_loop_normal's body this driver replays, in order (a guard against a tree whose
# loop changed: the driver would then replay a loop that no longer exists).
_LOOP_CALLS = (
    "self.get_next_batch_to_run(",
    "self.running_batch = plan.running_batch",
    "batch = plan.batch_to_run",
    "self.cur_batch_for_debug = batch",
    "self.run_batch(batch)",
    "self.process_batch_result(batch, result)",
    "self._sched_idled = True",
    "self.on_idle()",
    "self.last_batch = batch",
)

NEXT_TOKEN = 7


class EventLoopUnsupported(RuntimeError):
    """The imported sglang tree lacks something the driver replays."""


@dataclass(frozen=True)
class Iteration:
    """What one loop iteration ran: its batch's forward mode and requests (None: no batch)."""

    forward_mode: str | None
    rids: tuple[str, ...]

    @staticmethod
    def of(batch: ScheduleBatch | None) -> Iteration:
        if batch is None:
            return Iteration(None, ())
        return Iteration(batch.forward_mode.name, tuple(req.rid for req in batch.reqs))


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
        return getattr(self.inner, name)


def _check_tree() -> None:
    missing = [
        name
        for name in ("get_next_batch_to_run", "run_batch", "process_batch_result", "on_idle")
        if not callable(getattr(Scheduler, name, None))
    ]
    if missing:
        raise EventLoopUnsupported(f"this sglang tree's Scheduler has no {missing}")
    params = inspect.signature(Scheduler.get_next_batch_to_run).parameters
    if "running_batch" not in params or "last_batch" not in params:
        raise EventLoopUnsupported(
            "get_next_batch_to_run(running_batch, last_batch) returning a plan is the loop this "
            f"driver replays; this tree's takes {list(params)}"
        )
    source = inspect.getsource(Scheduler.event_loop_normal)
    at = 0
    for call in _LOOP_CALLS:
        found = source.find(call, at)
        if found < 0:
            raise EventLoopUnsupported(
                f"event_loop_normal of this tree no longer makes {call!r} where the driver expects it"
            )
        at = found + len(call)


class EventLoopDriver:
    """Runs `event_loop_normal`'s iteration on a harness's scheduler (see the module docstring)."""

    def __init__(self, h: sh.Harness, next_token: int = NEXT_TOKEN) -> None:
        _check_tree()
        self.h = h
        self.scheduler = h.scheduler
        self.worker = FixedTokenWorker(h.scheduler.tp_worker, next_token)
        self.installed: list[str] = []
        self.iterations: list[Iteration] = []
        _install(self, h)

    def step(self) -> Iteration:
        """One iteration of event_loop_normal (scheduler.py:2157-2173 at 0.5.23), without receiving."""
        s = self.scheduler
        plan = s.get_next_batch_to_run(running_batch=s.running_batch, last_batch=s.last_batch)
        s.running_batch = plan.running_batch
        batch = plan.batch_to_run
        s.cur_batch_for_debug = batch
        if batch:
            result = s.run_batch(batch)
            s.process_batch_result(batch, result)
        else:
            s._sched_idled = True
            s.on_idle()
        s.last_batch = batch
        it = Iteration.of(batch)
        self.iterations.append(it)
        return it

    def is_idle(self) -> bool:
        """The scheduler's own test (is_fully_idle): nothing running, queued or in flight."""
        return bool(self.scheduler.is_fully_idle())

    def run_until_idle(self, max_iterations: int = 200) -> list[Iteration]:
        """Step until an iteration ran no batch and the scheduler is fully idle; at most
        `max_iterations` steps (AssertionError past that)."""
        ran: list[Iteration] = []
        for _ in range(max_iterations):
            it = self.step()
            ran.append(it)
            if it.forward_mode is None and self.is_idle():
                return ran
        raise AssertionError(f"not idle after {max_iterations} iterations: {ran[-5:]}")

    def run(self, iterations: int) -> list[Iteration]:
        return [self.step() for _ in range(iterations)]


# --------------------------------------------------------------------------------------------
# What __init__ would have set
# --------------------------------------------------------------------------------------------
def _set(driver: EventLoopDriver, name: str, value: Any) -> None:
    setattr(driver.scheduler, name, value)
    driver.installed.append(name)


def _missing(s: Scheduler, name: str) -> bool:
    return not hasattr(s, name)


def _install(driver: EventLoopDriver, h: sh.Harness) -> None:
    s = h.scheduler
    if s.enable_overlap:
        raise EventLoopUnsupported(
            "event_loop_normal runs with --disable-overlap-schedule: build the harness with enable_overlap=False"
        )
    defaults: dict[str, Callable[[], Any]] = {}
    for name, make in defaults.items():
        if _missing(s, name):
            _set(driver, name, make())
    _ = collections
