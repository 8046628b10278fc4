"""Miss injection and observation for the end-to-end test, loaded by every Python process of the
server.

ci/e2e/run_e2e.py puts this folder on PYTHONPATH; Python imports `sitecustomize` at start-up in
the server and in every scheduler process it spawns. Nothing happens unless CARRY_E2E_INJECT=1.

With it, a KV allocation misses exactly as an elastic pool reports one (kvcached: the allocator's
`alloc` / `alloc_extend` returns None, nothing taken), and only where the carried unwind matters:
inside the prefill batch's allocation of a batch whose HiCache load already started
(`hicache_consumer_index >= 0`, set by the scheduler just before). That allocation is
`ScheduleBatch.allocate_for_extend` where the tree has it (the patched scheduler calls it
directly) and `prepare_for_extend` where it does not (pristine). At most CARRY_E2E_MISS_LIMIT
misses (default 3) are injected per rank, each on the first allocation of such a batch, and only
on the ranks CARRY_E2E_MISS_RANKS names (comma-separated; default: every rank), as a per-rank
elastic pool misses on one rank only. CARRY_E2E_RANK_LOCAL=1 marks the KV allocators
`rank_local_capacity` on every rank, as a kvcached pool is.

With CARRY_E2E_MISS_AT=decode the misses are injected inside a decode step's allocation instead
(`ScheduleBatch.prepare_for_decode` of a batch of at least two requests, so never the server's
one-request warm-up), one per step, as an elastic pool misses when a co-tenant took the physical
memory since the ranks last agreed; decode retractions after such a miss (`retract_decode` called
with `after_allocation_miss`, the carried decode agreement) are counted.

Ranks of different free space, as a kvcached elastic pool has under co-tenancy (its
`available_size()` is per rank): with CARRY_E2E_WITHHELD_TOKENS=N (default 0: off), the token
allocator's `available_size()` reports N tokens fewer than it has (never below 0) on the ranks
CARRY_E2E_WITHHOLD_RANKS names (comma-separated; default: every rank), as if a co-tenant held
them. Every reading sglang bases admission, eviction and decode retraction on is reduced; nothing
is taken from the pool (an allocation still succeeds on the real free list). See `Withholder` for
when the withholding applies (only while the scheduler is busy) and why.

Observed per process (its TP rank recorded): eligible allocations, injected misses, loads started,
prefill unwinds (the scheduler's unwind, where the tree has one; per request too, by rid),
parked chunks released by a decode step (series entry 0015),
withheld readings (readings of `available_size()` that were reduced), and the exception the
scheduler's event loop died with, if it did (type, message, where it was raised). They go to
CARRY_E2E_COUNTERS_DIR/<pid>.json, rewritten (atomically) on every change, so they survive a
killed server. With CARRY_E2E_CPU=1 the CPU stand-ins (ci/e2e/cpu/carry_e2e_cpu.py) are
installed too, and with CARRY_E2E_MAMBA=1 as well the hybrid model's (carry_e2e_mamba.py), whose
Mamba load copies (landed, and landed after their slot's release) are saved with the counters;
with CARRY_E2E_GDN=1 besides, the gated-delta-net model's (carry_e2e_gdn.py).
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

BATCH_MODULE = "sglang.srt.managers.schedule_batch"
ALLOCATOR_PACKAGE = "sglang.srt.mem_cache.allocator"
CONTROLLER_MODULE = "sglang.srt.managers.cache_controller"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
# HiCache's tree, whose L3 prefetches are counted when the tier is on (CARRY_E2E_L3=1).
TREE_MODULE = "sglang.srt.mem_cache.unified_radix_cache"
L3_COUNTS = ("prefetches_started", "prefetch_termination_checks")
# A hybrid model's Mamba tree component, whose slot misses (series entry 0017) are counted.
MAMBA_COMPONENT_MODULE = "sglang.srt.mem_cache.unified_cache.components.mamba"
SLOT_MISS_METHOD = "_record_slot_miss"
ALLOC_METHODS = ("alloc", "alloc_extend")
AVAILABLE_METHOD = "available_size"
UNIFORM_METHOD = "uniform_available_size"
REAL_METHOD = "real_available_size"
AGREE_METHOD = "agree_deficit"
GUARANTEED_METHOD = "guaranteed_available_size"
SAVE_EVERY_S = 0.5
# Where each tree allocates a prefill batch, first match wins: the patched scheduler calls
# allocate_for_extend; prepare_for_extend calls it too there, so only one of them is wrapped.
BATCH_ALLOCATION_METHODS = ("allocate_for_extend", "prepare_for_extend")
DECODE_PREPARATION_METHOD = "prepare_for_decode"
DECODE_RETRACTION_METHOD = "retract_decode"
# A decode step is eligible for a miss from this many requests on (the warm-up decodes one).
DECODE_MISS_MIN_REQUESTS = 2
UNWIND_METHOD = "_unwind_prefill_batch"
# Series entry 0015: a decode step that cannot fit its last request releases a parked chunk
# (True when it released one).
PARKED_RELEASE_METHOD = "_release_parked_chunk"
# The carried agreement (a cached property whose `reduce` makes every vote's all-reduce).
AGREEMENT_PROPERTY = "_prefill_agreement"
# Called once per event-loop iteration (both loops), returning its plan (its batch_to_run).
NEXT_BATCH_METHOD = "get_next_batch_to_run"
# The scheduler's event loop, outermost first (run_event_loop dispatches to one event_loop_*).
EVENT_LOOP_METHODS = ("run_event_loop", "event_loop_normal", "event_loop_overlap")


def tp_rank() -> int:
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return int(distributed.get_rank())
    return 0


class Injector:
    """The miss decision and what the process observed; one per process."""

    def __init__(
        self, limit: int, counters_dir: Path | None, miss_ranks: frozenset[int] | None = None
    ) -> None:
        self.limit = limit
        self.counters_dir = counters_dir
        self.miss_ranks = miss_ranks
        self.counts = {
            "eligible_allocations": 0,
            "injected_misses": 0,
            "loads_started": 0,
            "unwinds": 0,
            "withheld_readings": 0,
            "decode_retractions": 0,
            # Decode steps prepared, and the all-reduces the carried agreement made (prefill rounds
            # and decode steps alike): what the agreement costs, in collectives.
            "decode_steps": 0,
            "agreement_all_reduces": 0,
            # Those made while a decode step was prepared (its allocation vote): fewer than the
            # decode steps where steps ran on an agreed decode credit, without a vote.
            "decode_votes": 0,
            # Wall-clock microseconds this rank spent inside those all-reduces (waiting for the
            # slower rank included): at most what the agreement costs the step.
            "agreement_us": 0,
            # How many different amounts the withheld readings took (2 or more: it drifted).
            "withheld_amounts": 0,
            # Parked chunked requests released by a decode step that could not fit its last request.
            "parked_chunk_releases": 0,
            # Event-loop iterations (calls of get_next_batch_to_run), and, among those that ran no
            # prefill batch and had nothing queued (no rank could admit), the agreement's
            # all-reduces other than decode votes they made, and how many such iterations made
            # any: a round no rank can admit makes none.
            "iterations": 0,
            "idle_round_all_reduces": 0,
            "idle_round_iterations": 0,
        }
        # Each request whose prefill was put back (by rid), and how often.
        self.unwound_rids: dict[str, int] = {}
        # The scheduler whose event loop runs in this process (set when it starts).
        self.scheduler: Any = None
        self.died_with: dict[str, str] | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._saved_at = float("-inf")
        self._changed_at = float("-inf")
        self._flusher: threading.Thread | None = None
        self._watched: Callable[[], dict[str, int]] | None = None

    def allocating(self, batch: Any) -> contextlib.AbstractContextManager[None]:
        """Around a prefill batch's allocation: allocations inside are eligible when the batch's
        load started."""
        return self._eligible_while(getattr(batch, "hicache_consumer_index", -1) >= 0)

    def decoding(self, batch: Any) -> contextlib.AbstractContextManager[None]:
        """Around a decode step's preparation: its allocation is eligible when the batch holds
        DECODE_MISS_MIN_REQUESTS requests or more."""
        return self._eligible_while(len(getattr(batch, "reqs", ())) >= DECODE_MISS_MIN_REQUESTS)

    @contextlib.contextmanager
    def preparing_decode(self) -> Iterator[None]:
        """Around a decode step's preparation: the agreement's all-reduces inside are its votes."""
        self._local.preparing_decode = True
        try:
            yield
        finally:
            self._local.preparing_decode = False

    def agreement_all_reduce(self, spent_us: int) -> None:
        """One all-reduce of the carried agreement, `spent_us` inside it."""
        decode_vote = int(getattr(self._local, "preparing_decode", False))
        self.add(
            {"agreement_all_reduces": 1, "agreement_us": spent_us, "decode_votes": decode_vote}, SAVE_EVERY_S
        )

    def rounds_all_reduces(self) -> int:
        """The agreement's all-reduces so far other than decode votes (a round's own)."""
        with self._lock:
            return self.counts["agreement_all_reduces"] - self.counts["decode_votes"]

    def iteration(self, admitted: bool, queued: bool, all_reduces: int) -> None:
        """One event-loop iteration: whether it ran a prefill batch, whether anything was queued
        at its start (a request or a chunk), and the agreement's all-reduces other than decode
        votes that it made. Those of an iteration that admitted nothing with nothing queued are
        counted apart: no rank could admit there, and the carried scheduler votes only where one
        could (a round with requests queued is settled on every rank, admitting or not)."""
        counted = 0 if admitted or queued else all_reduces
        self.add(
            {
                "iterations": 1,
                "idle_round_all_reduces": counted,
                "idle_round_iterations": int(counted > 0),
            },
            SAVE_EVERY_S,
        )

    @contextlib.contextmanager
    def _eligible_while(self, eligible: bool) -> Iterator[None]:
        """Allocations in this thread are eligible for a miss inside the block (nested blocks
        restore the outer one's state)."""
        previous = getattr(self._local, "loading", False)
        self._local.loading = eligible
        try:
            yield
        finally:
            self._local.loading = previous

    def should_miss(self) -> bool:
        if not getattr(self._local, "loading", False):
            return False
        with self._lock:
            self.counts["eligible_allocations"] += 1
            allowed = self.miss_ranks is None or tp_rank() in self.miss_ranks
            miss = allowed and self.counts["injected_misses"] < self.limit
            if miss:
                self.counts["injected_misses"] += 1
                self._local.loading = False  # one miss per batch: its unwind puts it back whole
            self._save()
        return miss

    def count(self, key: str, save_every_s: float = 0.0) -> None:
        """Count one; saved now, or within `save_every_s` (a count on every decode step must not
        rewrite the file each time, and the last ones must still reach it)."""
        self.add({key: 1}, save_every_s)

    def add(self, amounts: dict[str, int], save_every_s: float = 0.0) -> None:
        """Add each of `amounts` in one update (a reader never sees one without the others),
        saved as `count` saves."""
        with self._lock:
            for key, amount in amounts.items():
                self.counts[key] += amount
            self._changed_at = time.monotonic()
            if time.monotonic() - self._saved_at >= save_every_s:
                self._save()
            elif self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_every, args=(save_every_s,), daemon=True)
                self._flusher.start()

    def _flush_every(self, interval_s: float) -> None:
        while True:
            time.sleep(interval_s)
            with self._lock:
                if self._saved_at < self._changed_at:
                    self._save()

    def unwound(self, batch: Any) -> None:
        """One unwind of `batch`: counted, and for each of its requests."""
        with self._lock:
            for req in getattr(batch, "reqs", None) or ():
                rid = str(req.rid)
                self.unwound_rids[rid] = self.unwound_rids.get(rid, 0) + 1
        self.count("unwinds")

    def load_started(self, producer_index: int) -> None:
        if producer_index >= 0:
            self.count("loads_started")

    def died(self, error: BaseException) -> None:
        with self._lock:
            if self.died_with is not None:
                return
            frames = traceback.extract_tb(error.__traceback__)
            where = f"{frames[-1].filename}:{frames[-1].name}" if frames else ""
            self.died_with = {"type": type(error).__name__, "message": str(error), "raised_in": where}
            self._save()

    def watch(self, counts: Callable[[], dict[str, int]], interval_s: float = SAVE_EVERY_S) -> None:
        """Save `counts()` with this process's counters too, within `interval_s` of a change: they
        change on threads the hook does not see (a copy landing on a stream's worker)."""
        self._watched = counts

        def flush_on_change() -> None:
            saved: dict[str, int] = {}
            while True:
                time.sleep(interval_s)
                with self._lock:
                    now = counts()
                    if now != saved:
                        self._save()
                        saved = now

        threading.Thread(target=flush_on_change, daemon=True).start()

    def _watched_counts(self) -> dict[str, int]:
        return self._watched() if self._watched is not None else {}

    def _save(self) -> None:
        if self.counters_dir is None:
            return
        self.counters_dir.mkdir(parents=True, exist_ok=True)
        target = self.counters_dir / f"{os.getpid()}.json"
        temporary = target.with_suffix(".tmp")
        record = {
            "rank": tp_rank(),
            **self.counts,
            **self._watched_counts(),
            "unwound_rids": self.unwound_rids,
            "died_with": self.died_with,
        }
        temporary.write_text(json.dumps(record))
        temporary.replace(target)
        self._saved_at = time.monotonic()


