"""The tree a test run imports is the default line's, whatever branch the checkout is on; a command
that switches the checkout for a while puts it back where it found it."""

from __future__ import annotations

import fcntl
import multiprocessing
import multiprocessing.synchronize
import sys
from pathlib import Path

import pytest

from sglang_carry.errors import CarryError
from sglang_carry.patching import apply, export
from sglang_carry.trees import default_tree, found_branch_restored, run_with_checkouts_restored
from sglang_carry.verify import verify

from .conftest import DemoProject, git, patch_message
from .test_lines import carry_fix_and_pin_a_new_release
from .test_verify import write_tests


def two_lines(demo: DemoProject) -> None:
    """demo 1.0 with a fix, 1.1 (the default line) carrying nothing, both laid down; the checkout
    is left on the OLD line, as the line tests left sglang's on 0.5.20."""
    carry_fix_and_pin_a_new_release(demo)
    marker = demo.series_dir.with_name("1.1") / "carries-nothing"
    marker.parent.mkdir()
    marker.write_text("1.1 has the fix upstream\n")
    assert apply(demo.project, demo.target(version="1.1")).exit_code == 0
    assert apply(demo.project, demo.target(version="1.0")).exit_code == 0


def branch(demo: DemoProject) -> str:
    return git(demo.checkout, "symbolic-ref", "--short", "HEAD").stdout.strip()


def test_the_default_lines_tree_while_the_checkout_is_on_another_line(demo: DemoProject) -> None:
    two_lines(demo)
    assert branch(demo) == "carry/1.0"
    tree = default_tree(demo.project, "demo")
    assert (tree.target.version, tree.is_checkout) == ("1.1", False)
    # 1.1's own file, and not 1.0's fixed answer: the tree is the default line's branch.
    assert (tree.folder / "demo" / "new.py").exists()
    assert "return 40" in (tree.folder / "demo" / "core.py").read_text()
    assert branch(demo) == "carry/1.0", "finding the tree must not switch the checkout"


def test_the_checkout_itself_while_it_is_on_the_default_line(demo: DemoProject) -> None:
    two_lines(demo)
    git(demo.checkout, "checkout", "-q", "carry/1.1")
    (demo.checkout / "python" / "demo" / "core.py").write_text("EDITED = 1\n")
    tree = default_tree(demo.project, "demo")
    assert tree.is_checkout and tree.folder == demo.checkout / "python"
    assert (tree.folder / "demo" / "core.py").read_text() == "EDITED = 1\n"


def test_the_worktree_follows_the_branch_when_it_moves(demo: DemoProject) -> None:
    two_lines(demo)
    first = default_tree(demo.project, "demo").folder
    git(demo.checkout, "checkout", "-q", "carry/1.1")
    demo.commit_change("python/demo/later.py", "LATER = 1\n", "a later commit on the default line")
    git(demo.checkout, "checkout", "-q", "carry/1.0")
    again = default_tree(demo.project, "demo").folder
    assert again == first and (again / "demo" / "later.py").exists()


def _resolve_after(barrier: multiprocessing.synchronize.Barrier, demo: DemoProject, found: Path) -> None:
    barrier.wait(timeout=30)
    tree = default_tree(demo.project, "demo").folder
    found.with_name(f"{found.name}.{multiprocessing.current_process().pid}").write_text(str(tree))


def test_runs_side_by_side_lay_the_tree_down_once_each_in_turn(demo: DemoProject, tmp_path: Path) -> None:
    """`carry verify` starts test processes side by side while the checkout is on another line:
    each finds the default tree, none removes it under another (the lock), and a run that finds
    the lock held past its bound says whose lock, once."""
    two_lines(demo)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    runs = [
        context.Process(target=_resolve_after, args=(barrier, demo, tmp_path / "found")) for _ in range(4)
    ]
    for run in runs:
        run.start()
    for run in runs:
        run.join(timeout=120)
    assert [run.exitcode for run in runs] == [0, 0, 0, 0]
    trees = {path.read_text() for path in tmp_path.glob("found.*")}
    assert len(trees) == 1 and (Path(trees.pop()) / "demo" / "new.py").exists()

    lock = demo.project.scratch_dir / "default-trees" / "demo-1.1.lock"
    with lock.open("a") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with pytest.raises(CarryError, match=rf"{lock} was held for more than 0 s by another run"):
            default_tree(demo.project, "demo", lock_timeout_s=0.2)
    assert default_tree(demo.project, "demo", lock_timeout_s=0.2).target.version == "1.1"  # released


def test_no_default_branch_is_one_clear_error(demo: DemoProject) -> None:
    two_lines(demo)
    git(demo.checkout, "branch", "-D", "carry/1.1")
    expected = r"upstream/demo has no branch carry/1.1 .*run `./scripts/carry apply`"
    with pytest.raises(CarryError, match=expected):
        default_tree(demo.project, "demo")


def test_a_command_that_switches_lines_puts_the_checkout_back(demo: DemoProject) -> None:
    two_lines(demo)
    git(demo.checkout, "checkout", "-q", "carry/1.1")
    with found_branch_restored(demo.project, ["demo", "tiny"]) as not_restored:
        apply(demo.project, demo.target(version="1.0"))
        assert branch(demo) == "carry/1.0"
    assert not_restored == []
    assert branch(demo) == "carry/1.1"


