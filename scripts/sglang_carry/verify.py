"""Prove each patch: its tests fail on the tree without it and pass on the tree with it."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree

from .git import Git
from .patching import require_line_ready
from .progress import SILENT, Reporter
from .project import Project, Target
from .runner import Runner, run_subprocess
from .series import Entry
from .testenv import test_python

PASS, FAIL, ERROR, NONE = "pass", "fail", "error", "-"


def tree_env_var(name: str) -> str:
    """Tests find the upstream tree to import through this variable (see tests/conftest.py)."""
    return f"CARRY_TREE_{name.upper()}"


@dataclass(frozen=True)
class Verdict:
    entry: Entry
    without: str
    with_patch: str

    @property
    def expected_without(self) -> str:
        return PASS if self.entry.applied_upstream else FAIL

    @property
    def ok(self) -> bool:
        return bool(self.entry.tests) and (self.without, self.with_patch) == (
            self.expected_without,
            PASS,
        )

    @property
    def label(self) -> str:
        if not self.entry.tests:
            return "WRONG (no Test: trailer)"
        return "ok" if self.ok else f"WRONG (expected {self.expected_without} -> pass)"


# A tree's torch JIT extensions are rebuilt whenever a file with one of these suffixes differs.
NATIVE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")
# Trees tested side by side: the tests wait on threads and timeouts much of the time, so two
# pytest processes finish sooner than one after the other even on two cores.
DEFAULT_PARALLEL = 2


def combine(outcomes: Iterable[str]) -> str:
    """An entry's outcome on one tree: error if any id errored, else fail if any failed."""
    found = set(outcomes)
    if not found or ERROR in found:
        return ERROR
    return FAIL if FAIL in found else PASS


def junit_cases(path: Path) -> dict[str, str]:
    """pytest node id -> pass/fail for every test case of a ``junit_family=xunit1`` report.

    A skipped case counts as passed, as it does for pytest's exit code; an error in a fixture
    counts as failed, as it does there too. Raises ValueError when the report is unreadable.
    """
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError) as exc:
        raise ValueError(f"no readable test report at {path} ({exc})") from exc
    cases = {}
    for case in root.iter("testcase"):
        file, classname, name = case.get("file"), case.get("classname", ""), case.get("name", "")
        if not file:
            continue  # a collection error: pytest's exit code reports it
        module = file.removesuffix(".py").replace("/", ".")
        classes = classname[len(module) + 1 :].split(".") if classname.startswith(module + ".") else []
        nodeid = "::".join([file, *classes, name])
        failed = case.find("failure") is not None or case.find("error") is not None
        cases[nodeid] = FAIL if failed else PASS
    return cases


def selects(test_id: str, nodeid: str) -> bool:
    """Whether pytest, given ``test_id`` (a folder, a file, a class or a test), runs ``nodeid``."""
    test_id = test_id.rstrip("/")
    return nodeid == test_id or nodeid.startswith((test_id + "::", test_id + "[", test_id + "/"))


def id_outcomes(tests: Iterable[str], cases: dict[str, str]) -> dict[str, str]:
    """Each id's outcome from a report's cases: error when pytest ran nothing of it."""
    result = {}
    for test_id in tests:
        matched = [outcome for nodeid, outcome in cases.items() if selects(test_id, nodeid)]
        result[test_id] = combine(matched) if matched else ERROR
    return result


@dataclass
class _Slot:
    """One worktree, checked out at one commit after another."""

    number: int
    path: Path
    commit: str | None = None