class Withholder:
    """Makes a rank's token allocator report `tokens` fewer free tokens than it has, as a
    co-tenant of a kvcached elastic pool makes it, and only while the scheduler is busy.

    Why only while busy: sglang's idle self-check (`Scheduler.on_idle`, 0.5.23:
    `invariant_checker._check_all_pools`) asserts available + evictable + protected + held ==
    max_total_num_tokens; a pool that merely reports less fails it ("pool memory leak
    detected") although sglang lost nothing. A real pool that lends tokens accounts for them; here
    the lending is tied to the one state sglang itself keys that check on: `is_fully_idle()`
    (the check runs only when it is true). While the scheduler has any request (waiting,
    running, chunked, loading), every reading is reduced: admission, eviction, decode retraction
    all see the smaller pool. When it is fully idle nothing is admitted, so the co-tenant's tokens
    are back and the check sees the pool as sglang accounts it.

    The alternative, suspending the withholding inside `_check_all_pools`, is more magic: its
    caller reads the pool statistics before the call, so the wrapper would have to replace its
    argument, and it would tie the hook to a private checker method's signature. This uses only
    the scheduler's own idle predicate. Before the scheduler's event loop starts nothing is
    withheld (nothing is admitted then); a scheduler without `is_fully_idle` has every reading
    reduced. Nested calls (a composite allocator asking its parts) are reduced once, at the
    outermost call. The count of reduced readings is saved at most every SAVE_EVERY_S (a stalled
    scheduler reads in a tight loop), and at once with any other count.
    """

    def __init__(
        self, injector: Injector, tokens: int, ranks: frozenset[int] | None = None, drift: bool = False
    ) -> None:
        self.injector, self.tokens, self.ranks, self.drift = injector, tokens, ranks, drift
        self._local = threading.local()
        self._readings = 0
        self._amounts: set[int] = set()

    def withheld(self) -> int:
        """What this reading withholds: `tokens`, or with `drift` a different amount at every
        reading (all of it, none, a third, two thirds, in turn), as kvcached's TTL-cached physical
        reading and a co-tenant make a real pool's reading change between any two reads."""
        if not self.drift:
            return self.tokens
        self._readings += 1
        return self.tokens * (3, 0, 1, 2)[self._readings % 4] // 3

    def active(self) -> bool:
        scheduler = self.injector.scheduler
        if self.tokens <= 0 or scheduler is None:
            return False
        if self.ranks is not None and tp_rank() not in self.ranks:
            return False
        idle = getattr(scheduler, "is_fully_idle", None)
        return idle is None or not idle()

    def reading(self, real: Callable[[], int]) -> int:
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            size = real()
        finally:
            self._local.depth = depth
        if depth > 0 or not self.active():
            return size
        amount = self.withheld()
        if amount not in self._amounts:
            self._amounts.add(amount)
            self.injector.counts["withheld_amounts"] = len(self._amounts)
        self.injector.count("withheld_readings", save_every_s=SAVE_EVERY_S)
        return max(0, size - amount)


