"""Where a line's ``carry/<version>`` branch stands against its series, and the checks every
command that trusts the branch makes first (no git operation in progress, nothing uncommitted,
on its upstream tag, reproducing the series byte for byte)."""

from __future__ import annotations

import enum
import os
import tempfile
from pathlib import Path

from .errors import CarryError
from .git import Git
from .project import Project, Target
from .runner import Runner
from .series import Series

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


# Branch states, as `branch_state` reports them.
class BranchState(enum.Enum):
    MISSING = "missing"
    NOT_DESCENDING = "not-descending"
    MATCHES = "matches"  # exporting it now reproduces the series byte for byte
    DIFFERS = "differs"
    UNKNOWN = "unknown"  # status only: a git operation in progress hides it


MISSING, NOT_DESCENDING, MATCHES, DIFFERS = (
    BranchState.MISSING,
    BranchState.NOT_DESCENDING,
    BranchState.MATCHES,
    BranchState.DIFFERS,
)


# --- Checks on the checkout, shared by every command that reads or rewrites a carry branch. ---


def open_checkout(project: Project, target: Target, runner: Runner, command: str) -> Git:
    """The checkout of ``target``, refused while a git operation there waits for the user."""
    git = Git(project.checkout(target.name), runner)
    if not git.exists() or git.rev(target.upstream_tag) is None:
        raise CarryError(f"no checkout of {target.label} in upstream/{target.name}: run `carry fetch` first")
    require_no_operation(git, target, command)
    return git


def require_no_operation(git: Git, target: Target, command: str) -> None:
    operation = git.operation_in_progress()
    if operation is not None:
        raise CarryError(
            f"{operation.describe(f'upstream/{target.name}')}, "
            f"then run `{command}` again; nothing was changed"
        )


def require_clean(git: Git, target: Target, command: str) -> None:
    dirty = git.dirty_paths()
    if dirty:
        more = f" and {len(dirty) - 1} more" if len(dirty) > 1 else ""
        raise CarryError(
            f"upstream/{target.name} has uncommitted changes ({dirty[0]}{more}): commit them on "
            f"{target.branch} or stash them, then run `{command}` again; nothing was changed"
        )


def require_branch(git: Git, target: Target) -> None:
    if git.rev(target.branch) is None:
        raise CarryError(f"upstream/{target.name} has no branch {target.branch}: run `carry apply`")


def require_descends(git: Git, target: Target, command: str) -> None:
    """The branch must contain its upstream tag; otherwise its diff against the tag would also
    undo everything upstream changed since whatever the branch is really based on."""
    if git.is_ancestor(target.upstream_tag, target.branch):
        return
    base = git.nearest_tag(target.branch, "upstream/*")
    how = (
        f"it is based on {base}: `git rebase --onto {target.upstream_tag} {base} {target.branch}`"
        if base
        else f"rebase it onto {target.upstream_tag}"
    )
    raise CarryError(
        f"{target.branch} in upstream/{target.name} does not descend from {target.upstream_tag} ({how}, "
        f"or rebuild it from patches/ with `carry apply`), then run `{command}` again; nothing was changed"
    )


def _writable(scratch: Path) -> Path | None:
    """build/, where the tool keeps its scratch files; None (the system's temporary folder) when
    it cannot be written, so that status, which only reads, still runs in a read-only checkout."""
    try:
        scratch.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return scratch if os.access(scratch, os.W_OK) else None


def branch_state(git: Git, target: Target, series: Series, scratch: Path) -> BranchState:
    """Where ``target.branch`` stands against the series."""
    if git.rev(target.branch) is None:
        return MISSING
    if not git.is_ancestor(target.upstream_tag, target.branch):
        return NOT_DESCENDING
    with tempfile.TemporaryDirectory(dir=_writable(scratch), prefix="compare-") as tmp:
        names = export_branch(git, target, Path(tmp))
        if names != [entry.filename for entry in series.entries]:
            return DIFFERS
        same = all(
            (Path(tmp) / name).read_bytes() == (series.directory / name).read_bytes() for name in names
        )
    return MATCHES if same else DIFFERS


def require_line_ready(project: Project, target: Target, series: Series, runner: Runner, command: str) -> Git:
    """Everything `carry build` and `carry verify` need before they trust the branch: a series
    (or a line that carries nothing on purpose), recorded, and a branch on the right upstream
    that reproduces it exactly."""
    series.require_something_to_carry()
    series.require_current_revision()
    git = open_checkout(project, target, runner, command)
    # What is built and tested is the branch: an uncommitted edit would be left out without a word.
    require_clean(git, target, command)
    state = branch_state(git, target, series, project.scratch_dir)
    if state == MISSING:
        require_branch(git, target)
    if state == NOT_DESCENDING:
        require_descends(git, target, command)
    if state == DIFFERS:
        raise CarryError(
            f"{target.branch} in upstream/{target.name} differs from {series.label}: "
            "run `carry export` to keep the branch, or `carry apply` to rebuild it from patches/"
        )
    return git


# --- the branch as patch files ---


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
            text = git.run("log", "-1", f"--format={EMPTY_COMMIT_FORMAT}", commit).stdout.strip()
            path.write_bytes((text + "\n").encode("utf-8", "surrogateescape"))
    return [path.name for path in paths]
