from __future__ import annotations

import sys

import pytest

from sglang_carry.errors import CarryError
from sglang_carry.patching import export
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