def give_uniform_readings(classes: Sequence[type], guaranteed: bool) -> list[str]:
    """A pool that declares rank-local free space gives the carried scheduler a reading only its
    own calls change (`uniform_available_size`, kvcached's virtual space): sglang's own allocators'
    `available_size` is such a count (their free list), taken here before any withholding wraps
    it. With `guaranteed` (a run that makes no allocation miss: nothing injected, nothing
    withheld), the same free list is also what the pool can hand out with no miss
    (`guaranteed_available_size`, kvcached's mapped memory), as it is: no co-tenant shares it.
    Returns what was given one."""
    given = []
    for cls in classes:
        real = cls.__dict__.get(AVAILABLE_METHOD)
        if real is None or getattr(real, "_carry_e2e", False):
            continue
        for method in (UNIFORM_METHOD, GUARANTEED_METHOD) if guaranteed else (UNIFORM_METHOD,):
            setattr(cls, method, real)
            given.append(f"{cls.__name__}.{method}")
    return given


def _agree_deficit(self: Any, deficit: int | None) -> None:
    self._carry_agreed_deficit = deficit


def _agreed_available_size(self: Any) -> int:
    deficit: int | None = getattr(self, "_carry_agreed_deficit", None)
    if deficit is None:
        return int(self.real_available_size())
    return max(0, int(self.uniform_available_size()) - deficit)


