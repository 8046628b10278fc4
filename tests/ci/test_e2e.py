"""ci/e2e on CPU: the miss-injection hook on fake batch/allocator classes, and the driver
(launch, health, bounded traffic, verdicts, killing the process group) against a fake server.
The flags and model configs are checked against the real sglang tree (argparse and config
classes only: nothing here needs a GPU)."""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ci" / "e2e"))
sys.path.insert(0, str(ROOT / "ci" / "e2e" / "hook"))
import run_e2e  # noqa: E402
import sitecustomize as hook  # noqa: E402
from e2e_harness import (  # noqa: E402
    metrics,
    runner,
    traffic,
)
from e2e_harness.models import DENSE_LLAMA, HYBRID_GDN, MODELS, llama_weight_shapes, write_models  # noqa: E402
from e2e_harness.plan import (  # noqa: E402
    ALL_RUNS,
    CPU_DEFAULT_RUNS,
    CPU_MODELS,
    CPU_PLAN,
    CPU_RUNS,
    ModelPlan,
    RunSpec,
    chosen_runs,
    runs_not_on_line,
    runs_without_their_control,
)
from e2e_harness.runner import run_once  # noqa: E402
from e2e_harness.scenarios import (  # noqa: E402
    GDN,
    LFM2,
    MAX_TOTAL_TOKENS,
    NATURAL,
    NATURAL_HICACHE,
    NATURAL_PARKED,
    NATURAL_POOL_TOKENS,
    NATURAL_ROOMY_POOL_TOKENS,
)
from e2e_harness.server import CPU_FLAGS, HOOK, Server, free_port, server_command  # noqa: E402
from e2e_harness.verdicts import COMPARING, Run, judge  # noqa: E402
from interrupted_driver import FAKE_SERVER, INTERRUPTS, assert_an_interrupt_kills_its_servers, gone  # noqa: E402


# --------------------------------------------------------------------------------------------
# The hook
# --------------------------------------------------------------------------------------------
def fresh_classes() -> dict[str, type]:
    """Two allocators and the two batch shapes (the hook patches classes in place, so new ones per
    test): pristine sglang allocates in prepare_for_extend; the patched scheduler calls
    allocate_for_extend directly, and prepare_for_extend calls it too."""

    class Alloc:
        def __init__(self) -> None:
            self.taken = 0

        def alloc(self, need: int) -> list[int] | None:
            self.taken += need
            return list(range(need))

    class Paged(Alloc):
        def alloc_extend(self, need: int) -> list[int] | None:
            return self.alloc(need)

    class PristineBatch:
        def __init__(self, allocator: Alloc, consumer: int) -> None:
            self.allocator, self.hicache_consumer_index = allocator, consumer

        def prepare_for_extend(self) -> list[int] | None:
            return self.allocator.alloc(4)

    class PatchedBatch(PristineBatch):
        def allocate_for_extend(self) -> list[int] | None:
            return self.allocator.alloc(4)

        def prepare_for_extend(self) -> list[int] | None:
            return self.allocate_for_extend()

    return {"Alloc": Alloc, "Paged": Paged, "PristineBatch": PristineBatch, "PatchedBatch": PatchedBatch}


@pytest.mark.parametrize(
    ("shape", "wrapped_method", "call"),
    [
        ("PristineBatch", "prepare_for_extend", "prepare_for_extend"),
        ("PatchedBatch", "allocate_for_extend", "allocate_for_extend"),  # the scheduler's call
        ("PatchedBatch", "allocate_for_extend", "prepare_for_extend"),  # other callers
    ],
)
def test_hook_misses_where_the_tree_allocates_a_loading_batch(
    tmp_path: Path, shape: str, wrapped_method: str, call: str
) -> None:
    classes = fresh_classes()
    injector = hook.Injector(limit=2, counters_dir=tmp_path / "counters")
    assert hook.wrap_batch_allocation(classes[shape], injector) == wrapped_method
    wrapped = hook.wrap_allocators([classes["Alloc"], classes["Paged"]], injector)
    assert wrapped == ["Alloc.alloc", "Paged.alloc_extend"]
    allocator, batch = classes["Alloc"](), classes[shape]

    def allocate(consumer: int) -> list[int] | None:
        result: list[int] | None = getattr(batch(allocator, consumer), call)()
        return result

    assert allocator.alloc(3) == [0, 1, 2]  # outside the batch's allocation: never a miss
    assert allocate(-1) == [0, 1, 2, 3]  # no load in flight
    assert allocate(0) is None  # a load in flight: miss
    assert allocator.taken == 7  # the miss took nothing
    assert allocate(2) is None
    assert allocate(1) == [0, 1, 2, 3]  # the limit (2) is reached
    counters = json.loads((tmp_path / "counters" / f"{os.getpid()}.json").read_text())
    assert counters == {
        "rank": 0,
        "eligible_allocations": 3,
        "injected_misses": 2,
        "loads_started": 0,
        "unwinds": 0,
        "withheld_readings": 0,
        "decode_retractions": 0,
        "decode_steps": 0,
        "agreement_all_reduces": 0,
        "decode_votes": 0,
        "agreement_us": 0,
        "withheld_amounts": 0,
        "parked_chunk_releases": 0,
        "iterations": 0,
        "idle_round_all_reduces": 0,
        "idle_round_iterations": 0,
        "unwound_rids": {},
        "died_with": None,
    }


def test_hook_misses_in_a_decode_step_of_two_requests_and_counts_retractions_after_it(tmp_path: Path) -> None:
    allocator_class = fresh_classes()["Alloc"]

    class DecodeBatch:
        def __init__(self, allocator: Any, requests: int) -> None:
            self.allocator, self.reqs = allocator, [object()] * requests

        def prepare_for_decode(self) -> list[int] | None:
            result: list[int] | None = self.allocator.alloc(len(self.reqs))
            injector.agreement_all_reduce(0)  # the step's vote
            return result

        def retract_decode(self, after_allocation_miss: bool = False) -> str:
            return "retracted"

    injector = hook.Injector(limit=1, counters_dir=None)
    hook.wrap_decode_preparation(DecodeBatch, injector)
    hook.wrap_allocators([allocator_class], injector)
    allocator = allocator_class()
    assert DecodeBatch(allocator, 1).prepare_for_decode() == [0]  # the warm-up's step: never
    assert DecodeBatch(allocator, 2).prepare_for_decode() is None  # a miss
    assert DecodeBatch(allocator, 2).prepare_for_decode() == [0, 1]  # the limit (1) is reached
    assert DecodeBatch(allocator, 2).retract_decode() == "retracted"  # upstream's own: not counted
    DecodeBatch(allocator, 2).retract_decode(after_allocation_miss=True)
    assert injector.counts["injected_misses"] == 1 and injector.counts["decode_retractions"] == 1
    assert injector.counts["decode_steps"] == injector.counts["decode_votes"] == 3
    injector.agreement_all_reduce(0)  # a prefill round's vote
    assert injector.counts["decode_votes"] == 3 and injector.counts["agreement_all_reduces"] == 4


def test_hook_misses_only_on_the_ranks_it_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    classes = fresh_classes()
    injector = hook.Injector(limit=5, counters_dir=None, miss_ranks=frozenset({1}))
    hook.wrap_batch_allocation(classes["PatchedBatch"], injector)
    hook.wrap_allocators([classes["Alloc"]], injector)
    allocator = classes["Alloc"]()
    monkeypatch.setattr(hook, "tp_rank", lambda: 0)
    assert classes["PatchedBatch"](allocator, 0).allocate_for_extend() == [0, 1, 2, 3]
    monkeypatch.setattr(hook, "tp_rank", lambda: 1)
    assert classes["PatchedBatch"](allocator, 0).allocate_for_extend() is None
    assert injector.counts["injected_misses"] == 1 and injector.counts["eligible_allocations"] == 2


def test_hook_counts_unwinds_and_records_the_schedulers_own_error(tmp_path: Path) -> None:
    def allocation_error() -> None:
        raise RuntimeError("Out of memory. Try to lower your batch size.")

    class Scheduler:
        def _unwind_prefill_batch(self, batch: Any, *rest: Any) -> str:
            return "unwound"

        def run_event_loop(self) -> None:
            allocation_error()

        def event_loop_normal(self) -> None:  # dispatched to by run_event_loop: not wrapped
            raise AssertionError("not reached")

    injector = hook.Injector(limit=0, counters_dir=tmp_path)
    assert hook.wrap_scheduler(Scheduler, injector) == ["_unwind_prefill_batch", "run_event_loop"]
    scheduler = Scheduler()
    batch = SimpleNamespace(reqs=[SimpleNamespace(rid="long"), SimpleNamespace(rid="short.0")])
    assert scheduler._unwind_prefill_batch(batch, None) == "unwound"
    scheduler._unwind_prefill_batch(SimpleNamespace(reqs=[SimpleNamespace(rid="long")]))
    with pytest.raises(RuntimeError, match="Out of memory"):
        scheduler.run_event_loop()
    saved = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
    assert saved["unwinds"] == 2 and saved["unwound_rids"] == {"long": 2, "short.0": 1}
    assert saved["died_with"]["type"] == "RuntimeError"
    assert saved["died_with"]["raised_in"].endswith("test_e2e.py:allocation_error")

    pristine = type("Scheduler", (), {"event_loop_overlap": lambda self: None})
    assert hook.wrap_scheduler(pristine, injector) == ["event_loop_overlap"]  # no unwind to count


