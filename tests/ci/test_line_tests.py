"""ci/line_tests.py: what it says when a line's test environment cannot be built."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[2]
line_tests = load_script("carry_line_tests", ROOT / "ci" / "line_tests.py")


def test_an_environment_that_cannot_be_built_is_one_line_and_no_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        commands.append(command)
        assert command[1].endswith("test_env.py"), f"ran {command} after its environment failed to build"
        # test_env.py fails as pip does on a full disk.
        if kwargs.get("check"):
            raise subprocess.CalledProcessError(1, command)
        return subprocess.CompletedProcess(command, 1)

    @contextlib.contextmanager
    def checkouts_untouched(project: object, names: object) -> Iterator[list[str]]:
        yield []

    monkeypatch.setattr(line_tests.subprocess, "run", run)
    monkeypatch.setattr(line_tests, "found_branch_restored", checkouts_untouched)
    runs = line_tests.ci_runs(line_tests.Project(ROOT), line_tests.EVERY)
    monkeypatch.setattr(line_tests, "ci_runs", lambda project, schedule: runs)
    monkeypatch.setattr(sys, "argv", ["line_tests.py", "-q"])

    assert line_tests.main() == 1

    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines() == [
        f"line-tests: {runs[0].label}: not run, its test environment {runs[0].env.name} is not built"
    ]
    assert commands == [[sys.executable, str(ROOT / "scripts" / "test_env.py"), runs[0].env.name]]


def test_runs_go_side_by_side_and_a_failed_one_is_printed_last(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Two runs at a time; each run's output is printed when it ends, a failed run's after every
    run ended (so the output ends with its pytest summary), and its status is the exit status."""
    runs = line_tests.ci_runs(line_tests.Project(ROOT), line_tests.EVERY)
    assert len(runs) >= 2
    laid = []
    for i, run in enumerate(runs[:2]):
        log = tmp_path / f"run{i}.log"
        log.write_text(f"output of run {i}\n")
        laid.append(line_tests.LaidDown(run, {}, log))
    started: list[int] = []
    side_by_side = threading.Barrier(2, timeout=10)  # broken unless both runs are in at once

    def run_pytest(project: object, each: Any, options: list[str]) -> Any:
        started.append(laid.index(each))
        side_by_side.wait()
        code = 3 if each is laid[0] else 0  # the first run fails
        return line_tests.Finished(each, code, 1.0)

    monkeypatch.setattr(line_tests, "run_pytest", run_pytest)
    assert line_tests.run_all(line_tests.Project(ROOT), laid, ["-q"]) == 3
    out = capsys.readouterr().out
    assert sorted(started) == [0, 1]
    assert out.index("output of run 1") < out.index("output of run 0")
    assert out.rstrip().endswith(f"line-tests: {runs[0].label}: exit 3 in 1 s")
