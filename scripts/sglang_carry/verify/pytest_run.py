"""One pytest process over a set of ids, and the exact outcome of every test it ran, read from
pytest-reportlog's JSON lines (node ids as pytest spells them, no rebuilding)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..runner import Runner
from .plan import FAIL, PASS, TestOutcome, id_outcomes


def report_log_cases(path: Path) -> dict[str, TestOutcome]:
    """pytest node id -> pass/fail for every test of a `--report-log` file.

    A skipped test counts as passed, as it does for pytest's exit code; a failure in any phase
    (setup, call, teardown: a fixture error too) counts as failed. Raises ValueError when the log
    is unreadable.
    """
    cases: dict[str, TestOutcome] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        for line in lines:
            record = json.loads(line)
            if record.get("$report_type") != "TestReport":
                continue  # a CollectReport that failed: pytest's exit code reports it
            nodeid = str(record["nodeid"])
            failed = record["outcome"] == "failed"
            cases[nodeid] = FAIL if failed or cases.get(nodeid) == FAIL else PASS
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"no readable test report at {path} ({exc})") from exc
    return cases


def pytest_command(python: str, report: Path, tests: Sequence[str]) -> list[str]:
    # `--` ends the options: every id after it is an id, whatever it looks like.
    return [python, "-m", "pytest", f"--report-log={report}", "-q", "-p", "no:cacheprovider", "--", *tests]


def command_ids(argv: Sequence[str]) -> list[str]:
    """The test ids a `pytest_command` runs (what a stand-in for pytest reads)."""
    return list(argv[list(argv).index("--") + 1 :])


@dataclass(frozen=True)
class PytestRun:
    """Per-id outcomes, or None with the problem when pytest did not get through its tests."""

    outcomes: dict[str, TestOutcome] | None
    problem: str = ""


def run_pytest(
    runner: Runner,
    python: str,
    root: Path,
    tests: Sequence[str],
    env: Mapping[str, str],
    report: Path,
    whole: bool,
) -> PytestRun:
    """Run ``tests`` in one pytest process. Without a readable report (a stand-in for pytest that
    writes none) the exit code still speaks for every id when it is 0, and for a ``whole`` part
    (one that is not split further) when it is 1."""
    result = runner(pytest_command(python, report, tests), cwd=root, env=dict(env))
    problem = f"pytest exited {result.returncode}"
    if result.returncode in (0, 1):
        try:
            return PytestRun(id_outcomes(tests, report_log_cases(report)))
        except ValueError as exc:
            if result.returncode == 0:
                return PytestRun(dict.fromkeys(tests, PASS))
            if whole:
                return PytestRun(dict.fromkeys(tests, FAIL))
            problem = f"pytest exited 1 and {exc}"
    tail = "\n".join(result.output.splitlines()[-5:])
    return PytestRun(None, f"{problem}; its last lines:\n{tail}")
