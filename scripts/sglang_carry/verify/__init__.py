"""Prove each patch: its tests fail on the tree without it and pass on the tree with it.

The package: plan.py (which ids on which commit, the split after a failure, the verdicts: no
I/O), executor.py (runs a plan, a few worktrees at a time), worktrees.py (the worktrees and their
bytecode and extension folders), pytest_run.py (one pytest process, its exact per-id outcomes).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..line_state import require_line_ready
from ..progress import SILENT, Reporter
from ..project import Project, Target
from ..runner import Runner, run_subprocess
from ..tables import text_table
from ..testenv import test_python
from ..trees import require_imported_trees_ready
from .executor import DEFAULT_PARALLEL, TreeTester
from .plan import ERROR, FAIL, NONE, PASS, TestOutcome, Verdict, combine, entry_sides, id_outcomes, selects
from .pytest_run import report_log_cases
from .worktrees import NATIVE_SUFFIXES

__all__ = [
    "DEFAULT_PARALLEL",
    "ERROR",
    "FAIL",
    "NATIVE_SUFFIXES",
    "NONE",
    "PASS",
    "TestOutcome",
    "TreeTester",
    "Verdict",
    "VerifyResult",
    "VerifyRow",
    "combine",
    "id_outcomes",
    "render_table",
    "report_log_cases",
    "selects",
    "verify",
    "verify_target",
]


def verify_target(
    project: Project, target: Target, python: str, runner: Runner, report: Reporter = SILENT
) -> list[Verdict]:
    series = project.series(target.release, runner)
    git = require_line_ready(project, target, series, runner, "carry verify")
    if series.carries_nothing is not None:
        report.step(f"verify: {target.label} carries nothing on purpose ({series.carries_nothing})")
        return []
    commits = git.commits(target.upstream_tag, target.branch)
    pristine = git.rev(target.upstream_tag)
    assert pristine is not None and len(commits) == len(series.entries)
    tester = TreeTester(project, target, git, python, runner, report=report)
    tester.names = {pristine: "pristine"} | {
        commit: f"patches 1-{index + 1}" for index, commit in enumerate(commits)
    }
    sides = entry_sides(series.entries, commits, pristine)
    for side in sides:
        if side.entry.tests:
            tester.want(side.before, side.entry.tests)
            tester.want(side.after, side.entry.tests)
    verdicts = []
    try:
        tester.run_wanted()
        for side in sides:
            tests = side.entry.tests
            if not tests:
                verdicts.append(Verdict(side.entry, NONE, NONE))
                continue
            verdicts.append(
                Verdict(side.entry, tester.outcome(side.before, tests), tester.outcome(side.after, tests))
            )
    finally:
        tester.close()
    return verdicts


def render_table(rows: list[tuple[str, Verdict]]) -> str:
    header = ("line", "patch", "without", "with", "verdict")
    return text_table(
        header, [(label, v.entry.filename, v.without, v.with_patch, v.label) for label, v in rows]
    )


@dataclass(frozen=True)
class VerifyRow:
    line: str
    verdict: Verdict


@dataclass(frozen=True)
class VerifyResult:
    rows: tuple[VerifyRow, ...]

    @property
    def wrong(self) -> tuple[VerifyRow, ...]:
        return tuple(row for row in self.rows if not row.verdict.ok)

    @property
    def exit_code(self) -> int:
        return 1 if self.wrong else 0

    def problem(self) -> str | None:
        """The one error line when an entry is not proven."""
        if not self.wrong:
            return None
        return f"{len(self.wrong)} of {len(self.rows)} series entries are not proven: see the table above"


def verify(
    project: Project,
    targets: list[Target],
    python: str | None,
    runner: Runner = run_subprocess,
    report: Reporter = SILENT,
) -> VerifyResult:
    """``python`` overrides each line's own test environment (see testenv.py)."""
    rows: list[VerifyRow] = []
    for target in targets:
        # A line with nothing to verify says so before its test environment is asked for.
        project.series(target.release, runner).require_something_to_carry()
        require_imported_trees_ready(project, target, "carry verify", runner)
        interpreter = python or test_python(project, target.release)
        verdicts = verify_target(project, target, interpreter, runner, report)
        rows.extend(VerifyRow(target.label, verdict) for verdict in verdicts)
    return VerifyResult(tuple(rows))