def give_agreed_readings(classes: Sequence[type]) -> list[str]:
    """The rest of kvcached's rank-local pool interface: `real_available_size` (the pool's reading
    as it is here, withheld or not) and `agree_deficit`, after which `available_size` reads the
    uniform reading less the ranks' agreed deficit (None: the real one). Returns what was given."""
    given = []
    for cls in classes:
        real = cls.__dict__.get(AVAILABLE_METHOD)
        if real is None or real is _agreed_available_size:
            continue
        setattr(cls, REAL_METHOD, real)
        setattr(cls, AGREE_METHOD, _agree_deficit)
        setattr(cls, AVAILABLE_METHOD, _agreed_available_size)
        given.append(f"{cls.__name__}.{AVAILABLE_METHOD}")
    return given


def wrap_available_size(classes: Sequence[type], withholder: Withholder) -> list[str]:
    """Wrap `available_size` where each class defines it; returns what was wrapped."""
    wrapped = []
    for cls in classes:
        real = cls.__dict__.get(AVAILABLE_METHOD)
        if real is None or getattr(real, "_carry_e2e", False):
            continue

        def make(real: Callable[..., int]) -> Callable[..., int]:
            def available_size(self: Any) -> int:
                return withholder.reading(lambda: real(self))

            available_size._carry_e2e = True  # type: ignore[attr-defined]
            return available_size

        setattr(cls, AVAILABLE_METHOD, make(real))
        wrapped.append(f"{cls.__name__}.{AVAILABLE_METHOD}")
    return wrapped


