from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from sglang_carry.cli_render import text_lines
from sglang_carry.errors import CarryError
from sglang_carry.files import INCOMING_SUFFIX, OUTGOING_SUFFIX
from sglang_carry.git import Git
from sglang_carry.patching import ApplyState, apply, export
from sglang_carry.runner import Completed, run_subprocess
from sglang_carry.series import load_series

from .conftest import DemoProject, git, patch_message

CORE = "python/demo/core.py"


def carry_two_patches(demo: DemoProject) -> None:
    demo.fetch()
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    demo.commit_empty(patch_message("Record an upstream fix", status="Applied-Upstream"))
    demo.commit_change("python/demo/extra.py", "EXTRA = True\n", patch_message("Add extra"))


def test_export_then_apply_round_trip_is_byte_stable(demo: DemoProject) -> None:
    carry_two_patches(demo)
    assert export(demo.project, demo.target()).exit_code == 0
    first = demo.snapshot(demo.series_dir)
    assert list(first) == [
        "0001-Fix-the-answer.patch",
        "0002-Record-an-upstream-fix.patch",
        "0003-Add-extra.patch",
        "revision",
        "series",
    ]
    series = load_series(demo.root / "patches", "demo", "1.0")
    assert [e.status for e in series.entries] == ["Pending", "Applied-Upstream", "Pending"]
    assert series.revision == 1

    git(demo.checkout, "checkout", "-q", "--detach")
    git(demo.checkout, "branch", "-D", "carry/1.0")
    assert apply(demo.project, demo.target()).exit_code == 0
    assert git(demo.checkout, "rev-list", "--count", "upstream/1.0..carry/1.0").stdout.strip() == "3"
    assert export(demo.project, demo.target()).exit_code == 0
    assert demo.snapshot(demo.series_dir) == first