class Agreement:
    """The shape of the carried scheduler's RankAgreement the hook relies on: a reduce to wrap."""

    def __init__(self, reduce: Callable[[list[int]], None]) -> None:
        self.reduce = reduce


def test_hook_counts_the_agreements_all_reduces_and_saves_the_last_ones_soon(tmp_path: Path) -> None:
    reduced: list[list[int]] = []

    def reduce_slowly(vote: list[int]) -> None:
        reduced.append(vote)
        time.sleep(0.02)

    class Scheduler:
        rank_local = True

        @functools.cached_property
        def _prefill_agreement(self) -> Agreement | None:
            return Agreement(reduce_slowly) if self.rank_local else None

        def run_event_loop(self) -> None:
            pass

    injector = hook.Injector(limit=0, counters_dir=tmp_path)
    assert "_prefill_agreement" in hook.wrap_scheduler(Scheduler, injector)
    scheduler = Scheduler()
    for vote in ([1], [2]):
        scheduler._prefill_agreement.reduce(vote)  # type: ignore[union-attr]
    with injector.preparing_decode():  # a decode step's vote
        scheduler._prefill_agreement.reduce([3])  # type: ignore[union-attr]
    assert reduced == [[1], [2], [3]] and scheduler._prefill_agreement is scheduler._prefill_agreement
    plain = Scheduler()
    plain.rank_local = False
    assert plain._prefill_agreement is None
    # Counted every time, saved within SAVE_EVERY_S of the last count.
    deadline = time.monotonic() + 5
    while json.loads((tmp_path / f"{os.getpid()}.json").read_text())["agreement_all_reduces"] != 3:
        assert time.monotonic() < deadline, "the last counts never reached the file"
        time.sleep(0.05)
    counts = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
    assert counts["decode_votes"] == 1
    # The time inside them, measured around the real reduce (each took at least 20 ms).
    assert 60_000 <= counts["agreement_us"] < 5_000_000


def test_hook_counts_the_all_reduces_of_loop_iterations_that_admitted_nothing(tmp_path: Path) -> None:
    """Each call of get_next_batch_to_run is one loop iteration; the agreement's all-reduces made
    inside one that ran no prefill batch with nothing queued at its start (no rank could admit)
    are counted, a decode step's vote aside."""

    class Mode:
        def __init__(self, extend: bool) -> None:
            self.extend = extend

        def is_extend(self) -> bool:
            return self.extend

    class Running:
        def __init__(self, requests: int) -> None:
            self.requests = requests

        def is_empty(self) -> bool:
            return self.requests == 0

    class Scheduler:
        @functools.cached_property
        def _prefill_agreement(self) -> Agreement:
            return Agreement(lambda vote: None)

        def __init__(self) -> None:
            self.waiting_queue: list[str] = []
            self.chunked_req = None

        def get_next_batch_to_run(self, running_batch: Any, last_batch: Any) -> Any:
            votes, decode_vote, extend, running, _ = running_batch
            for _ in range(votes):
                self._prefill_agreement.reduce([0])
            if decode_vote:
                with injector.preparing_decode():
                    self._prefill_agreement.reduce([0])
            batch = None if extend is None else SimpleNamespace(forward_mode=Mode(extend))
            return SimpleNamespace(batch_to_run=batch, running_batch=Running(running))

        def run_event_loop(self) -> None:
            pass

    injector = hook.Injector(limit=0, counters_dir=tmp_path)
    assert "get_next_batch_to_run" in hook.wrap_scheduler(Scheduler, injector)
    scheduler = Scheduler()
    iterations = [
        (1, False, True, 0, ["a"]),  # a prefill round admitted: its vote is not counted
        (1, False, None, 2, ["b"]),  # queued, nothing admitted beside two running: settled, not counted
        (1, False, None, 2, []),  # nothing queued, nothing admitted, yet a vote: counted
        (0, True, False, 2, []),  # a decode step's vote: not counted
        (2, True, False, 2, []),  # a decode step after a round with nothing queued (two all-reduces)
        (1, False, None, 0, []),  # nothing queued, admitted or running, a vote: counted
        (0, False, None, 0, []),  # idle: nothing
    ]
    for iteration in iterations:
        scheduler.waiting_queue = iteration[4]
        plan = scheduler.get_next_batch_to_run(iteration, None)
        assert plan.running_batch.requests == iteration[3]  # the plan is passed on as it is
    assert injector.counts["iterations"] == 7
    assert injector.counts["idle_round_all_reduces"] == 4
    assert injector.counts["idle_round_iterations"] == 3
    assert injector.counts["agreement_all_reduces"] == 8 and injector.counts["decode_votes"] == 2


class Allocator:
    """A token allocator whose parts are allocators too (as a composite one asks its parts)."""

    def __init__(self, free: int, part: Allocator | None = None) -> None:
        self.free, self.part = free, part

    def available_size(self) -> int:
        return self.part.available_size() if self.part is not None else self.free


class Scheduler:
    def __init__(self) -> None:
        self.waiting: list[str] = []

    def is_fully_idle(self) -> bool:
        return not self.waiting


def test_hook_withholds_free_tokens_on_its_ranks_while_the_scheduler_is_busy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = type("Allocator", (Allocator,), {})
    injector = hook.Injector(limit=0, counters_dir=tmp_path)
    withholder = hook.Withholder(injector, tokens=256, ranks=frozenset({0}))
    assert hook.wrap_available_size([Allocator, cls], withholder) == ["Allocator.available_size"]
    assert hook.wrap_available_size([Allocator], withholder) == []  # already wrapped
    composite, small = Allocator(0, part=cls(1000)), Allocator(100)
    assert composite.available_size() == 1000  # no event loop yet: nothing is admitted
    scheduler = Scheduler()
    injector.scheduler = scheduler
    assert composite.available_size() == 1000  # fully idle: the leak check sees the whole pool
    scheduler.waiting.append("request")
    monkeypatch.setattr(hook, "tp_rank", lambda: 0)
    assert composite.available_size() == 744  # busy: withheld once, not once per part
    assert small.available_size() == 0  # never below 0
    monkeypatch.setattr(hook, "tp_rank", lambda: 1)
    assert composite.available_size() == 1000  # not a withholding rank
    saved = json.loads((tmp_path / f"{os.getpid()}.json").read_text())
    assert injector.counts["withheld_readings"] == 2 and saved["withheld_readings"] >= 1
    injector.scheduler = object()  # a tree without is_fully_idle: always busy
    monkeypatch.setattr(hook, "tp_rank", lambda: 0)
    assert composite.available_size() == 744


def test_a_drifting_withholder_changes_the_reading_at_every_read(tmp_path: Path) -> None:
    """tp2-drift: the withheld amount cycles (all, none, a third, two thirds) so no two readings
    in a row are reduced alike, as kvcached's TTL-cached physical reading drifts."""
    injector = hook.Injector(limit=0, counters_dir=tmp_path)
    injector.scheduler = object()  # always busy
    withholder = hook.Withholder(injector, tokens=300, ranks=None, drift=True)
    readings = [withholder.reading(lambda: 1000) for _ in range(8)]
    assert readings == [1000, 900, 800, 700] * 2
    assert injector.counts["withheld_amounts"] == 4
    steady = hook.Withholder(injector, tokens=300, ranks=None)
    assert {steady.reading(lambda: 1000) for _ in range(4)} == {700}


def test_a_drift_run_fails_when_the_reading_did_not_drift(
    tmp_path: Path, control_outputs: dict[str, list[int]]
) -> None:
    drift = next(spec for spec, _ in CPU_PLAN if spec.name == "tp2-drift")
    drifted, _ = _run(tmp_path, "patched", drift, control_outputs)
    assert drifted.ok and drifted.withheld_amounts == {"0": 4, "1": 0}, drifted
    steady, _ = _run(tmp_path, "no-drift", drift, control_outputs)
    assert not steady.ok and steady.verdict.startswith("the withheld reading did not drift"), steady


