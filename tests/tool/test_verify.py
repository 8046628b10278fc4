from __future__ import annotations

import json
import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from sglang_carry.cli_render import problem, text_lines
from sglang_carry.git import Git
from sglang_carry.patching import export
from sglang_carry.progress import SILENT, Recorder, Reporter
from sglang_carry.runner import Completed
from sglang_carry.verify import TreeTester, report_log_cases, selects, verify, verify_target
from sglang_carry.verify.pytest_run import command_ids

from .conftest import DemoProject, git, patch_message

CORE = "python/demo/core.py"
ANSWER_TEST = """\
import os, sys
sys.path.insert(0, os.environ["CARRY_TREE_DEMO"])
from demo.core import answer

def test_answer():
    assert answer() == 42
"""
VALUE_TEST = """\
import os, sys
sys.path.insert(0, os.environ["CARRY_TREE_DEMO"])
import demo

def test_value():
    assert demo.VALUE == 1
"""


def write_tests(demo: DemoProject) -> None:
    (demo.root / "tests").mkdir()
    (demo.root / "tests" / "test_answer.py").write_text(ANSWER_TEST)
    (demo.root / "tests" / "test_value.py").write_text(VALUE_TEST)


def test_verdicts(demo: DemoProject) -> None:
    write_tests(demo)
    demo.fetch()
    demo.commit_change(
        CORE, "def answer():\n    return 42\n", patch_message("Fix", tests="tests/test_answer.py")
    )
    demo.commit_empty(
        patch_message("Upstream has it", status="Applied-Upstream", tests="tests/test_value.py")
    )
    demo.commit_change("python/demo/x.py", "X = 1\n", patch_message("Unproven", tests="tests/test_answer.py"))
    export(demo.project, demo.target())
    verdicts = verify_target(demo.project, demo.target(), sys.executable, demo.pip)
    assert [(v.without, v.with_patch, v.ok) for v in verdicts] == [
        ("fail", "pass", True),
        ("pass", "pass", True),
        ("pass", "pass", False),
    ]
    assert git(demo.checkout, "worktree", "list").stdout.count("\n") == 1


def test_verify_exits_non_zero_and_prints_the_table(demo: DemoProject) -> None:
    write_tests(demo)
    demo.lay_down("tiny")
    demo.fetch()
    demo.commit_change("python/demo/x.py", "X = 1\n", patch_message("Unproven", tests="tests/test_value.py"))
    export(demo.project, demo.target())
    result = verify(demo.project, [demo.target()], sys.executable, demo.pip)
    assert result.exit_code == 1
    assert problem(result) == "1 of 1 series entries are not proven: see the table above"
    [table] = text_lines(result, demo.root)
    assert "0001-Unproven.patch" in table and "WRONG (expected fail -> pass)" in table


def test_missing_test_id_is_an_error_not_a_failure(demo: DemoProject) -> None:
    write_tests(demo)
    demo.fetch()
    demo.commit_change(
        CORE, "def answer():\n    return 42\n", patch_message("Fix", tests="tests/test_nope.py")
    )
    export(demo.project, demo.target())
    verdicts = verify_target(demo.project, demo.target(), sys.executable, demo.pip)
    assert (verdicts[0].without, verdicts[0].with_patch, verdicts[0].ok) == ("error", "error", False)


def test_two_verify_runs_at_once_on_one_checkout_are_both_correct(demo: DemoProject) -> None:
    write_tests(demo)
    demo.fetch()
    demo.commit_change(
        CORE, "def answer():\n    return 42\n", patch_message("Fix", tests="tests/test_answer.py")
    )
    export(demo.project, demo.target())
    both_running = threading.Barrier(2, timeout=60)
    environments: list[Mapping[str, str]] = []

    def in_step(args: Sequence[str], **kwargs: Any) -> Completed:
        if "pytest" in args:
            environments.append(dict(kwargs["env"]))
            both_running.wait()  # each pytest of one run starts beside one of the other run
        return demo.pip(args, **kwargs)

    results: list[list[tuple[str, str, bool]]] = []

    def one_run() -> None:
        verdicts = verify_target(demo.project, demo.target(), sys.executable, in_step)
        results.append([(v.without, v.with_patch, v.ok) for v in verdicts])

    runs = [threading.Thread(target=one_run) for _ in range(2)]
    for run in runs:
        run.start()
    for run in runs:
        run.join()
    assert results == [[("fail", "pass", True)], [("fail", "pass", True)]]
    trees = {env["CARRY_TREE_DEMO"] for env in environments}
    extension_dirs = {env["TORCH_EXTENSIONS_DIR"] for env in environments}
    assert len(environments) == len(trees) == len(extension_dirs) == 4
    build = demo.root / "build"
    assert all(Path(path).is_relative_to(build) for path in trees | extension_dirs)
    assert git(demo.checkout, "worktree", "list").stdout.count("\n") == 1
    assert list((build / "verify" / "demo").iterdir()) == []