class TreeTester:
    """Runs test ids against commits of one checkout: each commit once, with every id wanted there.

    Ids are registered with `want` (or passed to `outcomes`), and each commit then gets one pytest
    process for all of them; per-id outcomes come from pytest's JUnit XML report. The commits run
    in a few worktrees ("slots"), each checked out at one commit after another, so a commit shares
    with the previous one of its slot the bytecode and the compiled torch extension of every file
    that did not change between them; the bytecode of each changed file is deleted at checkout, and
    each slot compiles extensions into one folder per content of the tree's native sources.

    Every run has a folder of its own under build/verify/: two verify runs (or a verify beside
    `./scripts/test`) never share a tree or a compiled extension, so none rebuilds or deletes what
    another is using.
    """

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
        self.git = git
        self.python = python
        self.runner = runner
        self.parallel = max(1, parallel)
        self.report = report
        parent = project.scratch_dir / "verify" / target.name
        parent.mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(dir=parent, prefix="run-"))
        self.slots: list[_Slot] = []
        self.wanted: dict[str, list[list[str]]] = {}
        self.results: dict[tuple[str, str], str] = {}
        self.tree_seconds: dict[str, float] = {}
        # What each commit is, for the progress lines (e.g. "pristine", "patches 1-3").
        self.names: dict[str, str] = {}
        self._finished = 0
        self._lock = threading.Lock()

    def want(self, commit: str, tests: Sequence[str]) -> None:
        """Register ids to run on ``commit`` at its next run (a group keeps its ids together if
        the run has to be split, see `_run_commit`)."""
        pending = [test for test in tests if (commit, test) not in self.results]
        if pending:
            self.wanted.setdefault(commit, []).append(pending)

    def run_wanted(self) -> None:
        """Run every commit that has ids waiting, ``parallel`` at a time."""
        queue = list(self.wanted.items())
        self.wanted = {}
        if not queue:
            return
        total = len(queue)
        self._finished = 0
        self.report.step(
            f"verify: {self.target.label}: {total} tree(s), {min(self.parallel, total)} at a time"
        )
        while len(self.slots) < min(self.parallel, total):
            number = len(self.slots)
            self.slots.append(_Slot(number, self.base / f"slot-{number}"))
        failures: list[BaseException] = []

        def work(slot: _Slot) -> None:
            while True:
                with self._lock:
                    if not queue or failures:
                        return
                    commit, groups = queue.pop(0)
                try:
                    self._run_commit(slot, commit, groups, total)
                except BaseException as exc:
                    with self._lock:
                        failures.append(exc)
                    return

        threads = [
            threading.Thread(target=work, args=(slot,)) for slot in self.slots[: min(self.parallel, total)]
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]

    def outcomes(self, commit: str, tests: Sequence[str]) -> dict[str, str]:
        """pass/fail/error for each id on ``commit``, running it (with whatever else is wanted
        there) unless it already ran."""
        self.want(commit, tests)
        if any((commit, test) not in self.results for test in tests):
            self.run_wanted()
        return {test: self.results[(commit, test)] for test in tests}

    def outcome(self, commit: str, tests: Sequence[str]) -> str:
        """pass if every id passed on ``commit``, fail if one failed, error if one did not run."""
        return combine(self.outcomes(commit, tests).values())

    def tree(self, slot: _Slot, commit: str) -> Path:
        """``slot``'s worktree at ``commit``, with no bytecode left of a file that changed."""
        if slot.commit is None:
            with self._lock:  # `git worktree add` writes the shared repository's admin files
                self.git.fresh_worktree(slot.path, commit)
        elif slot.commit != commit:
            tree_git = Git(slot.path, self.runner)
            changed = tree_git.changed_paths(slot.commit, commit)
            tree_git.run("checkout", "--quiet", "--force", "--detach", commit)
            for _, path in changed:
                if path.endswith(".py"):
                    source = slot.path / path
                    for stale in source.parent.glob(f"__pycache__/{source.stem}.*.pyc"):
                        stale.unlink(missing_ok=True)
        slot.commit = commit
        return slot.path

    def native_sources_key(self, commit: str) -> str:
        """A digest of the tree's native sources (paths and blob ids, straight from git)."""
        listing = self.git.out("ls-tree", "-r", "--full-tree", commit)
        digest = hashlib.sha256()
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            if path.endswith(NATIVE_SUFFIXES):
                digest.update(f"{path}\0{meta.split()[2]}\n".encode())
        return digest.hexdigest()[:16]

    def environment(self, slot: _Slot, commit: str) -> dict[str, str]:
        subdir = self.target.upstream.source_subdir
        tree = self.tree(slot, commit)
        extensions = self.base / "torch_extensions" / f"slot-{slot.number}" / self.native_sources_key(commit)
        return {
            tree_env_var(self.target.name): str(tree / subdir if subdir else tree),
            # torch's JIT build decides what to rebuild from file times and the build command,
            # and the command names the tree's path: a folder is only ever used by one slot (one
            # path) and one content of the native sources, so no stale build can be loaded.
            "TORCH_EXTENSIONS_DIR": str(extensions),
            # The trees are this run's scratch: their bytecode is what makes the next commit in
            # the slot cheap to import (stale bytecode is deleted at checkout, see `tree`).
            "PYTHONDONTWRITEBYTECODE": "",
        }

    def _run_commit(self, slot: _Slot, commit: str, groups: list[list[str]], total: int) -> None:
        started = time.monotonic()
        tests = list(dict.fromkeys(test for group in groups for test in group))
        env = self.environment(slot, commit)
        done = self._pytest(commit, tests, env, "all", whole=len(tests) == 1)
        if done is None and (len(groups) > 1 or len(tests) > 1):
            # Split where the failure can hide: by group (an entry's ids) when there are several,
            # else by id, so one bad id or one failing test spoils only its own part.
            parts = groups if len(groups) > 1 else [[test] for test in tests]
            self.report.step(f"verify: {commit[:12]}: running each of {len(parts)} parts on its own")
            for index, part in enumerate(parts):
                one = self._pytest(commit, part, env, f"part-{index}", whole=True)
                self._record(commit, one if one is not None else dict.fromkeys(part, ERROR))
        else:
            self._record(commit, done if done is not None else dict.fromkeys(tests, ERROR))
        seconds = time.monotonic() - started
        with self._lock:
            self.tree_seconds[commit] = seconds
            self._finished += 1
            counts = ", ".join(
                f"{sum(self.results[(commit, t)] == kind for t in tests)} {kind}"
                for kind in (PASS, FAIL, ERROR)
            )
            self.report.step(
                f"verify: {self.target.label}: tree {self._finished}/{total} {commit[:12]}"
                f"{' (' + self.names[commit] + ')' if commit in self.names else ''} "
                f"(slot {slot.number}): {len(tests)} id(s): {counts} in {seconds:.0f} s"
            )

    def _record(self, commit: str, outcomes: dict[str, str]) -> None:
        with self._lock:
            for test, result in outcomes.items():
                self.results[(commit, test)] = result

    def _pytest(
        self, commit: str, tests: list[str], env: dict[str, str], label: str, whole: bool
    ) -> dict[str, str] | None:
        """Per-id outcomes of one pytest run, or None (said on stderr) when pytest did not get
        through its tests: it crashed, was interrupted or could not collect an id.

        Without a readable report (a stand-in for pytest that writes none) the exit code still
        speaks for every id when it is 0, and for a ``whole`` part when it is 1; otherwise None.
        """
        report = self.base / f"{commit[:12]}-{label}.xml"
        # The report options come before the ids, so the command still ends `-p no:cacheprovider IDS`.
        result = self.runner(
            [
                self.python, "-m", "pytest", "-o", "junit_family=xunit1", f"--junitxml={report}",
                "-q", "-p", "no:cacheprovider", *tests,
            ],
            cwd=self.project.root,
            env=env,
        )  # fmt: skip
        problem = f"pytest exited {result.returncode}"
        if result.returncode in (0, 1):
            try:
                return id_outcomes(tests, junit_cases(report))
            except ValueError as exc:
                if result.returncode == 0:
                    return dict.fromkeys(tests, PASS)
                if whole:
                    return dict.fromkeys(tests, FAIL)
                problem = f"pytest exited 1 and {exc}"
        tail = "\n".join(result.output.splitlines()[-5:])
        self.report.warn(f"verify: error at {commit[:12]}: {problem}; its last lines:\n{tail}")
        return None

    def close(self) -> None:
        for slot in self.slots:
            self.git.run("worktree", "remove", "--force", str(slot.path), check=False)
        self.git.run("worktree", "prune", check=False)
        shutil.rmtree(self.base, ignore_errors=True)


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
    sides: list[tuple[Entry, str, str]] = []
    for index, entry in enumerate(series.entries):
        if entry.applied_upstream:
            before, after = pristine, commits[-1]
        else:
            before, after = (commits[index - 1] if index else pristine), commits[index]
        sides.append((entry, before, after))
        if entry.tests:
            tester.want(before, entry.tests)
            tester.want(after, entry.tests)
    verdicts = []
    try:
        tester.run_wanted()
        for entry, before, after in sides:
            if not entry.tests:
                verdicts.append(Verdict(entry, NONE, NONE))
                continue
            verdicts.append(
                Verdict(entry, tester.outcome(before, entry.tests), tester.outcome(after, entry.tests))
            )
    finally:
        tester.close()
    return verdicts


def render_table(rows: list[tuple[str, Verdict]]) -> str:
    header = ("line", "patch", "without", "with", "verdict")
    cells = [header] + [(label, v.entry.filename, v.without, v.with_patch, v.label) for label, v in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


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
        interpreter = python or test_python(project, target.release)
        verdicts = verify_target(project, target, interpreter, runner, report)
        rows.extend(VerifyRow(target.label, verdict) for verdict in verdicts)
    return VerifyResult(tuple(rows))