def test_the_drift_and_delayer_runs_compare_with_the_tp2_control() -> None:
    specs = {spec.name: spec for spec, _ in CPU_PLAN}
    drift, delayer = specs["tp2-drift"], specs["tp2-delayer"]
    assert drift.withheld_drift and drift.withheld_tokens > 0 and drift.withhold_ranks == (0,)
    assert "--enable-prefill-delayer" in delayer.server_flags and delayer.withheld_tokens > 0
    for spec in (drift, delayer):
        assert (spec.kind, spec.tp, spec.rank_local, spec.miss_ranks) == ("patched", 2, True, (1,))
        assert spec.control_name == "tp2-control"


@pytest.mark.parametrize(("tokens", "wrapped"), [("64", True), ("0", False)])
def test_hook_withholds_only_when_told(monkeypatch: pytest.MonkeyPatch, tokens: str, wrapped: bool) -> None:
    before = list(sys.meta_path)
    env = {"CARRY_E2E_INJECT": "1", "CARRY_E2E_WITHHELD_TOKENS": tokens, "CARRY_E2E_WITHHOLD_RANKS": "0"}
    try:
        assert hook.install(env) is not None
        finder: Any = sys.meta_path[0]
        base = type("BaseTokenToKVPoolAllocator", (), {"available_size": lambda self: 1000})
        package = SimpleNamespace(BaseTokenToKVPoolAllocator=base)
        monkeypatch.setitem(sys.modules, hook.ALLOCATOR_PACKAGE, package)
        batch = type("ScheduleBatch", (), {"prepare_for_extend": lambda self: None})
        finder.patches[hook.BATCH_MODULE](SimpleNamespace(ScheduleBatch=batch))
        assert getattr(base.__dict__["available_size"], "_carry_e2e", False) is wrapped
        assert not hasattr(base, "rank_local_capacity")  # CARRY_E2E_RANK_LOCAL not set
    finally:
        sys.meta_path[:] = before


