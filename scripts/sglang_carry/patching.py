"""Move a series between patches/ and the checkout's ``carry/<version>`` branch, with git am and
git format-patch doing the work."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from .errors import CarryError
from .git import Git
from .project import Project, Target
from .runner import Runner, run_subprocess
from .series import (
    REVISION_FILE,
    SERIES_FILE,
    Entry,
    Series,
    read_revision,
    render_revision_file,
    render_series_file,
    series_digest,
)

# format-patch writes an empty file for a commit with no diff; an Applied-Upstream entry is such a
# commit, so export writes its mail header itself, in the form git am reads back.
EMPTY_COMMIT_FORMAT = (
    "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001%n"
    "From: %an <%ae>%nDate: %aD%nSubject: %s%n%n%b"
)
FORMAT_PATCH_ARGS = (
    "format-patch",
    "--keep-subject",
    "--no-signature",
    "--zero-commit",
    "--full-index",
    "--no-stat",
    "--no-notes",
    "--no-thread",
)
_FAILED_PATH = re.compile(r"^error: (?:patch failed: )?([^:\s]+)(?::\d+)?", re.MULTILINE)


def open_checkout(project: Project, target: Target, runner: Runner) -> Git:
    git = Git(project.checkout(target.name), runner)
    if not git.exists() or git.rev(target.upstream_tag) is None:
        raise CarryError(f"no checkout of {target.label} in upstream/{target.name}: run `carry fetch` first")
    if git.am_in_progress():
        raise CarryError(
            f"upstream/{target.name} is in the middle of git am: fix it and run `git am --continue` "
            "there, then `carry export`; or `git am --abort`"
        )
    return git


def export_branch(git: Git, target: Target, dest: Path) -> list[str]:
    """Write the branch's commits as patch files into ``dest``; returns their names in order."""
    commits = git.commits(target.upstream_tag, target.branch)
    if not commits:
        return []
    listing = git.out(*FORMAT_PATCH_ARGS, "-o", str(dest), f"{target.upstream_tag}..{target.branch}")
    paths = [Path(line) for line in listing.splitlines() if line.strip()]
    if len(paths) != len(commits):
        raise CarryError(f"format-patch wrote {len(paths)} files for {len(commits)} commits")
    for commit, path in zip(commits, paths, strict=True):
        if path.stat().st_size == 0:
            text = git.out("log", "-1", f"--format={EMPTY_COMMIT_FORMAT}", commit)
            path.write_text(text + "\n")
    return [path.name for path in paths]


def branch_matches_series(git: Git, target: Target, series: Series, scratch: Path) -> bool:
    """True when exporting the branch now would reproduce the series byte for byte."""
    if git.rev(target.branch) is None:
        return not series.entries
    scratch.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch, prefix="compare-") as tmp:
        names = export_branch(git, target, Path(tmp))
        if names != [entry.filename for entry in series.entries]:
            return False
        return all(
            (Path(tmp) / name).read_bytes() == (series.directory / name).read_bytes() for name in names
        )


def require_branch_matches(project: Project, target: Target, git: Git, series: Series) -> None:
    if not branch_matches_series(git, target, series, project.scratch_dir):
        raise CarryError(
            f"{target.branch} in upstream/{target.name} differs from {series.label}: "
            "run `carry export` to keep the branch, or `carry apply` to rebuild it from patches/"
        )


def apply(project: Project, target: Target, runner: Runner = run_subprocess) -> int:
    git = open_checkout(project, target, runner)
    series = project.series(target.release)
    old_tip = git.rev(target.branch)
    if old_tip and branch_matches_series(git, target, series, project.scratch_dir):
        if git.current_branch() != target.branch:
            _require_clean(git, target)
            git.run("checkout", "--quiet", target.branch)
        print(f"apply: {target.label}: {target.branch} already carries {series.label}")
        return 0
    _require_clean(git, target)
    if old_tip and old_tip != git.rev(target.upstream_tag):
        backup = f"carry-backup/{target.version}/{old_tip[:12]}"
        git.run("branch", "--force", backup, old_tip)
        print(f"apply: kept the previous {target.branch} as {backup}")
    git.run("checkout", "--quiet", "-B", target.branch, target.upstream_tag)
    if series.entries:
        _am(git, target, series)
    print(f"apply: {target.label}: {len(series.entries)} patch(es) from {series.label} on {target.branch}")
    return 0


