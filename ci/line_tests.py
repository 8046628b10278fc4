"""Run the upstream tests (tests/upstream) once for each line CI runs on this schedule.

    .venv-test/bin/python ci/line_tests.py [--schedule every|nightly] [--list] [PYTEST OPTION ...]

Each run is one pytest process in that line's test environment (built here if needed), with
CARRY_TREE_<NAME> at a worktree of each line's carry/<version> branch under build/line-tests/; see
sglang_carry/testenv.py for which lines run when. Stops at the first run that fails, so the
output ends with that run's pytest summary. ./scripts/test runs the `every` schedule. Laying a line
down switches its checkout to carry/<version>; each checkout is put back on the branch it was found
on when the runs end (sglang_carry/trees.py), so the tests after these import the line they meant.
"""

# ruff: noqa: E402  (the tool is imported from this checkout, after sys.path names it)
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # this checkout's tool, whichever venv runs the script

from sglang_carry.errors import CarryError
from sglang_carry.fetch import fetch
from sglang_carry.git import Git
from sglang_carry.patching import apply
from sglang_carry.project import Project
from sglang_carry.testenv import EVERY, NIGHTLY, CiRun, ci_runs
from sglang_carry.trees import found_branch_restored, tree_env_var


def run_one(project: Project, run: CiRun, pytest_options: list[str]) -> int:
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_env.py"), run.env.name], check=False)
    if built.returncode != 0:
        # test_env.py has printed its one line (what failed, what to do); a traceback here would bury it.
        print(
            f"line-tests: {run.label}: not run, its test environment {run.env.name} is not built",
            file=sys.stderr,
        )
        return built.returncode
    env: dict[str, str] = {}
    worktrees: list[tuple[Git, Path]] = []
    try:
        for line in run.lines:
            fetch(project, [line])
            apply(project, line)
            git = Git(project.checkout(line.name))
            folder = project.scratch_dir / "line-tests" / f"{line.name}-{line.version}"
            worktrees.append((git, git.fresh_worktree(folder, line.branch)))
            subdir = line.upstream.source_subdir
            env[tree_env_var(line.name)] = str(folder / subdir if subdir else folder)
        print(f"line-tests: {run.label} in {run.env.name} ({run.env.venv.name})", flush=True)
        started = time.monotonic()
        code = subprocess.run(
            [str(run.env.python), "-m", "pytest", *pytest_options, "tests/upstream"],
            cwd=project.root,
            env={**os.environ, **env},
            check=False,
        ).returncode
        print(f"line-tests: {run.label}: exit {code} in {time.monotonic() - started:.0f} s", flush=True)
        return code
    finally:
        for git, folder in worktrees:
            git.run("worktree", "remove", "--force", str(folder), check=False)
            git.run("worktree", "prune", check=False)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", choices=(EVERY, NIGHTLY), default=EVERY)
    parser.add_argument("--list", action="store_true", help="print the runs and their environments only")
    args, pytest_options = parser.parse_known_args()
    project = Project(ROOT)
    try:
        runs = ci_runs(project, args.schedule)
        if args.list:
            for run in runs:
                print(f"{run.label}\t{run.env.name}\t{run.env.venv.relative_to(ROOT)}")
            return 0
        with found_branch_restored(project, sorted(project.pins())) as not_restored:
            code = 0
            for run in runs:
                code = run_one(project, run, pytest_options)
                if code != 0:
                    break
        for problem in not_restored:
            print(f"line-tests: error: {problem}", file=sys.stderr)
        return code or (1 if not_restored else 0)
    except CarryError as exc:
        print(f"line-tests: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