def test_a_rank_local_pool_counts_from_its_free_list_not_its_withheld_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Marked rank-local, the allocators give the carried scheduler their own free-list count as
    the reading only their own calls change (without it the patched scheduler refuses to start);
    the withholding, which stands in for a co-tenant, lowers `available_size` only."""
    before = list(sys.meta_path)
    env = {
        "CARRY_E2E_INJECT": "1",
        "CARRY_E2E_RANK_LOCAL": "1",
        "CARRY_E2E_WITHHELD_TOKENS": "64",
        "CARRY_E2E_WITHHOLD_RANKS": "0",
    }
    try:
        injector = hook.install(env)
        assert injector is not None
        finder: Any = sys.meta_path[0]
        base = type("BaseTokenToKVPoolAllocator", (), {"available_size": lambda self: 1000})
        monkeypatch.setitem(
            sys.modules, hook.ALLOCATOR_PACKAGE, SimpleNamespace(BaseTokenToKVPoolAllocator=base)
        )
        batch = type("ScheduleBatch", (), {"prepare_for_extend": lambda self: None})
        finder.patches[hook.BATCH_MODULE](SimpleNamespace(ScheduleBatch=batch))
        injector.scheduler = object()  # always busy: the withholding applies
        monkeypatch.setattr(hook, "tp_rank", lambda: 0)
        pool = base()
        assert getattr(base, "rank_local_capacity", None) is True
        assert (pool.uniform_available_size(), pool.available_size()) == (1000, 936)
        # kvcached's rank-local interface: the real reading is the withheld one, and once the
        # ranks agree a deficit the pool reads the uniform reading less it.
        assert pool.real_available_size() == 936
        pool.agree_deficit(100)
        assert pool.available_size() == 900 and pool.real_available_size() == 936
        pool.agree_deficit(None)
        assert pool.available_size() == 936
    finally:
        sys.meta_path[:] = before


def test_hook_counts_the_l3_prefetches_it_started_and_their_termination_checks() -> None:
    class Tree:
        def __init__(self) -> None:
            self.ongoing_prefetch: dict[str, object] = {}

        def prefetch_from_storage(self, request: str, tokens: list[int], hit: bool = True) -> None:
            if hit:
                self.ongoing_prefetch[request] = tokens

        def _can_terminate_prefetch(self, operation: object) -> bool:
            return operation == "late"

    injector = hook.Injector(limit=0, counters_dir=None)
    hook.wrap_prefetches(Tree, injector)
    tree = Tree()
    tree.prefetch_from_storage("a", [1])
    tree.prefetch_from_storage("a", [1])  # already in flight: not a new prefetch
    tree.prefetch_from_storage("b", [2], hit=False)  # nothing in storage: none started
    assert [tree._can_terminate_prefetch(op) for op in ("early", "late")] == [False, True]
    assert injector.counts["prefetches_started"] == 1 and injector.counts["prefetch_termination_checks"] == 2


def test_hook_wraps_once_and_counts_loads(tmp_path: Path) -> None:
    injector = hook.Injector(limit=0, counters_dir=None)
    cls = type("Alloc", (), {"alloc": lambda self, n: [n]})
    assert hook.wrap_allocators([cls], injector) == ["Alloc.alloc"]
    assert hook.wrap_allocators([cls], injector) == []  # already wrapped
    controller = type("Controller", (), {"start_loading": lambda self: self.next})
    hook.wrap_start_loading(controller, injector)
    c = controller()
    for c.next in (-1, 0, 2):
        c.start_loading()
    assert injector.counts["loads_started"] == 2


def test_hook_patches_a_module_right_after_it_is_imported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "carry_e2e_fake_batch.py").write_text("class ScheduleBatch:\n    patched = False\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    finder = hook.AfterImport({"carry_e2e_fake_batch": lambda m: setattr(m.ScheduleBatch, "patched", True)})
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module("carry_e2e_fake_batch")
        assert module.ScheduleBatch.patched is True
        assert finder.patches == {}
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop("carry_e2e_fake_batch", None)


def test_hook_is_off_without_the_variable() -> None:
    before = list(sys.meta_path)
    assert hook.install({}) is None
    assert hook.install({"CARRY_E2E_INJECT": "0"}) is None
    assert sys.meta_path == before
    injector = hook.install(
        {"CARRY_E2E_INJECT": "1", "CARRY_E2E_MISS_LIMIT": "5", "CARRY_E2E_MISS_RANKS": "1"}
    )
    try:
        assert injector is not None and injector.limit == 5 and injector.miss_ranks == frozenset({1})
        assert isinstance(sys.meta_path[0], hook.AfterImport)
        assert set(sys.meta_path[0].patches) == {
            hook.BATCH_MODULE,
            hook.CONTROLLER_MODULE,
            hook.SCHEDULER_MODULE,
        }
    finally:
        sys.meta_path[:] = before


# --------------------------------------------------------------------------------------------
# The driver, against the fake server
# --------------------------------------------------------------------------------------------
@pytest.fixture
def small_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traffic, "GROUPS", 3)
    monkeypatch.setattr(traffic, "ROUNDS", 2)


def _run(
    tmp_path: Path,
    mode: str,
    spec: Any,
    control: dict[str, list[int]] | None = None,
    request_timeout_s: float = traffic.REQUEST_TIMEOUT_S,
) -> Any:
    port = free_port()
    command = [sys.executable, str(FAKE_SERVER), str(port), mode, "--tp", str(spec.tp)]
    return run_once(
        "dense", spec, command, tmp_path, dict(os.environ), [], control, port, 30, 60, request_timeout_s
    )


CONTROL = RunSpec("control", "control")
PRISTINE = RunSpec("pristine", "pristine")
PATCHED = RunSpec("patched", "patched")
WITHOUT = RunSpec("without-load-wait", "without-load-wait")
TP2_PRISTINE = RunSpec("tp2-pristine", "pristine", tp=2, miss_ranks=(1,), rank_local=True)
TP2_PATCHED = RunSpec("tp2-patched", "patched", tp=2, miss_ranks=(1,), rank_local=True)
TP2_UNEVEN = next(spec for spec, _ in CPU_PLAN if spec.name == "tp2-uneven")
TP2_DECODE = next(spec for spec, _ in CPU_PLAN if spec.name == "tp2-decode-patched")


@pytest.fixture
def control_outputs(tmp_path: Path, small_traffic: None) -> dict[str, list[int]]:
    control, outcomes = _run(tmp_path, "control", CONTROL)
    assert control.ok, control
    assert control.finished == 6 and control.host_cached_tokens == 3 * 256 and control.injected_misses == 0
    return {o.key: o.output_ids for o in outcomes}


def test_every_kind_meets_its_expectation(tmp_path: Path, control_outputs: dict[str, list[int]]) -> None:
    pristine, _ = _run(tmp_path, "pristine", PRISTINE, control_outputs)
    assert pristine.ok and pristine.server_died and pristine.failed > 0, pristine
    assert pristine.verdict == "the scheduler died with the allocation error (as expected; rank 0)"
    assert "allocation.py" in pristine.died_with["0"]

    patched, _ = _run(tmp_path, "patched", PATCHED, control_outputs)
    assert patched.ok, patched
    assert patched.misses == {"0": 3} and patched.unwinds == {"0": 3} and patched.unwinds_logged == 3
    assert patched.outputs_equal_control and patched.outputs_differing == 0
    assert (tmp_path / "dense-patched.log").read_text().startswith("fake server patched")

    without, _ = _run(tmp_path, "skewed", WITHOUT, control_outputs)
    assert without.ok and without.outputs_differing == 6, without
    assert without.verdict == "the hazard showed: 6 of 6 outputs differ from the control run's"


def test_a_patched_run_reads_the_series_counters_from_the_servers_metrics(
    tmp_path: Path, control_outputs: dict[str, list[int]]
) -> None:
    """A patched server is started with --enable-metrics and its /metrics scraped after the
    traffic: its counters must equal the hook's per rank. One event fewer on one rank, or no
    /metrics at all, fails the run."""
    patched, _ = _run(tmp_path, "patched", TP2_PATCHED, control_outputs)
    assert patched.ok and patched.scraped == {
        "sglang:num_prefill_unwinds_total": {"0": 3, "1": 3},
        **{
            name: {"0": 0, "1": 0}
            for name in (
                "sglang:num_decode_allocation_misses_total",
                "sglang:num_parked_chunk_releases_total",
            )
        },
    }, patched
    assert patched.verdict.endswith("; /metrics: num_prefill_unwinds_total 0:3 1:3")
    undercounted, _ = _run(tmp_path, "metrics-undercount", TP2_PATCHED, control_outputs)
    assert not undercounted.ok and undercounted.verdict.endswith(
        "; /metrics disagrees with the hook: sglang:num_prefill_unwinds_total rank 1: /metrics 2, the hook 3"
    ), undercounted.verdict
    unscraped, _ = _run(tmp_path, "no-metrics", TP2_PATCHED, control_outputs)
    assert not unscraped.ok and unscraped.scraped is None
    assert unscraped.verdict.endswith("; the server's /metrics could not be read after the traffic")


def test_the_metrics_page_is_read_per_rank_with_other_labels_summed() -> None:
    page = "\n".join(
        [
            "# HELP sglang:mamba_slot_misses_total Mamba slot misses.",
            "# TYPE sglang:mamba_slot_misses_total counter",
            'sglang:mamba_slot_misses_total{cache_type="U",tp_rank="0",outcome="rescued"} 4.0',
            'sglang:mamba_slot_misses_total{cache_type="U",tp_rank="0",outcome="checkpoint_skipped"} 2.0',
            'sglang:mamba_slot_misses_total{cache_type="U",tp_rank="1",outcome="rescued"} 6.0',
            'sglang:mamba_slot_misses_created{cache_type="U",tp_rank="1",outcome="rescued"} 1.7e+09',
            'sglang:num_parked_chunk_releases_total{model_name="m",tp_rank="0"} 1.0',
            'sglang:num_parked_chunk_releases_created{model_name="m",tp_rank="0"} 1.7e+09',
            'sglang:num_requests_total{model_name="m",tp_rank="0"} 9.0',
        ]
    )
    scraped = metrics.parse(page)
    assert scraped == {
        "sglang:mamba_slot_misses_total": {"0": 6, "1": 6},
        "sglang:num_parked_chunk_releases_total": {"0": 1},
    }
    assert metrics.shown(scraped) == "num_parked_chunk_releases_total 0:1, mamba_slot_misses_total 0:6 1:6"
    hook = {"mamba_slot_misses": {"0": 6, "1": 5}, "parked_chunk_releases": {"0": 1}}
    assert metrics.disagreements(scraped, hook, ["0", "1"]) == [
        "sglang:mamba_slot_misses_total rank 1: /metrics 6, the hook 5"
    ]
    # The unwind's counter also counts rounds that put no batch back: more than the hook is fine.
    assert (
        metrics.disagreements({"sglang:num_prefill_unwinds_total": {"0": 4}}, {"unwinds": {"0": 3}}, ["0"])
        == []
    )
    assert metrics.disagreements({}, {"unwinds": {"0": 3}}, ["0"]) == [
        "sglang:num_prefill_unwinds_total rank 0: /metrics 0, the hook 3"
    ]


def test_two_ranks_miss_on_one_and_unwind_on_both(
    tmp_path: Path, control_outputs: dict[str, list[int]]
) -> None:
    patched, _ = _run(tmp_path, "patched", TP2_PATCHED, control_outputs)
    assert patched.ok, patched
    assert patched.misses == {"0": 0, "1": 3} and patched.unwinds == {"0": 3, "1": 3}
    pristine, _ = _run(tmp_path, "pristine", TP2_PRISTINE, control_outputs)
    assert pristine.ok and pristine.verdict.endswith("(as expected; rank 1)"), pristine


def test_uneven_ranks_withhold_on_rank_0_miss_on_rank_1_and_match_the_control(
    tmp_path: Path, control_outputs: dict[str, list[int]]
) -> None:
    assert (TP2_UNEVEN.kind, TP2_UNEVEN.tp, TP2_UNEVEN.rank_local) == ("patched", 2, True)
    assert TP2_UNEVEN.withhold_ranks == (0,) and TP2_UNEVEN.miss_ranks == (1,)
    assert 0 < TP2_UNEVEN.withheld_tokens < MAX_TOTAL_TOKENS
    uneven, _ = _run(tmp_path, "patched", TP2_UNEVEN, control_outputs)
    assert uneven.ok, uneven
    assert uneven.withheld_readings == {"0": 6, "1": 0} and uneven.misses == {"0": 0, "1": 3}
    assert uneven.verdict == (
        "every request finished, every rank unwound, outputs equal the control run's;"
        " /metrics: num_prefill_unwinds_total 0:3 1:3"
    )


def test_a_decode_miss_on_one_rank_is_retracted_on_both(
    tmp_path: Path, control_outputs: dict[str, list[int]]
) -> None:
    assert (TP2_DECODE.kind, TP2_DECODE.miss_at, TP2_DECODE.miss_ranks) == ("patched", "decode", (1,))
    patched, _ = _run(tmp_path, "patched", TP2_DECODE, control_outputs)
    assert patched.ok, patched
    assert patched.decode_retractions == {"0": 3, "1": 3} and patched.unwinds == {"0": 0, "1": 0}
    assert "every rank retracted after a decode miss" in patched.verdict
    one_rank, _ = _run(tmp_path, "one-rank-unwinds", TP2_DECODE, control_outputs)
    assert not one_rank.ok and "retracted after a decode miss: {'0': 0, '1': 3}" in one_rank.verdict


@pytest.mark.parametrize(
    ("mode", "verdict"),
    [
        ("skewed", "outputs equal control: False (6 differ, each with its unwinds"),  # silent corruption
        ("abort", "1 failed"),  # a request that does not finish
        ("hang", "HANG: 3 request(s) timed out"),  # the ranks stall (the run's bounds end it)
        ("one-rank-unwinds", "unwound: {'0': 0, '1': 3}"),
        ("no-withhold", "nothing was withheld"),  # the ranks' free space did not differ
        ("pristine", "died with {'1': 'RuntimeError"),  # a scheduler died
    ],
)
def test_uneven_ranks_fail_when_outputs_differ_a_request_fails_or_it_hangs(
    tmp_path: Path, control_outputs: dict[str, list[int]], mode: str, verdict: str
) -> None:
    run, _ = _run(tmp_path, mode, TP2_UNEVEN, control_outputs, request_timeout_s=3)
    assert not run.ok and verdict in run.verdict, run


def test_a_hung_server_gets_no_more_waves(
    tmp_path: Path, small_traffic: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traffic, "ROUNDS", 3)
    started = time.monotonic()
    run, outcomes = _run(tmp_path, "hang", PATCHED, None, request_timeout_s=2)
    assert run.hung and run.finished == 3 and run.failed == 6 and time.monotonic() - started < 30
    assert all(map(traffic.timed_out, outcomes[3:6]))  # the second wave: each request missed
    assert [o.error for o in outcomes[6:]] == ["not sent: an earlier request hung"] * 3


TP2_L3 = next(spec for spec, _ in CPU_PLAN if spec.name == "tp2-l3")


def test_the_l3_run_prefetches_from_its_own_files_and_fails_without_a_storage_hit(
    tmp_path: Path, control_outputs: dict[str, list[int]]
) -> None:
    assert TP2_L3.l3_storage and TP2_L3.withheld_drift and TP2_L3.control_name == "tp2-control"
    assert {"--hicache-storage-backend", "file", "timeout"} <= set(TP2_L3.server_flags)
    run, _ = _run(tmp_path, "patched", TP2_L3, control_outputs)
    assert run.ok and run.storage_cached_tokens == 3 * 256, run
    assert run.prefetches == run.prefetch_termination_checks == {"0": 3, "1": 3}
    assert "768 prompt tokens read from L3; /metrics: " in run.verdict, run
    assert (tmp_path / "l3-storage" / "dense-tp2-l3").is_dir()
    none_prefetched, _ = _run(tmp_path, "no-prefetch", TP2_L3, control_outputs)
    assert not none_prefetched.ok, none_prefetched
    assert none_prefetched.verdict.startswith("no L3 prefetch was checked in flight on every rank")


def test_tp2_uneven_is_compared_with_the_tp2_control() -> None:
    assert "tp2-uneven" in CPU_RUNS
    assert runs_without_their_control(["tp2-uneven"]) == ["tp2-uneven needs tp2-control"]


# Each expectation, broken once: the verdict must fail (or, for a survivor, say upstream fixed it).
@pytest.mark.parametrize(
    ("mode", "spec", "verdict"),
    [
        ("no-miss", PRISTINE, "no miss was injected"),  # the hook injected nothing
        ("no-miss", PATCHED, "no miss was injected"),
        ("no-miss", WITHOUT, "no miss was injected"),
        ("other-death", PRISTINE, "the server died, but no scheduler of the allocation error"),
        ("skewed", PATCHED, "outputs equal control: False"),
        ("patched", WITHOUT, "the missing wait went unseen"),
        ("one-rank-unwinds", TP2_PATCHED, "unwound: {'0': 0, '1': 3}"),
        ("hang", PATCHED, "HANG: 3 request(s) timed out"),  # each missed request hangs
    ],
)
def test_a_broken_expectation_fails(
    tmp_path: Path, control_outputs: dict[str, list[int]], mode: str, spec: Any, verdict: str
) -> None:
    run, _ = _run(tmp_path, mode, spec, control_outputs, request_timeout_s=3)
    assert not run.ok and verdict in run.verdict, run


def test_outputs_are_compared_only_with_a_complete_control(
    tmp_path: Path, control_outputs: dict[str, list[int]]
) -> None:
    partial = dict(list(control_outputs.items())[:-1])  # a control run that lost a request
    for mode, spec in (("patched", PATCHED), ("skewed", WITHOUT)):
        run, _ = _run(tmp_path, mode, spec, partial)
        assert not run.ok and run.verdict == "no complete control run to compare the outputs with", run
        assert run.outputs_differing is None


def test_runs_that_compare_outputs_need_their_control(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        run_e2e.main(["--device", "cpu", "--out", str(tmp_path), "--runs", "patched,tp2-control,tp2-patched"])
        == 2
    )
    assert "patched needs control" in capsys.readouterr().err
    assert run_e2e.main(["--device", "cpu", "--out", str(tmp_path), "--runs", "no-such-run"]) == 2


def test_control_without_host_hits_fails(
    tmp_path: Path, small_traffic: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traffic, "ROUNDS", 1)  # one wave: nothing is ever loaded back
    control, _ = _run(tmp_path, "control", CONTROL)
    assert not control.ok and "host-cached tokens 0" in control.verdict


def test_pristine_that_survives_is_reported_as_fixed_upstream(tmp_path: Path, small_traffic: None) -> None:
    survivor, _ = _run(tmp_path, "survivor", PRISTINE)
    assert survivor.ok and not survivor.server_died
    assert survivor.verdict.startswith("UPSTREAM FIXED IT")


def test_server_that_never_gets_healthy(tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-c", "print('Out of memory at start-up'); raise SystemExit(3)"]
    run, _ = run_once("dense", PATCHED, command, tmp_path, dict(os.environ), [], {}, port, 10)
    assert not run.started and not run.ok and run.failed == traffic.GROUPS * traffic.ROUNDS


def test_a_server_whose_port_was_taken_is_not_waited_for(tmp_path: Path) -> None:
    # As uvicorn reports it, and then the server stays up without serving (seen: 12 minutes).
    taken = "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 1): in use"
    command = [sys.executable, "-c", f"print({taken!r}, flush=True); import time; time.sleep(60)"]
    started = time.monotonic()
    run, _ = run_once("dense", PATCHED, command, tmp_path, dict(os.environ), [], {}, free_port(), 30)
    assert run.port_taken and not run.started and time.monotonic() - started < 20
    assert run.verdict == "the server could not bind its HTTP port (taken since it was chosen)"


def test_a_run_whose_port_was_taken_starts_again_on_another_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ports: list[int] = []

    def run_once(model: str, spec: Any, command: list[str], *args: Any, **kwargs: Any) -> Any:
        ports.append(args[-1])
        run = Run(model, spec.name, spec.kind, started=len(ports) == 2, port_taken=len(ports) == 1)
        return run, []

    monkeypatch.setattr(runner, "run_once", run_once)
    model_plan = ModelPlan("dense", [], [PATCHED], [], sys.executable)
    (run,) = runner.run_plans([model_plan], {"dense": tmp_path}, tmp_path, {})
    assert run.started and len(ports) == 2 and ports[0] != ports[1]
    assert "was taken before the server bound it; again" in capsys.readouterr().out
    ports.clear()
    monkeypatch.setattr(runner, "PORT_ATTEMPTS", 1)
    (run,) = runner.run_plans([model_plan], {"dense": tmp_path}, tmp_path, {})
    assert run.port_taken and len(ports) == 1  # attempts are bounded


def test_a_natural_run_that_showed_no_miss_starts_again_a_bounded_number_of_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A natural run that served its traffic without the server's own miss showed nothing: it
    is started again, at most NATURAL_ATTEMPTS servers in all, and says on which attempt it
    showed the miss; a run that failed otherwise is not started again."""
    shown_on: list[int] = [2]
    attempts: list[Run] = []

    def run_once(model: str, spec: Any, command: list[str], *args: Any, **kwargs: Any) -> Any:
        shown = len(attempts) + 1 in shown_on
        run = Run(model, spec.name, spec.kind, started=True, ok=shown, natural_miss_absent=not shown)
        run.verdict = "every request finished" if shown else "no natural miss this time: pristine survived"
        attempts.append(run)
        return run, []

    monkeypatch.setattr(runner, "run_once", run_once)
    model_plan = ModelPlan("dense", [], [PRISTINE], [], sys.executable)
    (run,) = runner.run_plans([model_plan], {"dense": tmp_path}, tmp_path, {})
    assert run.ok and len(attempts) == 2
    assert run.verdict == "every request finished (on attempt 2: the earlier showed nothing)"
    assert "pristine survived (0 s); again (2 of 3)" in capsys.readouterr().out
    attempts.clear()
    shown_on.clear()
    (run,) = runner.run_plans([model_plan], {"dense": tmp_path}, tmp_path, {})
    assert not run.ok and len(attempts) == runner.NATURAL_ATTEMPTS  # bounded: the last verdict stands
    assert run.verdict == "no natural miss this time: pristine survived"


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    port = free_port()
    pid_file = tmp_path / "child.pid"
    command = [sys.executable, str(FAKE_SERVER), str(port), "control", "--child-pid-file", str(pid_file)]
    server = Server.start(command, dict(os.environ), tmp_path / "s.log", port)
    assert server.wait_healthy(30, poll_s=0.1)
    child = int(pid_file.read_text())
    server.stop(grace_s=5)
    assert not server.alive()
    assert gone(child), "the server's child outlived it"