def test_apply_is_a_no_op_when_the_branch_carries_the_series(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    tip = git(demo.checkout, "rev-parse", "HEAD").stdout
    result = apply(demo.project, demo.target())
    assert result.state is ApplyState.ALREADY_CARRIES
    assert "already carries" in text_lines(result, demo.root)[0]
    assert git(demo.checkout, "rev-parse", "HEAD").stdout == tip


def test_apply_refuses_uncommitted_work_even_when_the_branch_carries_the_series(demo: DemoProject) -> None:
    """It said "already carries", and the edit, in no patch, went unnoticed."""
    carry_two_patches(demo)
    export(demo.project, demo.target())
    tip = git(demo.checkout, "rev-parse", "HEAD").stdout
    (demo.checkout / "python" / "demo" / "scratch.txt").write_text("work in progress")
    with pytest.raises(
        CarryError, match=r"upstream/demo has uncommitted changes \(python/demo/scratch.txt\)"
    ):
        apply(demo.project, demo.target())
    assert git(demo.checkout, "rev-parse", "HEAD").stdout == tip
    assert (demo.checkout / "python" / "demo" / "scratch.txt").read_text() == "work in progress"


def test_revision_grows_only_when_the_series_changes(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    export(demo.project, demo.target())
    assert load_series(demo.root / "patches", "demo", "1.0").revision == 1
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Change again"))
    export(demo.project, demo.target())
    assert load_series(demo.root / "patches", "demo", "1.0").revision == 2


def test_dirty_checkout_is_refused_and_nothing_is_lost(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    (demo.series_dir / "0003-Add-extra.patch").unlink()
    (demo.series_dir / "series").write_text("0001-Fix-the-answer.patch\n0002-Record-an-upstream-fix.patch\n")
    (demo.checkout / CORE).write_text("uncommitted work\n")
    tip = git(demo.checkout, "rev-parse", "HEAD").stdout
    with pytest.raises(CarryError, match=r"uncommitted changes \(python/demo/core.py\).*nothing was changed"):
        apply(demo.project, demo.target())
    assert (demo.checkout / CORE).read_text() == "uncommitted work\n"
    assert git(demo.checkout, "rev-parse", "HEAD").stdout == tip


def test_rebuilding_a_diverged_branch_keeps_a_backup(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    demo.commit_change(CORE, "def answer():\n    return 0\n", patch_message("Unexported work"))
    tip = git(demo.checkout, "rev-parse", "HEAD").stdout.strip()
    assert apply(demo.project, demo.target()).exit_code == 0
    backups = git(
        demo.checkout, "branch", "--list", "carry-backup/*", "--format=%(objectname)"
    ).stdout.split()
    assert backups == [tip]


def test_series_naming_a_missing_patch(demo: DemoProject) -> None:
    demo.fetch()
    demo.series_dir.mkdir(parents=True)
    (demo.series_dir / "series").write_text("0001-gone.patch\n")
    with pytest.raises(CarryError, match=r"series lists 0001-gone.patch, which is not there"):
        apply(demo.project, demo.target())


def test_patch_listed_twice(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    (demo.series_dir / "series").write_text("0001-Fix-the-answer.patch\n0001-Fix-the-answer.patch\n")
    with pytest.raises(CarryError, match=r"lists 0001-Fix-the-answer.patch twice"):
        apply(demo.project, demo.target())


def test_patch_file_not_in_series(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    shutil.copy(demo.series_dir / "0003-Add-extra.patch", demo.series_dir / "0009-stray.patch")
    with pytest.raises(CarryError, match=r"0009-stray.patch is not listed in patches/demo/1.0/series"):
        apply(demo.project, demo.target())


def test_patch_that_does_not_apply_names_patch_and_file(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    patch = demo.series_dir / "0003-Add-extra.patch"
    first = demo.series_dir / "0001-Fix-the-answer.patch"
    first.write_text(first.read_text().replace("-    return 41", "-    return 40"))
    git(demo.checkout, "checkout", "-q", "--detach")
    git(demo.checkout, "branch", "-D", "carry/1.0")
    with pytest.raises(CarryError) as failure:
        apply(demo.project, demo.target())
    message = str(failure.value)
    assert "0001-Fix-the-answer.patch does not apply to demo 1.0 (python/demo/core.py)" in message
    assert "git am --continue" in message
    assert (demo.checkout / ".git" / "rebase-apply").exists()
    with pytest.raises(CarryError, match=r"a git am is in progress in upstream/demo: .*`git am --abort`"):
        apply(demo.project, demo.target())
    assert patch.exists()


def test_applied_upstream_entry_must_not_carry_a_diff(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    first = demo.series_dir / "0001-Fix-the-answer.patch"
    first.write_text(
        first.read_text().replace("Upstream-Status: Pending", "Upstream-Status: Applied-Upstream")
    )
    with pytest.raises(CarryError, match=r"Applied-Upstream entry carries no diff"):
        load_series(demo.root / "patches", "demo", "1.0")


def test_unknown_status_is_refused(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    first = demo.series_dir / "0001-Fix-the-answer.patch"
    first.write_text(first.read_text().replace("Upstream-Status: Pending", "Upstream-Status: Maybe"))
    with pytest.raises(CarryError, match=r"Upstream-Status trailer is 'Maybe'"):
        load_series(demo.root / "patches", "demo", "1.0")


def test_trailers_are_parsed(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    entry = load_series(demo.root / "patches", "demo", "1.0").entries[0]
    assert entry.subject == "Fix the answer"
    assert entry.trailers["Bug"] == ["https://example.com/issue/1"]
    assert entry.trailers["Drop-When"] == ["upstream fixes it"]
    assert entry.tests == ["tests/test_demo.py"]


def test_export_without_checkout_is_one_clear_error(demo: DemoProject) -> None:
    with pytest.raises(CarryError, match=r"no checkout of demo 1.0 .*run `carry fetch` first"):
        export(demo.project, demo.target())


def test_export_keeps_a_stray_patch_file_and_reports_it(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    stray = demo.series_dir / "0099-x.patch"
    stray.write_text("someone's work\n")
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Change again"))
    result = export(demo.project, demo.target())
    assert result.exit_code == 0 and result.strays == ("0099-x.patch",)
    assert stray.read_text() == "someone's work\n"
    assert (
        "patches/demo/1.0/0099-x.patch is not in the series and was left in place"
        in (text_lines(result, demo.root)[0])
    )
    assert (demo.series_dir / "0004-Change-again.patch").exists()


def test_export_never_overwrites_a_file_it_did_not_write(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    clash = demo.series_dir / "0004-Change-again.patch"
    clash.write_text("not written by export\n")
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Change again"))
    with pytest.raises(CarryError, match=r"0004-Change-again.patch is not in patches/demo/1.0/series"):
        export(demo.project, demo.target(), force=True)
    assert clash.read_text() == "not written by export\n"


def test_export_after_git_am_abort_is_refused_and_the_series_is_unchanged(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    git(demo.checkout, "commit", "-q", "--allow-empty", "-m", "unexported work")
    first = demo.series_dir / "0001-Fix-the-answer.patch"
    first.write_text(first.read_text().replace("-    return 41", "-    return 40"))
    before = demo.snapshot(demo.series_dir)
    with pytest.raises(CarryError, match=r"does not apply"):
        apply(demo.project, demo.target())
    # The tool's own hints, in order: abort the am, then export.
    git(demo.checkout, "am", "--abort")
    with pytest.raises(CarryError) as refused:
        export(demo.project, demo.target())
    assert "would shrink patches/demo/1.0 from 3 to 0 patch(es)" in str(refused.value)
    assert "nothing was written" in str(refused.value)
    assert demo.snapshot(demo.series_dir) == before
    assert git(demo.checkout, "status", "--porcelain").stdout == ""


def test_export_refuses_while_git_am_is_in_progress(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    first = demo.series_dir / "0001-Fix-the-answer.patch"
    first.write_text(first.read_text().replace("-    return 41", "-    return 40"))
    git(demo.checkout, "checkout", "-q", "--detach")
    git(demo.checkout, "branch", "-D", "carry/1.0")
    before = demo.snapshot(demo.series_dir)
    with pytest.raises(CarryError):
        apply(demo.project, demo.target())
    with pytest.raises(CarryError, match=r"a git am is in progress in upstream/demo"):
        export(demo.project, demo.target())
    assert demo.snapshot(demo.series_dir) == before


def test_hand_edit_is_detected_not_thrown_away(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    patch = demo.series_dir / "0003-Add-extra.patch"
    edited = patch.read_text().replace("Bug: https://example.com/issue/1", "Bug: https://example.com/issue/7")
    patch.write_text(edited)
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Change again"))
    before = demo.snapshot(demo.series_dir)
    with pytest.raises(CarryError) as refused:
        export(demo.project, demo.target())
    message = str(refused.value)
    assert "patches/demo/1.0 was edited by hand since revision 1 was recorded" in message
    assert "`carry apply`" in message and "`carry export --force`" in message
    assert demo.snapshot(demo.series_dir) == before
    # Keeping the files' version: apply rebuilds the branch from them, export then records them.
    assert apply(demo.project, demo.target()).exit_code == 0
    assert export(demo.project, demo.target()).exit_code == 0
    assert patch.read_text() == edited
    assert load_series(demo.root / "patches", "demo", "1.0").revision == 2


def test_hand_edit_that_does_not_round_trip_is_kept_after_apply(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    patch = demo.series_dir / "0003-Add-extra.patch"
    # A code edit in the patch: git am applies it, but format-patch writes other index lines.
    patch.write_text(patch.read_text().replace("+EXTRA = True", "+EXTRA = False"))
    assert apply(demo.project, demo.target()).exit_code == 0
    assert export(demo.project, demo.target()).exit_code == 0
    assert git(demo.checkout, "show", "carry/1.0:python/demo/extra.py").stdout == "EXTRA = False\n"
    assert "+EXTRA = False" in patch.read_text()


def test_export_force_keeps_the_branch(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    patch = demo.series_dir / "0003-Add-extra.patch"
    exported = patch.read_bytes()
    patch.write_text(patch.read_text().replace("Why this change", "Why that change"))
    assert export(demo.project, demo.target(), force=True).exit_code == 0
    assert patch.read_bytes() == exported


def test_export_refuses_uncommitted_changes(demo: DemoProject) -> None:
    carry_two_patches(demo)
    (demo.checkout / CORE).write_text("def answer():\n    return 44\n")
    with pytest.raises(CarryError, match=r"uncommitted changes \(python/demo/core.py\).*`carry export`"):
        export(demo.project, demo.target())
    assert not demo.series_dir.exists()


def test_apply_of_an_empty_entry_succeeds_whatever_git_speaks(
    demo: DemoProject, monkeypatch: pytest.MonkeyPatch
) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    git(demo.checkout, "checkout", "-q", "--detach")
    git(demo.checkout, "branch", "-D", "carry/1.0")
    monkeypatch.delenv("LC_ALL", raising=False)
    monkeypatch.delenv("LC_MESSAGES", raising=False)
    monkeypatch.setenv("LANG", "C.UTF-8")
    monkeypatch.setenv("LANGUAGE", "de")
    assert apply(demo.project, demo.target()).exit_code == 0
    assert git(demo.checkout, "rev-list", "--count", "upstream/1.0..carry/1.0").stdout.strip() == "3"
    assert git(demo.checkout, "status", "--porcelain").stdout == ""


def test_git_runs_with_a_fixed_locale(demo: DemoProject, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANGUAGE", "de")
    seen: list[Mapping[str, str]] = []

    def recording(args: Sequence[str], **kwargs: Any) -> Completed:
        seen.append(kwargs.get("env") or {})
        return run_subprocess(args, **kwargs)

    Git(demo.root, recording).run("--version")
    assert seen[0]["LC_ALL"] == "C" and seen[0]["LANGUAGE"] == ""


def test_git_error_keeps_the_file_it_names(demo: DemoProject) -> None:
    carry_two_patches(demo)
    export(demo.project, demo.target())
    git(demo.checkout, "checkout", "-q", "--detach")
    (demo.checkout / ".git" / "index.lock").write_text("")
    with pytest.raises(CarryError) as failure:
        apply(demo.project, demo.target())
    message = str(failure.value)
    assert ".git/index.lock': File exists" in message and "remove the file manually" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("start", "name"),
    [
        (["merge", "side"], "merge"),
        (["cherry-pick", "side"], "cherry-pick"),
        (["rebase", "side"], "rebase"),
        (["revert", "side"], "revert"),
    ],
)
def test_operation_in_progress_is_read_from_git(demo: DemoProject, start: list[str], name: str) -> None:
    demo.fetch()
    git(demo.checkout, "checkout", "-q", "-b", "side")
    demo.commit_change(CORE, "def answer():\n    return 1\n", "side")
    git(demo.checkout, "checkout", "-q", "carry/1.0")
    demo.commit_change(CORE, "def answer():\n    return 2\n", "main")
    assert Git(demo.checkout).operation_in_progress() is None
    assert git(demo.checkout, *start, check=False).returncode != 0  # both changed the same line
    operation = Git(demo.checkout).operation_in_progress()
    assert operation is not None and operation.name == name


def test_a_full_disk_during_export_leaves_the_series_as_it_was(
    demo: DemoProject, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills after the first new file: the folder keeps its old series, revision and
    REBASE.md, nothing half-written is left beside it, the one error line names the file, and
    once there is space the same export goes through."""
    carry_two_patches(demo)
    export(demo.project, demo.target())
    (demo.series_dir / "REBASE.md").write_text("how this line was made\n")
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Change again"))
    before = demo.snapshot(demo.series_dir)
    written: list[str] = []
    real_open = Path.open

    def open_until_the_disk_is_full(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if path.parent.name.endswith(INCOMING_SUFFIX) and "w" in mode:
            written.append(path.name)
            if len(written) > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", open_until_the_disk_is_full)
    assert demo.carry("export", "demo") == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == (
        f"carry export: error: {demo.series_dir / written[1]}: No space left on device: free some disk space"
    )
    assert demo.snapshot(demo.series_dir) == before
    assert [p.name for p in demo.series_dir.parent.iterdir()] == ["1.0"]
    monkeypatch.undo()
    assert export(demo.project, demo.target()).exit_code == 0
    assert load_series(demo.root / "patches", "demo", "1.0").revision == 2
    assert (demo.series_dir / "REBASE.md").read_text() == "how this line was made\n"


@pytest.mark.parametrize("failing", [1, 2], ids=["setting-the-old-aside", "moving-the-new-in"])
def test_an_export_whose_swap_fails_leaves_the_folder_as_it_was_and_nothing_beside_it(
    demo: DemoProject, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], failing: int
) -> None:
    """A busy mount point made the swap fail: export exited 1 but left .1.0.incoming/ beside the
    folder, which status then called the leftover of a killed command."""
    carry_two_patches(demo)
    export(demo.project, demo.target())
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Change again"))
    before = demo.snapshot(demo.series_dir)
    renames: list[str] = []
    real_rename = os.rename

    def busy(source: Any, destination: Any) -> None:
        renames.append(str(source))
        if len(renames) == failing:
            raise OSError(errno.EBUSY, "Device or resource busy")
        real_rename(source, destination)

    monkeypatch.setattr(os, "rename", busy)
    assert demo.carry("export", "demo") == 1
    monkeypatch.undo()
    assert "Device or resource busy" in capsys.readouterr().err
    assert demo.snapshot(demo.series_dir) == before
    assert [p.name for p in demo.series_dir.parent.iterdir()] == ["1.0"]


def test_an_export_killed_while_it_swapped_folders_is_undone_by_the_next(demo: DemoProject) -> None:
    """Killed between setting the old folder aside and moving the new one in: the next export
    (holding the checkout's lock, so the killed one is dead) puts the old one back first."""
    carry_two_patches(demo)
    export(demo.project, demo.target())
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Change again"))
    export(demo.project, demo.target())
    (demo.series_dir / "REBASE.md").write_text("how this line was made\n")
    before = demo.snapshot(demo.series_dir)
    demo.series_dir.rename(demo.series_dir.with_name(".1.0" + OUTGOING_SUFFIX))
    (demo.series_dir.with_name(".1.0" + INCOMING_SUFFIX)).mkdir()
    assert export(demo.project, demo.target()).exit_code == 0
    assert demo.snapshot(demo.series_dir) == before  # revision 2 and REBASE.md, as they were
    assert [p.name for p in demo.series_dir.parent.iterdir()] == ["1.0"]


def test_a_truncated_patch_says_what_git_says(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "does not apply", with git's "corrupt patch at line N" hidden, and advised
    resolving a conflict that does not exist."""
    carry_two_patches(demo)
    export(demo.project, demo.target())
    patch = demo.series_dir / "0001-Fix-the-answer.patch"
    text = patch.read_text()
    patch.write_text(text[: text.index("+    return 42")] + "+    return 4")  # cut inside the hunk
    tip = git(demo.checkout, "rev-parse", "carry/1.0").stdout
    with pytest.raises(CarryError) as refused:
        apply(demo.project, demo.target())
    message = str(refused.value)
    assert "0001-Fix-the-answer.patch is broken (git: error: corrupt patch at line" in message
    assert "git checkout -- patches/demo/1.0/0001-Fix-the-answer.patch" in message
    assert Git(demo.checkout).operation_in_progress() is None  # nothing left half-done
    # Found when the series is read: the branch is not touched, and status calls it BROKEN.
    assert git(demo.checkout, "rev-parse", "carry/1.0").stdout == tip
    assert not git(demo.checkout, "branch", "--list", "carry-backup/*").stdout
    assert demo.carry("status", "demo") == 1
    assert "series    BROKEN: patches/demo/1.0/0001-Fix-the-answer.patch is broken (git: error: corrupt" in (
        capsys.readouterr().out
    )


def test_a_file_that_is_not_a_patch_at_all(demo: DemoProject) -> None:
    """It said "Upstream-Status trailer is ''"."""
    carry_two_patches(demo)
    export(demo.project, demo.target())
    (demo.series_dir / "0001-Fix-the-answer.patch").write_text("garbage\n\x00\x01 not a mail\n")
    with pytest.raises(CarryError, match=r"0001-Fix-the-answer.patch is not a patch in git's mail format"):
        apply(demo.project, demo.target())
