"""Runs a verify plan: each commit's run in a free worktree, a few at a time
(concurrent.futures), a run that did not get through split as the plan says, and every outcome
kept so that no (commit, id) runs twice."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

from ..git import Git
from ..progress import SILENT, Reporter
from ..project import Project, Target
from ..runner import Runner
from .plan import ERROR, FAIL, PASS, Plan, TestOutcome, TreeRun, combine
from .pytest_run import run_pytest
from .worktrees import Slot, WorktreePool

# Trees tested side by side: the tests wait on threads and timeouts much of the time, so two
# pytest processes finish sooner than one after the other even on two cores.
DEFAULT_PARALLEL = 2


class TreeTester:
    """Test ids against commits of one checkout; see plan.py for what runs, worktrees.py for
    where."""

    def __init__(
        self,
        project: Project,
        target: Target,
        git: Git,
        python: str,
        runner: Runner,
        parallel: int = DEFAULT_PARALLEL,
        report: Reporter = SILENT,
    ) -> None:
        self.project = project
        self.target = target
        self.python = python
        self.runner = runner
        self.parallel = max(1, parallel)
        self.report = report
        self.pool = WorktreePool(project, target, git, runner)
        self.plan = Plan()
        self.results: dict[tuple[str, str], TestOutcome] = {}
        self.tree_seconds: dict[str, float] = {}
        # What each commit is, for the progress lines (e.g. "pristine", "patches 1-3").
        self.names: dict[str, str] = {}
        self._finished = 0
        self._lock = threading.Lock()

    @property
    def slots(self) -> list[Slot]:
        return self.pool.slots

    def want(self, commit: str, tests: Sequence[str]) -> None:
        """Register ids to run on ``commit`` at its next run (a group keeps its ids together if
        the run has to be split)."""
        self.plan.want(commit, tests, done=self.results)

    def run_wanted(self) -> None:
        """Run every commit that has ids waiting, ``parallel`` at a time."""
        runs = self.plan.take()
        if not runs:
            return
        total = len(runs)
        self._finished = 0
        at_once = min(self.parallel, total)
        self.report.step(f"verify: {self.target.label}: {total} tree(s), {at_once} at a time")
        free: queue.SimpleQueue[Slot] = queue.SimpleQueue()
        for slot in self.pool.grow(at_once):
            free.put(slot)

        def in_a_free_slot(run: TreeRun) -> None:
            slot = free.get()
            try:
                self._run(slot, run, total)
            finally:
                free.put(slot)

        with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="verify") as executor:
            futures = [executor.submit(in_a_free_slot, run) for run in runs]
            _, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for future in pending:
                future.cancel()
        for future in futures:
            failure = None if future.cancelled() else future.exception()
            if failure is not None:
                raise failure

    def outcomes(self, commit: str, tests: Sequence[str]) -> dict[str, TestOutcome]:
        """pass/fail/error for each id on ``commit``, running it (with whatever else is wanted
        there) unless it already ran."""
        self.want(commit, tests)
        if any((commit, test) not in self.results for test in tests):
            self.run_wanted()
        return {test: self.results[(commit, test)] for test in tests}

    def outcome(self, commit: str, tests: Sequence[str]) -> TestOutcome:
        """pass if every id passed on ``commit``, fail if one failed, error if one did not run."""
        return combine(self.outcomes(commit, tests).values())

    def _run(self, slot: Slot, run: TreeRun, total: int) -> None:
        started = time.monotonic()
        tests = run.tests
        env = self.pool.environment(slot, run.commit)
        whole = self._pytest(run.commit, tests, env, "all", whole=len(tests) == 1)
        parts = run.parts_after_failure() if whole is None else []
        if parts:
            self.report.step(f"verify: {run.commit[:12]}: running each of {len(parts)} parts on its own")
            for index, part in enumerate(parts):
                one = self._pytest(run.commit, part, env, f"part-{index}", whole=True)
                self._record(run.commit, one if one is not None else dict.fromkeys(part, ERROR))
        else:
            self._record(run.commit, whole if whole is not None else dict.fromkeys(tests, ERROR))
        seconds = time.monotonic() - started
        with self._lock:
            self.tree_seconds[run.commit] = seconds
            self._finished += 1
            counts = ", ".join(
                f"{sum(self.results[(run.commit, t)] == kind for t in tests)} {kind}"
                for kind in (PASS, FAIL, ERROR)
            )
            name = f" ({self.names[run.commit]})" if run.commit in self.names else ""
            self.report.step(
                f"verify: {self.target.label}: tree {self._finished}/{total} {run.commit[:12]}{name} "
                f"(slot {slot.number}): {len(tests)} id(s): {counts} in {seconds:.0f} s"
            )

    def _record(self, commit: str, outcomes: dict[str, TestOutcome]) -> None:
        with self._lock:
            for test, result in outcomes.items():
                self.results[(commit, test)] = result

    def _pytest(
        self, commit: str, tests: list[str], env: dict[str, str], label: str, whole: bool
    ) -> dict[str, TestOutcome] | None:
        """Per-id outcomes of one pytest run, or None (reported) when pytest did not get through."""
        report = self.pool.base / f"{commit[:12]}-{label}.jsonl"
        done = run_pytest(self.runner, self.python, self.project.root, tests, env, report, whole)
        if done.outcomes is None:
            self.report.warn(f"verify: error at {commit[:12]}: {done.problem}")
        return done.outcomes

    def close(self) -> None:
        self.pool.close()
