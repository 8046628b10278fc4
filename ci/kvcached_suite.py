"""Run kvcached's own test suite (shipped in its sdist) on pristine and patched kvcached, on CPU,
and compare the failure sets: the patched run must add no failure.

    .venv-test/bin/python ci/kvcached_suite.py [--version VERSION]   (default: kvcached's default line)

Some of the suite needs a GPU, kvcached's compiled extension or vllm, so both runs fail the same
tests on CPU; what matters is the difference. Exit 1 when the patched tree fails a test the
pristine tree passes.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from sglang_carry.errors import CarryError
from sglang_carry.git import Git
from sglang_carry.line_state import require_line_ready
from sglang_carry.project import Project, select_targets
from sglang_carry.runner import run_subprocess

ROOT = Path(__file__).resolve().parents[1]
OUTCOME = re.compile(r"^(FAILED|ERROR) (\S+)", re.MULTILINE)


def worktree(git: Git, name: str, ref: str) -> Path:
    return git.fresh_worktree(ROOT / "build" / "kvcached-suite" / name, ref)


def failures(tree: Path) -> tuple[set[str], str]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rfE",
            "--continue-on-collection-errors",
            "tests",
        ],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "no output"
    return {match.group(2) for match in OUTCOME.finditer(result.stdout)}, summary


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", help="the kvcached line (default: the default line, as `carry` picks it)"
    )
    args = parser.parse_args()
    runs = {}
    try:
        project = Project(ROOT)
        (line,) = select_targets(project, ["kvcached"], args.version)
        # "patched" means patches/: a branch that differs (a pull not applied yet) is refused, as
        # `carry build` refuses it.
        series = project.series(line.release)
        git = require_line_ready(project, line, series, run_subprocess, "ci/kvcached_suite.py")
        for name, ref in (("pristine", line.upstream_tag), ("patched", line.branch)):
            print(f"kvcached-suite: running kvcached's tests on {name} ({ref})", flush=True)
            runs[name] = failures(worktree(git, name, ref))
            print(f"kvcached-suite: {name}: {runs[name][1]} ({len(runs[name][0])} failing ids)", flush=True)
    except CarryError as error:
        print(f"kvcached-suite: error: {error}", file=sys.stderr)
        return 1
    added = sorted(runs["patched"][0] - runs["pristine"][0])
    fixed = sorted(runs["pristine"][0] - runs["patched"][0])
    print(f"kvcached-suite: failures added by the patches: {len(added)}; removed: {len(fixed)}")
    for node in added:
        print(f"  added: {node}")
    return 1 if added else 0


if __name__ == "__main__":
    sys.exit(main())