class CountingRunner:
    """The fixture's runner, recording the test ids of every pytest process."""

    def __init__(self, demo: DemoProject) -> None:
        self.demo = demo
        self.pytest_runs: list[tuple[str, list[str]]] = []

    def __call__(self, args: Sequence[str], **kwargs: Any) -> Completed:
        if "pytest" in args:
            ids = [arg for arg in args if arg.startswith("tests/")]
            self.pytest_runs.append((kwargs["env"]["CARRY_TREE_DEMO"], ids))
        return self.demo.pip(args, **kwargs)


def two_fixes(demo: DemoProject) -> None:
    write_tests(demo)
    demo.fetch()
    demo.commit_change(
        CORE, "def answer():\n    return 42\n", patch_message("Fix", tests="tests/test_answer.py")
    )
    demo.commit_change(
        "python/demo/__init__.py",
        "VALUE = 2\n",
        patch_message("Fix value", tests="tests/test_answer.py::test_answer tests/test_value.py"),
    )


def test_each_tree_runs_once_with_every_id_it_needs(demo: DemoProject) -> None:
    two_fixes(demo)
    export(demo.project, demo.target())
    runner = CountingRunner(demo)
    verdicts = verify_target(demo.project, demo.target(), sys.executable, runner)
    assert [(v.without, v.with_patch) for v in verdicts] == [("fail", "pass"), ("pass", "fail")]
    runs = sorted(sorted(ids) for _, ids in runner.pytest_runs)
    assert runs == [
        ["tests/test_answer.py"],  # pristine
        ["tests/test_answer.py", "tests/test_answer.py::test_answer", "tests/test_value.py"],  # fix 1
        ["tests/test_answer.py::test_answer", "tests/test_value.py"],  # fix 2
    ]


def make_tester(
    demo: DemoProject, runner: Any, parallel: int = 1, report: Reporter = SILENT
) -> tuple[TreeTester, list[str]]:
    git_ = Git(demo.checkout)
    commits = [git_.out("rev-parse", "upstream/1.0"), *git_.commits("upstream/1.0", "HEAD")]
    return TreeTester(demo.project, demo.target(), git_, sys.executable, runner, parallel, report), commits


def test_outcomes_per_id_and_a_missing_id_spoils_only_its_own_group(demo: DemoProject) -> None:
    two_fixes(demo)
    runner = CountingRunner(demo)
    report = Recorder()
    tester, commits = make_tester(demo, runner, report=report)
    try:
        tester.want(commits[1], ["tests/test_answer.py", "tests/test_value.py::test_value"])
        tester.want(commits[1], ["tests/test_value.py::test_nope"])
        tester.run_wanted()
        assert tester.outcomes(commits[1], ["tests/test_answer.py", "tests/test_value.py::test_value"]) == {
            "tests/test_answer.py": "pass",
            "tests/test_value.py::test_value": "pass",
        }
        assert tester.outcome(commits[1], ["tests/test_value.py::test_nope"]) == "error"
        assert tester.outcome(commits[0], ["tests/test_answer.py", "tests/test_value.py"]) == "fail"
        # A file given whole beside an id in it that does not exist: pytest runs the file, and
        # the id that matched nothing is an error of its own.
        assert tester.outcomes(commits[2], ["tests/test_value.py", "tests/test_value.py::test_nope"]) == {
            "tests/test_value.py": "fail",
            "tests/test_value.py::test_nope": "error",
        }
    finally:
        tester.close()
    # One run with the union, then one per group because pytest could not collect an id; then
    # one run on the pristine tree and one on the second fix.
    assert len(runner.pytest_runs) == 5
    assert "verify: error at" in report.warnings[0]


def test_a_crashed_pytest_is_an_error_and_is_said(demo: DemoProject) -> None:
    two_fixes(demo)

    def crashing(args: Sequence[str], **kwargs: Any) -> Completed:
        if "pytest" in args:
            return Completed(tuple(args), -11, "", "Fatal Python error: Segmentation fault")
        return demo.pip(args, **kwargs)

    report = Recorder()
    tester, commits = make_tester(demo, crashing, report=report)
    try:
        assert tester.outcomes(commits[1], ["tests/test_answer.py"]) == {"tests/test_answer.py": "error"}
    finally:
        tester.close()
    [err] = report.warnings
    assert "pytest exited -11" in err and "Segmentation fault" in err


