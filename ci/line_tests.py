"""Run the upstream tests (tests/upstream) once for each line CI runs on this schedule.

    .venv-test/bin/python ci/line_tests.py [--schedule every|nightly] [--list] [PYTEST OPTION ...]

Each run is one pytest process in that line's test environment (built here if needed), with
CARRY_TREE_<NAME> at a worktree of each line's carry/<version> branch under build/line-tests/; see
sglang_carry/testenv.py for which lines run when. Every environment is built and every tree laid
down first (a run whose environment cannot be built stops it there, before any test); then the
runs go two at a time, each one's output in build/line-tests/<run>.log, printed when it ends (a
failed run's last, so the output ends with that run's pytest summary). ./scripts/test runs the
`every` schedule. Laying a line down switches its checkout to carry/<version>; each checkout is put
back on the branch it was found on when the runs end (sglang_carry/trees.py), so the tests after
these import the line they meant.
"""

# ruff: noqa: E402  (the tool is imported from this checkout, after sys.path names it)
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
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

# Runs at once: each is a pytest process whose forked ranks mostly take turns, so two of them keep
# this machine's two cores busy (measured: the two lines of every CI run in 5.4 min together, 8 one
# after the other).
JOBS = 2


@dataclass(frozen=True)
class LaidDown:
    run: CiRun
    env: dict[str, str]  # CARRY_TREE_<NAME> of each line's worktree
    log: Path


@dataclass(frozen=True)
class Finished:
    laid_down: LaidDown
    code: int
    seconds: float


def environment_built(run: CiRun) -> bool:
    built = subprocess.run([sys.executable, str(ROOT / "scripts" / "test_env.py"), run.env.name], check=False)
    if built.returncode != 0:
        # test_env.py has printed its one line (what failed, what to do); a traceback here would bury it.
        print(
            f"line-tests: {run.label}: not run, its test environment {run.env.name} is not built",
            file=sys.stderr,
        )
    return built.returncode == 0


def lay_down(project: Project, run: CiRun, worktrees: list[tuple[Git, Path]]) -> LaidDown:
    """A worktree of each of the run's lines (noted in `worktrees`, for their removal)."""
    env: dict[str, str] = {}
    for line in run.lines:
        fetch(project, [line])
        apply(project, line)
        git = Git(project.checkout(line.name))
        folder = project.scratch_dir / "line-tests" / f"{line.name}-{line.version}"
        worktrees.append((git, git.fresh_worktree(folder, line.branch)))
        subdir = line.upstream.source_subdir
        env[tree_env_var(line.name)] = str(folder / subdir if subdir else folder)
    log = (
        project.scratch_dir
        / "line-tests"
        / f"{run.env.name}-{'-'.join(line.version for line in run.lines)}.log"
    )
    return LaidDown(run, env, log)


def run_pytest(project: Project, laid: LaidDown, pytest_options: list[str]) -> Finished:
    started = time.monotonic()
    with laid.log.open("w") as log:
        code = subprocess.run(
            [str(laid.run.env.python), "-m", "pytest", *pytest_options, "tests/upstream"],
            cwd=project.root,
            env={**os.environ, **laid.env},
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        ).returncode
    return Finished(laid, code, time.monotonic() - started)


def report(finished: Finished) -> None:
    """The run's pytest output, then its exit line."""
    sys.stdout.write(finished.laid_down.log.read_text(errors="replace"))
    label = finished.laid_down.run.label
    print(f"line-tests: {label}: exit {finished.code} in {finished.seconds:.0f} s", flush=True)


def run_all(project: Project, laid: list[LaidDown], pytest_options: list[str]) -> int:
    """Every run, JOBS at a time; each one's output printed when it ends, a failed run's after
    every run ended, so that the output ends with a failure's pytest summary. The first failed
    run's exit status."""
    failed: list[Finished] = []
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        for each in laid:
            print(
                f"line-tests: {each.run.label} in {each.run.env.name} ({each.run.env.venv.name})", flush=True
            )
        for future in as_completed([pool.submit(run_pytest, project, each, pytest_options) for each in laid]):
            finished = future.result()
            if finished.code == 0:
                report(finished)
            else:
                failed.append(finished)
    for finished in failed:
        report(finished)
    return failed[0].code if failed else 0


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
            worktrees: list[tuple[Git, Path]] = []
            try:
                laid: list[LaidDown] = []
                for run in runs:
                    if not environment_built(run):
                        code = 1
                        break
                    laid.append(lay_down(project, run, worktrees))
                else:
                    code = run_all(project, laid, pytest_options)
            finally:
                for git, folder in worktrees:
                    git.run("worktree", "remove", "--force", str(folder), check=False)
                    git.run("worktree", "prune", check=False)
        for problem in not_restored:
            print(f"line-tests: error: {problem}", file=sys.stderr)
        return code or (1 if not_restored else 0)
    except CarryError as exc:
        print(f"line-tests: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