_E2E_MAIN = """
from types import SimpleNamespace
import run_e2e
run_e2e.plan_cpu = lambda *args: SimpleNamespace(plans=[], env={{}}, report={{}})
run_e2e.run_plans = one_run_that_hangs
sys.exit(run_e2e.main(["--device", "cpu", "--out", {out!r}]))
"""


@INTERRUPTS
def test_an_interrupted_driver_kills_the_server_of_the_run_in_progress(
    tmp_path: Path, signum: int, code: int, name: str
) -> None:
    """SIGTERM (a cancelled CI job) or Ctrl-C while a run waits on a request its server never
    answers: the server and its child are killed and the driver exits at once, in one line. Without
    the handler SIGTERM leaves both running, and SIGINT waits for the request's timeout."""
    error_line = (
        f"e2e: error: stopped by {name}; its servers were killed, no report was written "
        f"(the runs' logs are in {tmp_path}): run it again"
    )
    assert_an_interrupt_kills_its_servers(
        _E2E_MAIN.format(out=str(tmp_path)), tmp_path, signum, code, error_line
    )


def test_hook_reaches_the_server_through_pythonpath(tmp_path: Path) -> None:
    """run_once puts the run's tree first and the hook last on the server's PYTHONPATH, so
    sitecustomize loads there."""
    port = free_port()
    probe = "import sitecustomize as s, sys; print('hook', s.INJECTOR is not None, s.__file__, sys.path[1])"
    command = [sys.executable, "-c", probe]
    spec = RunSpec("patched", "patched", site=tmp_path / "tree")
    run_once("dense", spec, command, tmp_path, dict(os.environ), [], {}, port, 3)
    logged = (tmp_path / "dense-patched.log").read_text()
    assert f"hook True {HOOK / 'sitecustomize.py'} {tmp_path / 'tree'}" in logged


