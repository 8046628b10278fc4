"""Lines that must not be built: a pinned release nobody ported the series to, and a branch that
sits on another release than its tag (a hand rebase that stopped half way, or never happened)."""

from __future__ import annotations

import shutil
import sys

import pytest

from sglang_carry.build import build
from sglang_carry.errors import CarryError
from sglang_carry.patching import apply, export
from sglang_carry.project import select_targets
from sglang_carry.verify import verify

from .conftest import DEMO_FILES, DemoProject, git, patch_message

CORE = "python/demo/core.py"
NEW_RELEASE = {**DEMO_FILES, "demo/core.py": "def answer():\n    return 40\n", "demo/new.py": "NEW = 1\n"}


def carry_fix_and_pin_a_new_release(demo: DemoProject) -> None:
    demo.fetch()
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    export(demo.project, demo.target())
    demo.pin_release("1.1", NEW_RELEASE)
    demo.fetch(version="1.1")


def copy_series(demo: DemoProject, version: str) -> None:
    """What a maintainer does by hand: the old line's files as the new line's series."""
    shutil.copytree(demo.series_dir, demo.series_dir.with_name(version))


def test_unpatched_new_line_is_refused_by_build_and_verify(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    carry_fix_and_pin_a_new_release(demo)
    with pytest.raises(CarryError, match=r"demo 1.1 has no series in patches/demo/1.1, so it would be plain"):
        build(demo.project, demo.target(version="1.1"))
    with pytest.raises(CarryError, match=r"demo 1.1 has no series in patches/demo/1.1"):
        verify(demo.project, [demo.target(version="1.1")], sys.executable, demo.pip)
    assert not (demo.root / "dist").exists()
    # Without --upstream, the newest line that has a series, and the output says so.
    assert select_targets(demo.project, ["demo"], None)[0].version == "1.0"
    capsys.readouterr()
    assert demo.carry("build", "demo") == 0
    out = capsys.readouterr().out
    assert "demo 1.1 pinned without a series; building 1.0" in out
    assert out.splitlines()[-1] == "dist/demo-1.0+carry.1-py3-none-any.whl"


def test_new_line_marked_as_carrying_nothing_builds(demo: DemoProject) -> None:
    carry_fix_and_pin_a_new_release(demo)
    marker = demo.series_dir.with_name("1.1") / "carries-nothing"
    marker.parent.mkdir()
    marker.write_text("1.1 has the fix upstream\n")
    assert select_targets(demo.project, ["demo"], None)[0].version == "1.1"
    assert apply(demo.project, demo.target()).exit_code == 0
    assert build(demo.project, demo.target()).name == "demo-1.1+carry.0-py3-none-any.whl"


def test_branch_not_descending_from_its_tag_is_refused(demo: DemoProject) -> None:
    carry_fix_and_pin_a_new_release(demo)
    # carry/1.1 made from carry/1.0 and never rebased: its diff against upstream/1.1 would undo 1.1.
    git(demo.checkout, "branch", "carry/1.1", "carry/1.0")
    with pytest.raises(CarryError) as refused:
        export(demo.project, demo.target(version="1.1"))
    message = str(refused.value)
    assert "carry/1.1 in upstream/demo does not descend from upstream/1.1" in message
    assert "`git rebase --onto upstream/1.1 upstream/1.0 carry/1.1`" in message
    assert not demo.series_dir.with_name("1.1").exists()
    copy_series(demo, "1.1")
    with pytest.raises(CarryError, match=r"carry/1.1 in upstream/demo does not descend from upstream/1.1"):
        build(demo.project, demo.target(version="1.1"))
    assert not (demo.root / "dist").exists()


def test_rebase_in_progress_is_refused(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    carry_fix_and_pin_a_new_release(demo)
    git(demo.checkout, "checkout", "-q", "-b", "carry/1.1", "carry/1.0")
    stopped = git(demo.checkout, "rebase", "--onto", "upstream/1.1", "upstream/1.0", "carry/1.1", check=False)
    assert stopped.returncode != 0  # 1.1 changed the line the fix changes
    status_before = git(demo.checkout, "status", "--porcelain").stdout
    with pytest.raises(
        CarryError, match=r"a git rebase is in progress in upstream/demo: .*`git rebase --abort`"
    ):
        export(demo.project, demo.target(version="1.1"))
    assert not demo.series_dir.with_name("1.1").exists()
    copy_series(demo, "1.1")
    with pytest.raises(CarryError, match=r"a git rebase is in progress"):
        build(demo.project, demo.target(version="1.1"))
    capsys.readouterr()
    assert demo.carry("status", "demo") == 1
    assert "git rebase in progress" in capsys.readouterr().out
    assert git(demo.checkout, "status", "--porcelain").stdout == status_before


def test_export_beside_carries_nothing(demo: DemoProject) -> None:
    demo.fetch()
    demo.series_dir.mkdir(parents=True)
    (demo.series_dir / "carries-nothing").write_text("upstream has every fix\n")
    assert export(demo.project, demo.target()).exit_code == 0
    assert [p.name for p in demo.series_dir.iterdir()] == ["carries-nothing"]
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    with pytest.raises(
        CarryError, match=r"carries-nothing says demo 1.0 carries nothing, but carry/1.0 has 1"
    ):
        export(demo.project, demo.target())
    assert [p.name for p in demo.series_dir.iterdir()] == ["carries-nothing"]
