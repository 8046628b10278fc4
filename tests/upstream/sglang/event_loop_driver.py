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
        self.detokenizer = sh.FakeTokenizerChannel()  # what the scheduler streams out
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
class _Installer:
    """Sets what the loop reads and the harness did not: each name once, listed in `names`."""

    def __init__(self, s: Scheduler) -> None:
        self.s = s
        self.names: list[str] = []

    def missing(self, name: str) -> bool:
        return not hasattr(self.s, name)

    def set(self, name: str, make: Callable[[], Any]) -> None:
        """`name` = make(), where the harness did not set it."""
        if self.missing(name):
            setattr(self.s, name, make())
            self.names.append(name)

    def call(self, init: str, sets: tuple[str, ...]) -> None:
        """Run the real `Scheduler.<init>()`, which sets `sets`, where none of them is set yet."""
        present = [name for name in sets if not self.missing(name)]
        if present:
            raise EventLoopUnsupported(f"{init} would overwrite {present}, which the harness set")
        method = getattr(self.s, init, None)
        if not callable(method):
            raise EventLoopUnsupported(f"this sglang tree's Scheduler has no {init}()")
        method()
        self.names.extend(f"{name} ({init})" for name in sets)

    def replace(self, name: str, value: Any, why: str) -> None:
        setattr(self.s, name, value)
        self.names.append(f"{name} (replaced: {why})")


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
    """`scheduler.py:N` = 0.5.23's line N."""
    from sglang.srt.managers import scheduler as scheduler_module
    from sglang.srt.managers.scheduler_components.batch_result_processor import (
        SchedulerBatchResultProcessor,
    )
    from sglang.srt.managers.scheduler_components.dp_attn import SchedulerDPAttnAdapter
    from sglang.srt.managers.scheduler_components.kv_events_publisher import SchedulerKvEventsPublisher
    from sglang.srt.managers.scheduler_components.logprob_result_processor import (
        SchedulerLogprobResultProcessor,
    )
    from sglang.srt.model_executor.model_runner_components.ngram_embedding_manager import (
        NgramEmbeddingManager,
    )
    from sglang.srt.session.session_controller import SessionController

    s = h.scheduler
    if s.enable_overlap:
        raise EventLoopUnsupported(
            "event_loop_normal runs with --disable-overlap-schedule: build the harness with "
            "enable_overlap=False"
        )
    if getattr(s.metrics_reporter, "enable_metrics", False):
        raise EventLoopUnsupported("install the driver before Harness.enable_metrics()")
    cfg = h.cfg
    rt = sh.runtime_context
    i = _Installer(s)
    # This process's ranks, which the real scheduler's process writes when it builds its groups
    # (bootstrap.init_parallel_runtime, :655): for the harness's life.
    h._stack.enter_context(rt.get_parallel().override(**_ranks(cfg)))

    # -- __init__'s parsed args (scheduler.py:600-642) ----------------------------------------
    i.set("enable_pdmux", lambda: rt.get_disagg().enable_pdmux)
    i.set("enable_overlap_mlx", lambda: False)  # not disable_overlap_schedule and use_mlx()
    i.set("enable_unified_memory", lambda: rt.get_memory().enable_unified_memory)
    i.set("attn_dp_enabled", lambda: rt.get_parallel().attn_dp_enabled)
    i.set("is_generation", lambda: s.model_config.is_generation)  # :1011
    # -- model worker (init_model_worker :1246-1345) ------------------------------------------
    i.set("draft_worker", lambda: None)  # maybe_init_draft_worker: no speculative decoding
    i.set("model_worker", lambda: driver.worker)  # :1324 model_worker = tp_worker: the fake forward
    i.set("forward_stream", lambda: s.tp_worker.model_runner.forward_stream)  # get_worker_info
    i.set("require_mlp_sync", scheduler_module.require_mlp_sync)  # :1134
    i.set("decode_offload_manager", lambda: None)  # :760 (not a PD decode server)
    i.set("is_hybrid_ssm", lambda: cfg.mamba)  # build_kv_cache result
    i.set("full_tokens_per_layer", lambda: None)  # build_kv_cache result (no SWA)
    i.set("swa_tokens_per_layer", lambda: None)
    # -- running status (init_running_status :1433-1467); the harness set the queue and batch -
    i.set("gracefully_exit", lambda: False)
    i.set("last_batch", lambda: None)
    i.set("cur_batch_for_debug", lambda: None)
    i.set("result_queue", collections.deque)
    i.set("enable_continuous_input_polling", lambda: False)
    i.set("enable_skip_finishing_decode", lambda: False)
    i.set("forward_ct", lambda: 0)
    i.set("return_health_check_ipcs", collections.deque)
    i.set("session_controller", lambda: SessionController(s.tree_cache))
    i.set("forward_sleep_time", lambda: None)
    i.set("_engine_paused", lambda: False)
    # -- IPC (init_ipc_channels :954) and idle sleep (init_idle_sleeper :972) ------------------
    i.set("load_snapshot_writer", lambda: None)
    i.call("init_idle_sleeper", ("idle_sleeper",))
    # -- metrics (init_metrics_collector, init_metrics_reporter :1546, :785) ------------------
    i.call("init_metrics_collector", ("metrics_collector_context", "metrics_collector"))
    reporter = scheduler_module.SchedulerMetricsReporter(
        scheduler=s,
        metrics_collector_context=s.metrics_collector_context,
        metrics_collector=s.metrics_collector,
    )
    i.replace("metrics_reporter", reporter, "the harness's stub has no reporter methods")
    i.set("scheduler_stage_metrics", lambda: reporter.scheduler_stage_metrics)  # :786
    # -- overlap state, also read without overlap (init_overlap :1782) -------------------------
    if s.future_map is None:
        i.replace("future_map", None, "init_overlap builds the FutureMap every loop relays through")
        del s.future_map
        i.call(
            "init_overlap",
            (
                "device_module",
                "future_map",
                "_confidence_budget_prepare",
                "enable_async_d2h_copy",
                "async_d2h_worker",
                "forward_stream_ctx",
                "copy_stream",
                "copy_stream_ctx",
            ),
        )
        # init_beam_coordinator (:2765) builds the coordinator after the future map.
        s.beam_coordinator.future_map = s.future_map
    # -- components ----------------------------------------------------------------------------
    i.call("maybe_init_scripted_scheduler_hook", ("scripted_scheduler_hook",))
    i.call("init_profiler", ("profiler_manager",))
    i.set(  # maybe_init_ngram_embedding (:1857): the model runner's, off for this model
        "ngram_embedding_manager",
        lambda: NgramEmbeddingManager.from_model(
            model=None,
            model_config=s.model_config,
            req_to_token_pool=s.req_to_token_pool,
            max_running_requests=s.max_running_requests,
            device=s.device,
        ),
    )
    i.set("use_ngram_embedding", lambda: s.model_config.use_ngram_embedding)
    i.set(  # init_dp_attn_adapter (:2605); the weight updater's offload_tags start empty
        "dp_attn_adapter",
        lambda: SchedulerDPAttnAdapter(
            model_runner=s.tp_worker.model_runner,
            req_to_token_pool=s.req_to_token_pool,
            token_to_kv_pool_allocator=s.token_to_kv_pool_allocator,
            tree_cache=s.tree_cache,
            offload_tags=set(),
            model_config=s.model_config,
            enable_overlap=s.enable_overlap,
            spec_algorithm=s.spec_algorithm,
            get_require_mlp_sync=lambda: s.require_mlp_sync,
        ),
    )
    i.call("init_pool_stats_observer", ("pool_stats_observer",))
    i.call("init_invariant_checker", ("invariant_checker",))
    i.set(  # init_kv_events_publisher (:2676); no kv events configured, so nothing is sent
        "kv_events_publisher",
        lambda: SchedulerKvEventsPublisher(
            kv_events_config=rt.get_observability().kv_events_config,
            tree_cache=s.tree_cache,
            send_metrics_from_scheduler=None,
            max_running_requests=s.max_running_requests,
            max_total_num_tokens=s.max_total_num_tokens,
            get_stats=lambda: s.metrics_reporter.stats,
        ),
    )
    i.call("init_load_publisher", ("load_publisher",))
    # init_load_inquirer (:2693-2704): the step counters _record_step_counters keeps.
    i.set("total_prefill_uncached_tokens", lambda: 0)
    i.set("total_prefill_busy_us", lambda: 0)
    i.set("decode_moment_totals", lambda: [0.0] * 6)
    i.set("_prev_step", lambda: None)
    i.set("_prev_prefill_end_ts", lambda: None)
    i.set("_sched_idled", lambda: False)
    i.set("_pause_intervals", lambda: collections.deque(maxlen=scheduler_module.PAUSE_WINDOWS_MAX))
    i.set("_pause_started_at", lambda: None)
    i.set(  # init_output_streamer (:2751): to the detokenizer, a fake channel (I/O boundary)
        "output_streamer",
        lambda: s.get_output_streamer_class()(
            send_to_detokenizer=driver.detokenizer,
            tree_cache=s.tree_cache,
            server_args=s.server_args,
            is_generation=s.is_generation,
            spec_algorithm=s.spec_algorithm,
            disaggregation_mode=s.disaggregation_mode,
            enable_hicache_storage=lambda: s.enable_hicache_storage or s.enable_lmcache,
            rust_server=s.rust_server,
        ),
    )
    i.set(  # init_batch_result_processor (:2780), with the harness's beam coordinator
        "batch_result_processor",
        lambda: SchedulerBatchResultProcessor(
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
            logprob_result_processor=SchedulerLogprobResultProcessor(model_config=s.model_config),
            output_streamer=s.output_streamer,
            beam_coordinator=s.beam_coordinator,
            abort_request=s.abort_request,
        ),
    )
    driver.installed = i.names