# --------------------------------------------------------------------------------------------
# Models and flags against the real sglang tree
# --------------------------------------------------------------------------------------------
def test_dense_model_weights_are_seeded_and_complete(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    first = write_models(tmp_path / "a", ["dense"])["dense"]
    second = write_models(tmp_path / "b", ["dense"])["dense"]
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()
    tensors = load_file(str(first / "model.safetensors"))
    shapes = llama_weight_shapes(DENSE_LLAMA)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == shapes


def test_flags_and_configs_are_what_sglang_reads(tmp_path: Path) -> None:
    importlib.import_module("upstream.conftest")  # puts the sglang tree on sys.path
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers_utils import get_config

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    models = write_models(tmp_path, ["hybrid"])
    for name, (_, _, extra) in MODELS.items():
        args = parser.parse_args(server_command("python", tmp_path / name, 1, extra)[3:])
        assert args.enable_hierarchical_cache and args.hicache_write_policy == "write_through"
        assert args.skip_tokenizer_init and args.max_total_tokens == 1024
    cpu = [*CPU_FLAGS, "--tp-size", "2"]
    args = parser.parse_args(server_command("python", tmp_path / "dense", 1, cpu)[3:])
    assert (args.device, args.attention_backend, args.tp_size) == ("cpu", "torch_native", 2)
    config = get_config(str(models["hybrid"]), trust_remote_code=False)
    assert type(config).__name__ == "Qwen3_5TextConfig"
    assert config.full_attention_layer_ids == [3]  # hybrid: three Gated DeltaNet layers, one attention
    lfm2 = get_config(str(write_models(tmp_path, ["lfm2"])["lfm2"]), trust_remote_code=False)
    assert type(lfm2).__name__ == "Lfm2Config" and lfm2.layer_types == [
        "conv",
        "conv",
        "full_attention",
        "conv",
    ]
    args = parser.parse_args(server_command("python", tmp_path / "lfm2", 1, cpu, LFM2.flags)[3:])
    assert args.mamba_radix_cache_strategy == "no_buffer" and args.enable_hierarchical_cache
    recompute = LFM2.recompute_flags
    assert recompute is not None
    args = parser.parse_args(server_command("python", tmp_path / "lfm2", 1, cpu, recompute)[3:])
    assert args.disable_radix_cache and not args.enable_hierarchical_cache
    gdn = get_config(str(write_models(tmp_path, ["gdn"])["gdn"]), trust_remote_code=False)
    assert type(gdn).__name__ == "Qwen3_5TextConfig" and gdn.architectures == ["Qwen3_5ForCausalLM"]
    assert gdn.full_attention_layer_ids == [2] and gdn.linear_layer_ids == [0, 1, 3]
    # sglang takes the kinds from the interval; HF readers from layer_types: they agree
    hf_kinds = [kind.replace("full_attention", "attention") for kind in HYBRID_GDN["layer_types"]]
    assert gdn.layers_block_type == hf_kinds  # sglang spells full attention "attention"


# --------------------------------------------------------------------------------------------
# Natural runs: upstream's own miss, no hook
# --------------------------------------------------------------------------------------------
NATURAL_SPECS = {spec.name: spec for spec, _ in CPU_PLAN if spec.scenario is NATURAL}


@pytest.fixture
def small_natural_traffic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traffic, "NATURAL_SHORT_REQUESTS", 3)


def test_natural_runs_are_judged_on_the_servers_own_miss(tmp_path: Path, small_natural_traffic: None) -> None:
    assert set(NATURAL_SPECS) == {
        f"{ranks}natural-{kind}" for ranks in ("", "tp2-") for kind in ("control", "pristine", "patched")
    }
    assert all(spec.control_name.endswith("natural-control") for spec in NATURAL_SPECS.values())
    control, outcomes = _run(tmp_path, "control", NATURAL_SPECS["natural-control"])
    assert control.ok and control.finished == 4, control
    assert control.verdict == "all requests finished, no miss"
    reference = {o.key: o.output_ids for o in outcomes}
    assert set(reference) == {"long", "short.0", "short.1", "short.2"}

    pristine, _ = _run(tmp_path, "natural-pristine", NATURAL_SPECS["natural-pristine"], reference)
    assert pristine.ok and pristine.injected_misses == 0 and pristine.server_died, pristine
    assert "allocation.py" in pristine.died_with["0"]
    patched, _ = _run(tmp_path, "natural-patched", NATURAL_SPECS["natural-patched"], reference)
    assert patched.ok and patched.injected_misses == 0, patched
    assert patched.unwinds == {"0": 1} and patched.unwound_requests == {"long": 1}
    assert patched.outputs_differing == 0 and patched.differing_requests == {}

    two_ranks, _ = _run(tmp_path, "natural-pristine", NATURAL_SPECS["tp2-natural-pristine"], reference)
    assert two_ranks.ok and two_ranks.verdict.endswith("(as expected; rank 0, 1)"), two_ranks


def test_natural_verdicts_fail_without_a_miss_or_with_one_in_the_control(
    tmp_path: Path, small_natural_traffic: None
) -> None:
    reference = {o.key: o.output_ids for o in _run(tmp_path, "control", NATURAL_SPECS["natural-control"])[1]}
    survivor, _ = _run(tmp_path, "control", NATURAL_SPECS["natural-pristine"], reference)
    assert not survivor.ok and survivor.verdict == "no natural miss this time: pristine survived its traffic"
    never_unwound, _ = _run(tmp_path, "control", NATURAL_SPECS["natural-patched"], reference)
    assert not never_unwound.ok and never_unwound.verdict == "no natural miss this time: no rank unwound"
    assert survivor.natural_miss_absent and never_unwound.natural_miss_absent  # both started again
    control_missed, _ = _run(tmp_path, "natural-patched", NATURAL_SPECS["natural-control"])
    assert not control_missed.ok and control_missed.verdict.startswith("0 failed, unwinds {'0': 1}")


def test_a_run_names_each_request_whose_output_differs_with_its_unwinds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(traffic, "NATURAL_SHORT_REQUESTS", 1)
    run = Run("dense", "natural-patched", "patched", scenario="natural", started=True)
    run.unwinds, run.unwound_requests = {"0": 2}, {"long": 2}
    outcomes = [traffic.Outcome("long", True, [1, 2]), traffic.Outcome("short.0", True, [3])]
    judge(run, outcomes, {"long": [1, 9], "short.0": [3]}, NATURAL)
    assert not run.ok and run.outputs_differing == 1 and run.differing_requests == {"long": 2}
    assert "(1 differ, each with its unwinds: {'long': 2})" in run.verdict


@pytest.mark.parametrize(
    ("votes", "idle_all_reduces", "failure"),
    [
        ({"0": 9, "1": 9}, {"0": 0, "1": 0}, None),
        ({"0": 9, "1": 41}, {"0": 0, "1": 0}, "no decode step ran on the decode credit"),
        ({"0": 9, "1": 9}, {"0": 0, "1": 3}, "agreed in iterations that admitted nothing"),
    ],
)
def test_a_rank_local_control_shows_credited_steps_and_no_collective_where_nothing_was_admitted(
    votes: dict[str, int], idle_all_reduces: dict[str, int], failure: str | None
) -> None:
    """A rank-local control run (nothing injected, so the decode credit holds): each rank voted on
    fewer decode steps than it ran and made no all-reduce in an iteration that admitted nothing
    with nothing queued, and the verdict says how many of each; a rank that voted on every step,
    or agreed in such an iteration, fails the run."""
    run = Run(
        "dense", "tp2-natural-control", "control", tp=2, scenario="natural", started=True, rank_local=True
    )
    run.decode_steps, run.decode_votes = {"0": 40, "1": 40}, votes
    run.iterations, run.idle_round_all_reduces = {"0": 61, "1": 60}, idle_all_reduces
    judge(run, [traffic.Outcome("long", True, [1])], None, NATURAL)
    assert run.ok is (failure is None), run.verdict
    tail = (
        f"decode steps 0:40 1:40, decode votes 0:9 1:{votes['1']}; iterations 0:61 1:60,"
        " all-reduces in iterations that admitted nothing with nothing queued"
        f" 0:0 1:{idle_all_reduces['1']}"
    )
    assert run.verdict == f"{failure or 'all requests finished, no miss'}; {tail}"


