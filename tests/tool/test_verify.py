from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from sglang_carry.errors import CarryError
from sglang_carry.patching import export
from sglang_carry.runner import Completed
from sglang_carry.verify import verify, verify_target

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


def test_verify_exits_non_zero_and_prints_the_table(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    write_tests(demo)
    demo.fetch()
    demo.commit_change("python/demo/x.py", "X = 1\n", patch_message("Unproven", tests="tests/test_value.py"))
    export(demo.project, demo.target())
    with pytest.raises(CarryError, match=r"1 of 1 series entries are not proven"):
        verify(demo.project, [demo.target()], sys.executable, demo.pip)
    out = capsys.readouterr().out
    assert "0001-Unproven.patch" in out and "WRONG (expected fail -> pass)" in out


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