def test_work_left_in_the_checkout_is_reported_not_lost(demo: DemoProject) -> None:
    two_lines(demo)
    git(demo.checkout, "checkout", "-q", "carry/1.1")
    with found_branch_restored(demo.project, ["demo"]) as not_restored:
        apply(demo.project, demo.target(version="1.0"))
        (demo.checkout / "python" / "demo" / "core.py").write_text("WORK = 1\n")
    assert branch(demo) == "carry/1.0"
    assert (demo.checkout / "python" / "demo" / "core.py").read_text() == "WORK = 1\n"
    assert len(not_restored) == 1
    assert not_restored[0].startswith("upstream/demo was left on carry/1.0 with work in progress")
    assert "`git checkout carry/1.1`" in not_restored[0]


def test_the_test_commands_set_up_puts_a_checkout_it_switched_back(demo: DemoProject) -> None:
    """./scripts/test lays the default line down (ci/checkouts_restored.py around `carry fetch`
    and `carry apply`): a developer's checkout on another line is put back on it, the command's
    failure is passed on, and a checkout the command made is left where the command left it."""
    two_lines(demo)
    switch = ["git", "-C", str(demo.checkout), "checkout", "-q", "carry/1.1"]
    assert run_with_checkouts_restored(demo.project, switch) == (0, [])
    assert branch(demo) == "carry/1.0"
    failing = ["bash", "-c", f"{' '.join(switch)} && exit 3"]
    assert run_with_checkouts_restored(demo.project, failing) == (3, [])
    assert branch(demo) == "carry/1.0"

    made = demo.root / "upstream" / "tiny"
    assert not made.exists()
    init = ["bash", "-c", f"git init -q -b carry/0.3 {made} && git -C {made} commit -q --allow-empty -m made"]
    assert run_with_checkouts_restored(demo.project, init) == (0, [])
    assert git(made, "symbolic-ref", "--short", "HEAD").stdout.strip() == "carry/0.3"


def stale_tiny(demo: DemoProject) -> Path:
    """tiny's series gains an entry that its checkout's branch lacks: patches/ pulled, not applied
    (how a clone stood when `carry rebase --check` read an sglang entry "fail fail WRONG")."""
    demo.lay_down("tiny")
    tiny = demo.root / "upstream" / "tiny"
    demo.commit_change(
        "tiny/__init__.py", "X = 2\n", patch_message("Fix tiny", tests="tests/t.py"), repo=tiny
    )
    assert export(demo.project, demo.target("tiny")).exit_code == 0
    git(tiny, "reset", "-q", "--hard", "upstream/0.3")
    return tiny


def demo_with_a_fix(demo: DemoProject) -> None:
    write_tests(demo)
    demo.fetch()
    fix = patch_message("Fix", tests="tests/test_answer.py")
    demo.commit_change("python/demo/core.py", "def answer():\n    return 42\n", fix)
    assert export(demo.project, demo.target()).exit_code == 0


def assert_verify_refuses(demo: DemoProject, expected: str) -> None:
    with pytest.raises(CarryError, match=expected):
        verify(demo.project, [demo.target()], sys.executable, demo.pip)


def test_verify_refuses_while_a_package_its_tests_import_differs_from_patches(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    stale_tiny(demo)
    demo_with_a_fix(demo)
    capsys.readouterr()
    assert demo.carry("verify", "demo", "--python", sys.executable) == 1
    assert capsys.readouterr().err.splitlines() == [
        "carry verify: error: the tests of demo 1.0 import tiny's carry/0.3, which differs from "
        "patches/tiny/0.3: run `carry apply tiny` (or `carry export tiny` to keep the branch), "
        "then run `carry verify` again"
    ]
    assert demo.carry("apply", "tiny") == 0
    assert demo.carry("verify", "demo", "--python", sys.executable) == 0


def test_verify_refuses_while_a_package_its_tests_import_is_not_laid_down(demo: DemoProject) -> None:
    demo_with_a_fix(demo)
    assert_verify_refuses(
        demo,
        r"import tiny's carry/0.3, which is not laid down in upstream/tiny: "
        r"run `carry fetch tiny && carry apply tiny`",
    )


def test_verify_refuses_while_a_package_its_tests_import_does_not_descend_from_its_tag(
    demo: DemoProject,
) -> None:
    demo.lay_down("tiny")
    tiny = demo.root / "upstream" / "tiny"
    git(tiny, "checkout", "-q", "--orphan", "elsewhere")
    git(tiny, "commit", "-q", "-m", "a branch from elsewhere")
    git(tiny, "branch", "-q", "-f", "carry/0.3", "elsewhere")
    demo_with_a_fix(demo)
    assert_verify_refuses(
        demo,
        r"import tiny's carry/0.3, which does not descend from upstream/0.3: "
        r"run `carry apply tiny` to rebuild it from patches/",
    )


def test_an_uncommitted_edit_in_an_imported_checkout_is_refused_unless_a_tree_is_named(
    demo: DemoProject, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    demo.lay_down("tiny")
    tiny = demo.root / "upstream" / "tiny"
    (tiny / "tiny" / "__init__.py").write_text("X = 'edited'\n")
    demo_with_a_fix(demo)
    assert_verify_refuses(
        demo,
        r"import tiny's carry/0.3 from upstream/tiny itself, "
        r"which has uncommitted changes \(tiny/__init__.py\)",
    )
    # A tree named by the user is imported as it is: nothing to check.
    monkeypatch.setenv("CARRY_TREE_TINY", str(tmp_path))
    assert verify(demo.project, [demo.target()], sys.executable, demo.pip).exit_code == 0