NATURAL_HICACHE_SPECS = {spec.name: spec for spec, _ in CPU_PLAN if spec.scenario is NATURAL_HICACHE}


def test_the_natural_runs_with_hicache_have_the_host_tier_on_and_a_roomy_control() -> None:
    assert set(NATURAL_HICACHE_SPECS) == {
        f"natural-hicache-{kind}" for kind in ("control", "pristine", "patched")
    }
    for spec in NATURAL_HICACHE_SPECS.values():
        flags = spec.server_flags_of_scenario()
        assert flags[flags.index("--hicache-write-policy") + 1] == "write_through", spec.name
        assert "--enable-hierarchical-cache" in flags and spec.control_name == "natural-hicache-control"
    control = NATURAL_HICACHE_SPECS["natural-hicache-control"].server_flags_of_scenario()
    assert control[control.index("--max-total-tokens") + 1] == str(NATURAL_ROOMY_POOL_TOKENS)
    # the nightly's (`--runs all`), not ./scripts/test's
    assert not set(NATURAL_HICACHE_SPECS) & set(CPU_DEFAULT_RUNS)
    assert set(NATURAL_HICACHE_SPECS) <= set(chosen_runs("all", None))


def test_a_natural_hicache_run_whose_decode_retraction_aborted_a_request_fails(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The 500 that upstream's decode retraction gave a short request while the unwound chunk was
    parked (before series entry 0014) fails the run, though its outputs and unwinds are fine."""
    monkeypatch.setattr(traffic, "NATURAL_SHORT_REQUESTS", 1)
    run = Run("dense", "natural-hicache-patched", "patched", scenario="natural-hicache", started=True)
    run.unwinds, run.unwound_requests = {"0": 1}, {"long": 1}
    aborted = traffic.Outcome("short.0", False, error="HTTPError: HTTP Error 500: Internal Server Error")
    judge(
        run,
        [traffic.Outcome("long", True, [1, 2]), aborted],
        {"long": [1, 2], "short.0": [3]},
        NATURAL_HICACHE,
    )
    assert not run.ok and run.failed == 1 and run.verdict.startswith("1 failed"), run.verdict


NATURAL_PARKED_SPECS = {spec.name: spec for spec, _ in CPU_PLAN if spec.scenario is NATURAL_PARKED}


def test_the_parked_runs_size_their_traffic_to_park_a_chunk_behind_one_decoding_request() -> None:
    """The long prompt fits the pool alone (admitted, never refused) but not beside the short one,
    so a chunk of it misses and is parked; the short request then decodes more tokens than the
    pool has left. In ./scripts/test on two ranks, with a control on a pool that never misses (one
    rank's in the nightly)."""
    assert set(NATURAL_PARKED_SPECS) == {
        f"{ranks}natural-parked-{kind}"
        for ranks in ("", "tp2-")
        for kind in ("control", "pristine", "patched")
    }
    assert all(spec.rank_local for spec in NATURAL_PARKED_SPECS.values() if spec.tp == 2)
    assert {name for name in NATURAL_PARKED_SPECS if name.startswith("tp2-")} <= set(CPU_DEFAULT_RUNS)
    assert traffic.PARKED_LONG_TOKENS + traffic.MAX_NEW_TOKENS <= NATURAL_POOL_TOKENS
    assert traffic.PARKED_LONG_TOKENS + traffic.NATURAL_SHORT_TOKENS > NATURAL_POOL_TOKENS
    assert traffic.PARKED_SHORT_NEW_TOKENS > NATURAL_POOL_TOKENS - traffic.PARKED_LONG_TOKENS
    control = NATURAL_PARKED_SPECS["natural-parked-control"].server_flags_of_scenario()
    assert control[control.index("--max-total-tokens") + 1] == str(NATURAL_ROOMY_POOL_TOKENS)
    [[long, short]] = traffic.plan_parked_traffic()
    assert len(long.input_ids) == traffic.PARKED_LONG_TOKENS and long.max_new_tokens is None
    assert short.send_after_s > 0 and short.max_new_tokens == traffic.PARKED_SHORT_NEW_TOKENS


def test_a_request_is_sent_with_its_own_new_tokens(tmp_path: Path) -> None:
    control, outcomes = _run(tmp_path, "control", NATURAL_PARKED_SPECS["natural-parked-control"])
    assert control.ok, control
    lengths = {o.key: len(o.output_ids) for o in outcomes}
    assert lengths == {"long": traffic.MAX_NEW_TOKENS, "short": traffic.PARKED_SHORT_NEW_TOKENS}


def test_hook_counts_the_parked_chunks_a_decode_step_released(tmp_path: Path) -> None:
    class Scheduler:
        def _release_parked_chunk(self, parked: bool) -> bool:
            return parked

        def run_event_loop(self) -> None:
            pass

    injector = hook.Injector(limit=0, counters_dir=tmp_path)
    assert "_release_parked_chunk" in hook.wrap_scheduler(Scheduler, injector)
    scheduler = Scheduler()
    assert scheduler._release_parked_chunk(True) is True
    assert scheduler._release_parked_chunk(False) is False  # nothing parked: not counted
    assert injector.counts["parked_chunk_releases"] == 1


def test_a_parked_run_fails_unless_every_rank_released_the_parked_chunk() -> None:
    """Every request served and every rank unwound is not enough: a patched parked run that never
    released a parked chunk showed nothing of series entry 0015; one that did passes."""

    def patched(releases: dict[str, int]) -> Run:
        run = Run(
            "dense",
            "natural-parked-patched",
            "patched",
            tp=len(releases),
            scenario="natural-parked",
            started=True,
        )
        run.unwound_requests, run.parked_chunk_releases = {"long": 3}, releases
        run.unwinds = {rank: 3 for rank in releases}
        run.scraped = {
            "sglang:num_prefill_unwinds_total": run.unwinds,
            "sglang:num_parked_chunk_releases_total": releases,
        }
        outputs = {"long": [1, 2], "short": [3, 4]}
        judge(run, [traffic.Outcome(key, True, ids) for key, ids in outputs.items()], outputs, NATURAL_PARKED)
        return run

    never = patched({"0": 0})
    assert not never.ok and never.verdict.startswith("no parked chunk was released this time"), never.verdict
    assert never.natural_miss_absent  # started again (runner.NATURAL_ATTEMPTS)
    one_rank = patched({"0": 1, "1": 0})
    assert not one_rank.ok and not one_rank.natural_miss_absent  # the ranks parted: no chance to retry
    released = patched({"0": 1})
    assert released.ok and released.verdict.endswith(
        "parked chunks released {'0': 1};"
        " /metrics: num_prefill_unwinds_total 0:3, num_parked_chunk_releases_total 0:1"
    ), released.verdict


def test_a_line_without_the_natural_mechanism_runs_without_the_natural_runs() -> None:
    names = ["control", "natural-control", "tp2-natural-patched"]
    reason = "needs sglang 0.5.21 or newer (natural)"
    assert runs_not_on_line(names, "0.5.20") == {
        "natural-control": reason,
        "tp2-natural-patched": reason,
    }
    assert runs_not_on_line(names, "0.5.21") == {}


# --------------------------------------------------------------------------------------------
# The hybrid LFM2: its Mamba evidence
# --------------------------------------------------------------------------------------------
LFM2_SPECS = {spec.name: spec for spec, _ in CPU_PLAN if spec.scenario is LFM2}


def test_the_lfm2_runs_and_their_controls() -> None:
    assert set(LFM2_SPECS) == {
        *(f"lfm2-{kind}" for kind in ("control", "recompute", "pristine", "patched", "without-load-wait")),
        *(f"tp2-lfm2-{kind}" for kind in ("control", "pristine", "patched")),
    }
    assert {spec.control_name for spec in LFM2_SPECS.values()} == {"lfm2-control", "tp2-lfm2-control"}
    assert CPU_MODELS == ("dense", "lfm2", "gdn") and LFM2.model == "lfm2"
    # Every wave after the first extends the same group's prompt: a no_buffer tree's only hits.
    waves = traffic.plan_growing_traffic()
    for earlier, later in itertools.pairwise(waves):
        for before, after in zip(earlier, later, strict=True):
            assert after.input_ids[: len(before.input_ids)] == before.input_ids
            assert len(after.input_ids) == len(before.input_ids) + traffic.GROWTH_TOKENS


def test_lfm2_verdicts_need_mamba_loads_no_late_copy_and_the_recompute_reference(
    tmp_path: Path, small_traffic: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    control, outcomes = _run(tmp_path, "control", LFM2_SPECS["lfm2-control"])
    assert control.ok and control.mamba_loads > 0, control
    assert control.verdict == "all requests finished, host hits seen, Mamba states loaded"
    reference = {o.key: o.output_ids for o in outcomes}
    recompute, _ = _run(tmp_path, "control", LFM2_SPECS["lfm2-recompute"], reference)
    assert recompute.ok and recompute.injected_misses == 0, recompute
    patched, _ = _run(tmp_path, "patched", LFM2_SPECS["lfm2-patched"], reference)
    assert patched.ok and patched.mamba_late_copies == 0, patched
    without, _ = _run(tmp_path, "skewed", LFM2_SPECS["lfm2-without-load-wait"], reference)
    assert without.ok and without.verdict.endswith("; 0 Mamba copies landed after their slot's release")

    no_loads, _ = _run(tmp_path, "no-mamba-loads", LFM2_SPECS["lfm2-control"])
    assert not no_loads.ok and "Mamba loads 0" in no_loads.verdict, no_loads
    late, _ = _run(tmp_path, "late-copies", LFM2_SPECS["lfm2-patched"], reference)
    assert not late.ok and "Mamba copies landed after their slot's release: 9" in late.verdict, late
    differing, _ = _run(tmp_path, "skewed", LFM2_SPECS["lfm2-recompute"], reference)
    assert not differing.ok and differing.verdict.startswith(
        "0 failed, outputs equal control: False (6 differ)"
    )


# --------------------------------------------------------------------------------------------
# The gated-delta-net hybrid (Qwen3.5's text model): nightly, with LFM2's Mamba evidence
# --------------------------------------------------------------------------------------------
GDN_SPECS = {spec.name: spec for spec, _ in CPU_PLAN if spec.scenario is GDN}


def test_the_gdn_runs_compare_with_their_controls_and_run_in_the_nightly() -> None:
    assert set(GDN_SPECS) == {
        *(f"gdn-{kind}" for kind in ("control", "recompute", "pristine", "patched", "without-load-wait")),
        *(f"tp2-gdn-{kind}" for kind in ("control", "pristine", "patched")),
    }
    assert {spec.control_name for spec in GDN_SPECS.values()} == {"gdn-control", "tp2-gdn-control"}
    assert GDN.gdn_kernels and GDN.mamba_state
    assert set(GDN_SPECS) <= set(chosen_runs(ALL_RUNS, None))
    assert GDN.first_line == "0.5.20" and runs_not_on_line(list(GDN_SPECS), "0.5.20") == {}


def test_the_default_run_proves_each_kind_of_fix_once_within_ci_s_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """./scripts/test's runs: each compared run with its control, a pristine run beside every
    patched scenario, two ranks where the ranks must agree; few enough servers to fit CI."""
    specs = {spec.name: spec for spec, _ in CPU_PLAN}
    assert chosen_runs(None, None) == list(CPU_DEFAULT_RUNS)
    assert len(CPU_DEFAULT_RUNS) <= 20 < len(CPU_RUNS)
    for name in CPU_DEFAULT_RUNS:
        spec = specs[name]
        if spec.kind in COMPARING:
            assert spec.control_name in CPU_DEFAULT_RUNS, name
    patched_scenarios = {
        (specs[n].scenario.name, specs[n].tp) for n in CPU_DEFAULT_RUNS if specs[n].kind == "patched"
    }
    pristine_scenarios = {
        (specs[n].scenario.name, specs[n].tp, specs[n].miss_at)
        for n in CPU_DEFAULT_RUNS
        if specs[n].kind == "pristine"
    }
    assert {(name, tp) for name, tp, _ in pristine_scenarios} == patched_scenarios
    assert ("hicache", 2, "decode") in pristine_scenarios
    assert {("natural-parked", 2), ("lfm2-checkpoint", 2), ("lfm2", 1)} <= patched_scenarios
    # --runs all is every run; --models adds a model's runs to the default run's.
    assert chosen_runs(ALL_RUNS, None) == list(CPU_RUNS)
    assert chosen_runs("gdn-control,gdn-patched", None) == ["gdn-control", "gdn-patched"]
    assert not set(chosen_runs(None, None)) & set(GDN_SPECS)
    gdn_model_runs = {name for name, spec in specs.items() if spec.scenario.model == "gdn"}
    assert set(chosen_runs(None, "gdn")) == set(CPU_DEFAULT_RUNS) | gdn_model_runs


def test_gdn_verdicts_need_mamba_loads_no_late_copy_and_the_recompute_reference(
    tmp_path: Path, small_traffic: None
) -> None:
    control, outcomes = _run(tmp_path, "control", GDN_SPECS["gdn-control"])
    assert control.ok and control.mamba_loads > 0, control
    reference = {o.key: o.output_ids for o in outcomes}
    recompute, _ = _run(tmp_path, "control", GDN_SPECS["gdn-recompute"], reference)
    assert recompute.ok, recompute
    patched, _ = _run(tmp_path, "patched", GDN_SPECS["gdn-patched"], reference)
    assert patched.ok and patched.mamba_late_copies == 0, patched

    no_loads, _ = _run(tmp_path, "no-mamba-loads", GDN_SPECS["gdn-control"])
    assert not no_loads.ok and "Mamba loads 0" in no_loads.verdict, no_loads
    late, _ = _run(tmp_path, "late-copies", GDN_SPECS["gdn-patched"], reference)
    assert not late.ok and "Mamba copies landed after their slot's release: 9" in late.verdict, late
    differing, _ = _run(tmp_path, "skewed", GDN_SPECS["gdn-recompute"], reference)
    assert not differing.ok and differing.verdict.startswith(
        "0 failed, outputs equal control: False (6 differ)"
    )


@pytest.mark.parametrize("guaranteed", [True, False])
def test_a_rank_local_pool_says_what_cannot_miss_only_in_a_run_that_makes_no_miss(guaranteed: bool) -> None:
    """The carried scheduler skips the decode vote on steps the pool's `guaranteed_available_size`
    covers, so the hook gives that reading (the real free list) only where no allocation can miss:
    a step run without a vote that missed would stop one rank while its peer runs."""

    class Allocator:
        def available_size(self) -> int:
            return 7

    given = hook.give_uniform_readings([Allocator], guaranteed=guaranteed)
    assert ("Allocator.guaranteed_available_size" in given) is guaranteed
    assert hasattr(Allocator, "guaranteed_available_size") is guaranteed
    assert Allocator().uniform_available_size() == 7  # type: ignore[attr-defined]


@pytest.mark.parametrize("found", [True, False])
def test_the_checkers_negative_control_passes_only_where_the_checker_fired(found: bool) -> None:
    """tp2-uneven-pristine: the official wheel, its ranks' free space apart, nothing injected; it
    passes only where upstream's rank-consensus checker logged the divergence."""
    run = Run("dense", "tp2-uneven-pristine", "pristine", tp=2, started=True, checker_must_fire=True)
    run.rank_divergence_found, run.server_died = found, found
    judge(run, [traffic.Outcome("a", False, [])], None)
    assert run.ok is found, run.verdict
    assert ("found rank divergence (as expected" in run.verdict) is found


@pytest.mark.parametrize("died", [True, False])
def test_a_negative_control_whose_server_died_before_the_checker_spoke_is_started_again(died: bool) -> None:
    """The checker compares on a thread of its own: a busy machine can hold it back until the
    server has died of a miss of its drifting reading. That run showed nothing (started again,
    runner.NATURAL_ATTEMPTS); one that kept serving without the checker firing is a failure."""
    run = Run("dense", "tp2-uneven-pristine", "pristine", tp=2, started=True, checker_must_fire=True)
    run.server_died = died
    judge(run, [traffic.Outcome("a", False, [])], None)
    assert not run.ok and run.showed_nothing is died


@pytest.mark.parametrize("kind", ["control", "patched"])
def test_a_run_whose_ranks_the_checker_found_apart_fails(kind: str) -> None:
    """Every two-rank run has upstream's checker on: where it found a divergence, a control or
    patched run fails, whatever it served."""
    run = Run("dense", f"tp2-{kind}", kind, tp=2, started=True, rank_local=True)
    run.rank_divergence_found = True
    judge(run, [traffic.Outcome("a", True, [1])], {"a": [1]})
    assert not run.ok and "rank-consensus checker found rank divergence" in run.verdict


def test_every_two_rank_run_has_upstreams_checker_on() -> None:
    two = [spec for spec, _ in CPU_PLAN if spec.tp == 2]
    assert two and all(("SGLANG_ENABLE_RANK_CONSENSUS_CHECKER", "1") in spec.extra_env for spec in two)
    assert [spec.name for spec in two if spec.checker_must_fire] == ["tp2-uneven-pristine"]