def wrap_batch_allocation(batch_class: type, injector: Injector) -> str:
    """Wrap the method a prefill batch allocates in (BATCH_ALLOCATION_METHODS); returns its name."""
    name = next(n for n in BATCH_ALLOCATION_METHODS if n in batch_class.__dict__)
    real = batch_class.__dict__[name]

    def allocate(self: Any, *args: Any, **kwargs: Any) -> Any:
        with injector.allocating(self):
            return real(self, *args, **kwargs)

    setattr(batch_class, name, allocate)
    return name


def wrap_decode_preparation(batch_class: type, injector: Injector, misses: bool = True) -> None:
    """Count decode steps; with `misses`, make a decode step's allocation eligible for a miss, and
    count the retractions the carried decode agreement makes after one. Without `misses`, a batch
    class with no decode preparation is left as it is (nothing to count)."""
    if not misses and DECODE_PREPARATION_METHOD not in batch_class.__dict__:
        return
    prepare = batch_class.__dict__[DECODE_PREPARATION_METHOD]
    retract = batch_class.__dict__[DECODE_RETRACTION_METHOD]

    def prepare_for_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        injector.count("decode_steps", SAVE_EVERY_S)
        with injector.preparing_decode():
            if not misses:
                return prepare(self, *args, **kwargs)
            with injector.decoding(self):
                return prepare(self, *args, **kwargs)

    def retract_decode(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("after_allocation_miss"):
            injector.count("decode_retractions")
        return retract(self, *args, **kwargs)

    setattr(batch_class, DECODE_PREPARATION_METHOD, prepare_for_decode)
    setattr(batch_class, DECODE_RETRACTION_METHOD, retract_decode)


def wrap_allocators(classes: Sequence[type], injector: Injector) -> list[str]:
    """Wrap `alloc` / `alloc_extend` where each class defines them; returns what was wrapped."""
    wrapped = []
    for cls in classes:
        for name in ALLOC_METHODS:
            real = cls.__dict__.get(name)
            if real is None or getattr(real, "_carry_e2e", False):
                continue

            def make(real: Callable[..., Any]) -> Callable[..., Any]:
                def alloc(self: Any, *args: Any, **kwargs: Any) -> Any:
                    if injector.should_miss():
                        return None
                    return real(self, *args, **kwargs)

                alloc._carry_e2e = True  # type: ignore[attr-defined]
                return alloc

            setattr(cls, name, make(real))
            wrapped.append(f"{cls.__name__}.{name}")
    return wrapped


def wrap_start_loading(controller_class: type, injector: Injector) -> None:
    real = controller_class.start_loading  # type: ignore[attr-defined]

    def start_loading(self: Any) -> int:
        index: int = real(self)
        injector.load_started(index)
        return index

    controller_class.start_loading = start_loading  # type: ignore[attr-defined]


def wrap_prefetches(tree_class: type, injector: Injector) -> None:
    """Count the L3 prefetches a tree started (each request it put in flight) and the termination
    checks their progress made."""
    for key in L3_COUNTS:
        injector.counts.setdefault(key, 0)
    start = tree_class.prefetch_from_storage  # type: ignore[attr-defined]
    check = tree_class._can_terminate_prefetch  # type: ignore[attr-defined]

    def prefetch_from_storage(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        in_flight_before = request in self.ongoing_prefetch
        result = start(self, request, *args, **kwargs)
        if not in_flight_before and request in self.ongoing_prefetch:
            injector.count("prefetches_started", SAVE_EVERY_S)
        return result

    def can_terminate_prefetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        injector.count("prefetch_termination_checks", SAVE_EVERY_S)
        return check(self, *args, **kwargs)

    tree_class.prefetch_from_storage = prefetch_from_storage  # type: ignore[attr-defined]
    tree_class._can_terminate_prefetch = can_terminate_prefetch  # type: ignore[attr-defined]


def wrap_mamba_slot_misses(component_class: type, injector: Injector) -> None:
    """Count the Mamba slot misses the series recovered from (rescued, or a checkpoint skipped),
    where the tree's Mamba component records them (the patched trees only)."""
    injector.counts.setdefault("mamba_slot_misses", 0)
    record = component_class.__dict__.get(SLOT_MISS_METHOD)
    if record is None:
        return

    def record_slot_miss(self: Any, outcome: str) -> Any:
        injector.count("mamba_slot_misses")
        return record(self, outcome)

    setattr(component_class, SLOT_MISS_METHOD, record_slot_miss)


def wrap_scheduler(scheduler_class: type, injector: Injector) -> list[str]:
    """Count the unwinds (where the tree has one) and record the event loop's fatal exception."""
    wrapped = []
    unwind = scheduler_class.__dict__.get(UNWIND_METHOD)
    if unwind is not None:

        def unwind_prefill_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = unwind(self, *args, **kwargs)
            injector.unwound(args[0] if args else kwargs.get("batch"))
            return result

        setattr(scheduler_class, UNWIND_METHOD, unwind_prefill_batch)
        wrapped.append(UNWIND_METHOD)
    release = scheduler_class.__dict__.get(PARKED_RELEASE_METHOD)
    if release is not None:

        def release_parked_chunk(self: Any, *args: Any, **kwargs: Any) -> Any:
            released = release(self, *args, **kwargs)
            if released:
                injector.count("parked_chunk_releases")
            return released

        setattr(scheduler_class, PARKED_RELEASE_METHOD, release_parked_chunk)
        wrapped.append(PARKED_RELEASE_METHOD)
    agreement = scheduler_class.__dict__.get(AGREEMENT_PROPERTY)
    if isinstance(agreement, functools.cached_property):

        def counted_agreement(self: Any) -> Any:
            made = agreement.func(self)
            if made is None:
                return None

            reduce_over_the_group = made.reduce

            def reduce(tensor: Any) -> None:
                started = time.perf_counter()
                reduce_over_the_group(tensor)
                injector.agreement_all_reduce(round(1e6 * (time.perf_counter() - started)))

            made.reduce = reduce
            return made

        counted = functools.cached_property(counted_agreement)
        counted.__set_name__(scheduler_class, AGREEMENT_PROPERTY)
        setattr(scheduler_class, AGREEMENT_PROPERTY, counted)
        wrapped.append(AGREEMENT_PROPERTY)
    next_batch = scheduler_class.__dict__.get(NEXT_BATCH_METHOD)
    if next_batch is not None:

        def get_next_batch_to_run(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = injector.rounds_all_reduces()
            queued = (
                bool(getattr(self, "waiting_queue", ())) or getattr(self, "chunked_req", None) is not None
            )
            plan = next_batch(self, *args, **kwargs)
            batch = getattr(plan, "batch_to_run", plan)
            mode = getattr(batch, "forward_mode", None)
            admitted = mode is not None and bool(mode.is_extend())
            injector.iteration(admitted, queued, injector.rounds_all_reduces() - before)
            return plan

        setattr(scheduler_class, NEXT_BATCH_METHOD, get_next_batch_to_run)
        wrapped.append(NEXT_BATCH_METHOD)
    loop_name = next(n for n in EVENT_LOOP_METHODS if n in scheduler_class.__dict__)
    loop = scheduler_class.__dict__[loop_name]

    def event_loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        injector.scheduler = self
        try:
            return loop(self, *args, **kwargs)
        except BaseException as error:
            injector.died(error)
            raise

    setattr(scheduler_class, loop_name, event_loop)
    wrapped.append(loop_name)
    return wrapped


def all_subclasses(cls: type) -> list[type]:
    found: list[type] = []
    stack = [cls]
    while stack:
        subclasses: list[type] = stack.pop().__subclasses__()
        for sub in subclasses:
            if sub not in found:
                found.append(sub)
                stack.append(sub)
    return found


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs patches right after a named module has executed (whoever imports it first)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = patches

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in self.patches:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                self._patch_after_exec(spec.loader, self.patches.pop(name))
                return spec
        return None

    @staticmethod
    def _patch_after_exec(loader: Any, patch: Callable[[Any], None]) -> None:
        real_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            patch(module)

        loader.exec_module = exec_module


def parse_ranks(text: str) -> frozenset[int] | None:
    """A comma-separated list of TP ranks; empty: every rank (None)."""
    return frozenset(int(r) for r in text.split(",") if r.strip()) if text.strip() else None


def install(env: dict[str, str] | os._Environ[str] = os.environ) -> Injector | None:
    if env.get("CARRY_E2E_INJECT") != "1":
        return None
    counters = env.get("CARRY_E2E_COUNTERS_DIR")
    injector = Injector(
        int(env.get("CARRY_E2E_MISS_LIMIT", "3")),
        Path(counters) if counters else None,
        parse_ranks(env.get("CARRY_E2E_MISS_RANKS", "")),
    )
    rank_local = env.get("CARRY_E2E_RANK_LOCAL") == "1"
    withholder = Withholder(
        injector,
        int(env.get("CARRY_E2E_WITHHELD_TOKENS", "0")),
        parse_ranks(env.get("CARRY_E2E_WITHHOLD_RANKS", "")),
        drift=env.get("CARRY_E2E_WITHHELD_DRIFT") == "1",
    )

    miss_at_decode = env.get("CARRY_E2E_MISS_AT", "prefill") == "decode"

    def patch_batch(module: Any) -> None:
        wrap_decode_preparation(module.ScheduleBatch, injector, misses=miss_at_decode)
        if not miss_at_decode:
            wrap_batch_allocation(module.ScheduleBatch, injector)
        # The allocators are imported by then (schedule_batch imports the allocator package).
        allocator = sys.modules.get(ALLOCATOR_PACKAGE)
        base = getattr(allocator, "BaseTokenToKVPoolAllocator", None)
        if base is not None:
            wrap_allocators([base, *all_subclasses(base)], injector)
            if rank_local:
                base.rank_local_capacity = True
                no_miss = injector.limit == 0 and withholder.tokens == 0
                give_uniform_readings([base, *all_subclasses(base)], guaranteed=no_miss)
            if withholder.tokens > 0:
                wrap_available_size([base, *all_subclasses(base)], withholder)
            if rank_local:
                give_agreed_readings([base, *all_subclasses(base)])

    def patch_controller(module: Any) -> None:
        wrap_start_loading(module.HiCacheController, injector)

    def patch_scheduler(module: Any) -> None:
        wrap_scheduler(module.Scheduler, injector)

    patches: dict[str, Callable[[Any], None]] = {
        BATCH_MODULE: patch_batch,
        CONTROLLER_MODULE: patch_controller,
        SCHEDULER_MODULE: patch_scheduler,
    }
    if env.get("CARRY_E2E_L3") == "1":
        # HiCache L3: prefetches from storage started, and their termination checks (with the
        # `timeout` policy each is an all-reduce inside admission).
        injector.counts.update(dict.fromkeys(L3_COUNTS, 0))
        patches[TREE_MODULE] = lambda module: wrap_prefetches(module.UnifiedRadixCache, injector)
    if env.get("CARRY_E2E_CPU") == "1":
        import carry_e2e_cpu  # on PYTHONPATH only in the CPU mode's servers

        patches |= carry_e2e_cpu.install()
        if env.get("CARRY_E2E_MAMBA") == "1":
            import carry_e2e_mamba  # beside carry_e2e_cpu

            if env.get("CARRY_E2E_GDN") == "1":
                import carry_e2e_gdn  # beside carry_e2e_mamba

                # First: the names it binds are then not taken for import-time placeholders.
                carry_e2e_gdn.install()
                patches |= carry_e2e_gdn.PATCHES
            carry_e2e_mamba.install_import_time_names()
            patches |= carry_e2e_mamba.PATCHES
            patches[MAMBA_COMPONENT_MODULE] = lambda module: wrap_mamba_slot_misses(
                module.MambaComponent, injector
            )
            injector.watch(
                lambda: {
                    "mamba_copies_landed": carry_e2e_mamba.copies_landed(),
                    "mamba_late_copies": carry_e2e_mamba.late_copies(),
                }
            )
    sys.meta_path.insert(0, AfterImport(patches))
    return injector


INJECTOR = install()