def _require_clean(git: Git, target: Target) -> None:
    dirty = git.dirty_paths()
    if dirty:
        more = f" and {len(dirty) - 1} more" if len(dirty) > 1 else ""
        raise CarryError(
            f"upstream/{target.name} has uncommitted changes ({dirty[0]}{more}): commit them on "
            f"{target.branch} and run `carry export`, or stash them; nothing was changed"
        )


def _am(git: Git, target: Target, series: Series) -> None:
    paths = [str(series.directory / entry.filename) for entry in series.entries]
    result = git.run("am", "--3way", "--keep", "--committer-date-is-author-date", *paths, check=False)
    while result.returncode != 0:
        entry = _entry_in_progress(git, series)
        if entry.applied_upstream and "Patch is empty" in result.output:
            # An Applied-Upstream entry is recorded as an empty commit so the branch mirrors the series.
            result = git.run("am", "--allow-empty", check=False)
            continue
        where = ", ".join(_failed_paths(git, result.output)) or result.output.splitlines()[-1]
        raise CarryError(
            f"{series.label}/{entry.filename} does not apply to {target.label} ({where}): resolve "
            f"it in upstream/{target.name} and run `git am --continue`, then `carry export`; "
            "or `git am --abort`"
        )


def _entry_in_progress(git: Git, series: Series) -> Entry:
    index = int((git.repo / ".git" / "rebase-apply" / "next").read_text().strip())
    return series.entries[index - 1]


def _failed_paths(git: Git, output: str) -> list[str]:
    unmerged = git.out("diff", "--name-only", "--diff-filter=U").split()
    found = unmerged or _FAILED_PATH.findall(output)
    return list(dict.fromkeys(found))


def export(project: Project, target: Target, runner: Runner = run_subprocess) -> int:
    git = open_checkout(project, target, runner)
    if git.rev(target.branch) is None:
        raise CarryError(f"upstream/{target.name} has no branch {target.branch}: run `carry apply`")
    directory = project.patches_dir / target.name / target.version
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=directory.parent, prefix=f".{target.version}-export-"))
    try:
        names = export_branch(git, target, staging)
        if not names and not directory.exists():
            print(f"export: {target.label}: no patches on {target.branch}, nothing to write")
            return 0
        _copy_unmanaged(directory, staging)
        (staging / SERIES_FILE).write_text(render_series_file(names))
        old_revision, old_digest = read_revision(directory, f"patches/{target.name}/{target.version}")
        digest = series_digest(staging, names)
        revision = old_revision if digest == old_digest else old_revision + 1
        (staging / REVISION_FILE).write_text(render_revision_file(revision, digest))
        if _same_tree(staging, directory):
            print(f"export: {target.label}: patches/ unchanged (revision {revision})")
            return 0
        _replace_dir(directory, staging)
        print(
            f"export: {target.label}: wrote {len(names)} patch(es) to "
            f"patches/{target.name}/{target.version} (revision {revision})"
        )
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _managed(path: Path) -> bool:
    return path.name in (SERIES_FILE, REVISION_FILE) or path.suffix == ".patch"


def _copy_unmanaged(directory: Path, staging: Path) -> None:
    if directory.exists():
        for path in directory.iterdir():
            if path.is_file() and not _managed(path):
                shutil.copy2(path, staging / path.name)


def _same_tree(left: Path, right: Path) -> bool:
    if not right.exists():
        return False
    left_files = sorted(p.name for p in left.iterdir())
    right_files = sorted(p.name for p in right.iterdir())
    return left_files == right_files and all(
        (left / name).read_bytes() == (right / name).read_bytes() for name in left_files
    )


def _replace_dir(directory: Path, staging: Path) -> None:
    """Swap in the new series with two renames, so a crash leaves the old or the new one whole."""
    if not directory.exists():
        staging.rename(directory)
        return
    retired = directory.with_name(f".{directory.name}-retired")
    shutil.rmtree(retired, ignore_errors=True)
    directory.rename(retired)
    staging.rename(directory)
    shutil.rmtree(retired, ignore_errors=True)