def test_a_slot_moved_to_the_next_commit_keeps_no_bytecode_of_a_changed_file(demo: DemoProject) -> None:
    two_fixes(demo)
    tester, commits = make_tester(demo, demo.pip)
    try:
        # 41 -> 42 keeps core.py's size: only its deleted bytecode makes the import see the fix,
        # whatever the file times say.
        assert tester.outcome(commits[0], ["tests/test_answer.py"]) == "fail"
        (slot,) = tester.slots
        cache = slot.path / "python" / "demo" / "__pycache__"
        assert list(cache.glob("core.*.pyc"))
        assert tester.outcome(commits[1], ["tests/test_answer.py"]) == "pass"
        assert list(cache.glob("core.*.pyc")) and list(cache.glob("__init__.*.pyc"))
        tester.pool.tree(slot, commits[2])
        assert not list(cache.glob("__init__.*.pyc")) and list(cache.glob("core.*.pyc"))
    finally:
        tester.close()


def test_native_sources_key_follows_only_native_sources(demo: DemoProject) -> None:
    two_fixes(demo)
    demo.commit_change("python/demo/ext.cpp", "int f() { return 1; }\n", patch_message("Native"))
    demo.commit_change("python/demo/x.py", "X = 1\n", patch_message("Python only"))
    demo.commit_change("python/demo/ext.cpp", "int f() { return 2; }\n", patch_message("Native again"))
    tester, commits = make_tester(demo, demo.pip)
    try:
        keys = [tester.pool.native_sources_key(commit) for commit in commits]
    finally:
        tester.close()
    assert keys[0] == keys[1] == keys[2] != keys[3] == keys[4] != keys[5]


def test_report_log_to_node_ids(tmp_path: Path) -> None:
    def test(nodeid: str, when: str, outcome: str) -> str:
        return json.dumps({"$report_type": "TestReport", "nodeid": nodeid, "when": when, "outcome": outcome})

    report = tmp_path / "report.jsonl"
    lines = [
        json.dumps({"$report_type": "SessionStart", "pytest_version": "9.2.0"}),
        test("tests/t.py::test_a[1]", "call", "passed"),
        test("tests/t.py::test_a[2]", "call", "failed"),
        test("tests/t.py::TestC::test_m", "call", "passed"),
        test("tests/t.py::test_s", "setup", "skipped"),
        test("tests/t.py::test_e", "setup", "failed"),
        test("tests/t.py::test_t", "call", "passed"),
        test("tests/t.py::test_t", "teardown", "failed"),
        json.dumps({"$report_type": "CollectReport", "nodeid": "tests/broken.py", "outcome": "failed"}),
    ]
    report.write_text("\n".join(lines) + "\n")
    assert report_log_cases(report) == {
        "tests/t.py::test_a[1]": "pass",
        "tests/t.py::test_a[2]": "fail",
        "tests/t.py::TestC::test_m": "pass",
        "tests/t.py::test_s": "pass",
        "tests/t.py::test_e": "fail",
        "tests/t.py::test_t": "fail",
    }
    assert selects("tests/t.py::test_a", "tests/t.py::test_a[1]")
    assert not selects("tests/t.py::test_a", "tests/t.py::test_ab")
    assert selects("tests/", "tests/t.py::TestC::test_m")
    assert selects("tests/t.py::TestC", "tests/t.py::TestC::test_m")
    assert not selects("tests/t", "tests/t.py::test_s")
    with pytest.raises(ValueError, match="no readable test report"):
        report_log_cases(tmp_path / "missing.jsonl")


def test_without_a_report_the_exit_code_decides_per_group(demo: DemoProject) -> None:
    two_fixes(demo)
    passing = {"tests/good.py"}
    runs: list[list[str]] = []

    def exit_code_only(args: Sequence[str], **kwargs: Any) -> Completed:
        if "pytest" in args:  # writes no report, like a stand-in for pytest
            ids = command_ids(args)
            runs.append(ids)
            return Completed(tuple(args), 0 if set(ids) <= passing else 1, "", "")
        return demo.pip(args, **kwargs)

    tester, commits = make_tester(demo, exit_code_only)
    try:
        tester.want(commits[1], ["tests/good.py"])
        tester.want(commits[1], ["tests/bad.py"])
        tester.run_wanted()
        assert tester.outcome(commits[1], ["tests/good.py"]) == "pass"
        assert tester.outcome(commits[1], ["tests/bad.py"]) == "fail"
        assert tester.outcomes(commits[2], ["tests/good.py"]) == {"tests/good.py": "pass"}
        # One group of two ids: split id by id.
        both = ["tests/good.py", "tests/bad.py"]
        assert tester.outcomes(commits[0], both) == {"tests/good.py": "pass", "tests/bad.py": "fail"}
    finally:
        tester.close()
    split = [["tests/good.py", "tests/bad.py"], ["tests/good.py"], ["tests/bad.py"]]
    assert runs == [*split, ["tests/good.py"], *split]
