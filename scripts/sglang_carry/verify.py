"""Prove each patch: its tests fail on the tree without it and pass on the tree with it."""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .errors import CarryError
from .git import Git
from .patching import require_line_ready
from .project import Project, Target
from .runner import Runner, run_subprocess
from .series import Entry

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


class TreeTester:
    """Runs test ids against commits of one checkout, each in a detached worktree.

    Every run has a folder of its own under build/verify/, and every tree in it its own torch
    JIT-extension folder: two verify runs (or a verify beside `./scripts/test`) never share a
    tree or a compiled extension, so none rebuilds or deletes what another is using.
    """

    def __init__(self, project: Project, target: Target, git: Git, python: str, runner: Runner) -> None:
        self.project = project
        self.target = target
        self.git = git
        self.python = python
        self.runner = runner
        parent = project.scratch_dir / "verify" / target.name
        parent.mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(dir=parent, prefix="run-"))
        self.trees: dict[str, Path] = {}

    def tree(self, commit: str) -> Path:
        if commit not in self.trees:
            self.trees[commit] = self.git.fresh_worktree(self.base / commit[:12], commit)
        return self.trees[commit]

    def environment(self, commit: str) -> dict[str, str]:
        subdir = self.target.upstream.source_subdir
        tree = self.tree(commit)
        return {
            tree_env_var(self.target.name): str(tree / subdir if subdir else tree),
            "TORCH_EXTENSIONS_DIR": str(self.base / "torch_extensions" / commit[:12]),
        }

    def outcome(self, commit: str, tests: list[str]) -> str:
        env = self.environment(commit)
        result = self.runner(
            [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
            cwd=self.project.root,
            env=env,
        )
        if result.returncode == 0:
            return PASS
        if result.returncode == 1:
            return FAIL
        tail = "\n".join(result.output.splitlines()[-5:])
        print(f"verify: pytest exited {result.returncode} at {commit[:12]}:\n{tail}", file=sys.stderr)
        return ERROR

    def close(self) -> None:
        for path in self.trees.values():
            self.git.run("worktree", "remove", "--force", str(path), check=False)
        self.git.run("worktree", "prune", check=False)
        shutil.rmtree(self.base, ignore_errors=True)


def verify_target(project: Project, target: Target, python: str, runner: Runner) -> list[Verdict]:
    series = project.series(target.release, runner)
    git = require_line_ready(project, target, series, runner, "carry verify")
    if series.carries_nothing is not None:
        print(f"verify: {target.label} carries nothing on purpose ({series.carries_nothing})")
        return []
    commits = git.commits(target.upstream_tag, target.branch)
    pristine = git.rev(target.upstream_tag)
    assert pristine is not None and len(commits) == len(series.entries)
    tester = TreeTester(project, target, git, python, runner)
    verdicts = []
    try:
        for index, entry in enumerate(series.entries):
            if not entry.tests:
                verdicts.append(Verdict(entry, NONE, NONE))
                continue
            if entry.applied_upstream:
                before, after = pristine, commits[-1]
            else:
                before, after = (commits[index - 1] if index else pristine), commits[index]
            print(f"verify: {target.label}: {entry.filename} ...", flush=True)
            without = tester.outcome(before, entry.tests)
            with_patch = tester.outcome(after, entry.tests)
            verdicts.append(Verdict(entry, without, with_patch))
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


def verify(
    project: Project, targets: list[Target], python: str | None, runner: Runner = run_subprocess
) -> int:
    interpreter = python or default_test_python(project)
    rows: list[tuple[str, Verdict]] = []
    for target in targets:
        rows.extend(
            (target.label, verdict) for verdict in verify_target(project, target, interpreter, runner)
        )
    if not rows:
        print("verify: every line carries nothing on purpose; nothing to verify")
        return 0
    print(render_table(rows))
    wrong = [verdict for _, verdict in rows if not verdict.ok]
    if wrong:
        raise CarryError(f"{len(wrong)} of {len(rows)} series entries are not proven: see the table above")
    print(f"verify: all {len(rows)} series entries proven")
    return 0


def default_test_python(project: Project) -> str:
    candidate = project.root / ".venv-test" / "bin" / "python"
    return str(candidate) if candidate.exists() else sys.executable
