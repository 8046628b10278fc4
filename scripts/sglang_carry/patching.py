"""Move a series between patches/ and the checkout's ``carry/<version>`` branch, with git am and
git format-patch doing the work, and the checks that keep either side from losing work."""

from __future__ import annotations

import enum
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .errors import CarryError
from .files import recover_folder, replace_folder
from .git import Git, summarize_git_output
from .line_state import (
    MATCHES,
    branch_state,
    export_branch,
    open_checkout,
    require_branch,
    require_clean,
    require_descends,
)
from .progress import Stopwatch
from .project import Project, Target
from .runner import Runner, run_subprocess
from .series import (
    CARRIES_NOTHING_FILE,
    REVISION_FILE,
    SERIES_FILE,
    Series,
    SeriesFolder,
    contents_digest,
    read_series_folder,
    render_revision_file,
    render_series_file,
    revision_digest,
)

# --- patches/ -> branch ---


class ApplyState(enum.Enum):
    ALREADY_CARRIES = "already-carries"
    APPLIED = "applied"
    NO_SERIES = "no-series"  # the branch is the pristine tag, for the ported patches


@dataclass(frozen=True)
class Applied:
    package: str
    line: str
    branch: str
    series: str
    state: ApplyState
    patches: int
    # The branch's previous tip, kept under this name because it was not the series.
    backup: str | None
    seconds: float
    exit_code: ClassVar[int] = 0

    def describe(self) -> list[str]:
        """What happened, in the words `carry` shows."""
        label = f"{self.package} {self.line}"
        if self.state is ApplyState.ALREADY_CARRIES:
            return [f"apply: {label}: {self.branch} already carries {self.series}"]
        lines = [f"apply: kept the previous {self.branch} as {self.backup}"] if self.backup else []
        if self.state is ApplyState.NO_SERIES:
            lines.append(
                f"apply: {label}: {self.series} has no series yet; {self.branch} is upstream/{self.line}: "
                "commit the ported patches there, then `carry export`"
            )
        done = f"{self.patches} patch(es) from {self.series} on {self.branch} ({self.seconds:.1f} s)"
        lines.append(f"apply: {label}: {done}")
        return lines


def apply(project: Project, target: Target, runner: Runner = run_subprocess) -> Applied:
    watch = Stopwatch()
    git = open_checkout(project, target, runner, "carry apply")
    series = project.series(target.release, runner)
    # Even when the branch already carries the series: an uncommitted edit is in no patch, and
    # saying "already carries" would let it go unnoticed.
    require_clean(git, target, "carry apply")
    old_tip = git.rev(target.branch)

    def applied(state: ApplyState, backup: str | None = None) -> Applied:
        return Applied(
            target.name,
            target.version,
            target.branch,
            series.label,
            state,
            len(series.entries),
            backup,
            round(watch.seconds, 1),
        )

    if old_tip and branch_state(git, target, series, project.scratch_dir) == MATCHES:
        if git.current_branch() != target.branch:
            git.run("checkout", "--quiet", target.branch)
        return applied(ApplyState.ALREADY_CARRIES)
    backup = None
    if old_tip and old_tip != git.rev(target.upstream_tag):
        backup = f"carry-backup/{target.version}/{old_tip[:12]}"
        git.run("branch", "--force", backup, old_tip)
    _record_applied(git, target, series)
    git.run("checkout", "--quiet", "-B", target.branch, target.upstream_tag)
    if series.entries:
        _am(git, target, series)
    elif series.carries_nothing is None:
        return applied(ApplyState.NO_SERIES, backup)
    return applied(ApplyState.APPLIED, backup)


def _applied_record(git: Git, target: Target) -> Path:
    return git.state_file(f"applied-{target.version}")


def _record_applied(git: Git, target: Target, series: Series) -> None:
    """Remember which files the branch is being rebuilt from: `carry export` then knows that a
    hand edit of those files is already on the branch and that writing the branch loses nothing."""
    record = _applied_record(git, target)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(series.digest() + "\n")


def _applied_digest(git: Git, target: Target) -> str | None:
    record = _applied_record(git, target)
    return record.read_text().strip() if record.exists() else None


def _am(git: Git, target: Target, series: Series) -> None:
    paths = [str(series.directory / entry.filename) for entry in series.entries]
    # --empty=keep records an Applied-Upstream entry (a patch with no diff) as an empty commit, so
    # the branch mirrors the series one commit per entry without reading git's messages.
    result = git.run(
        "am", "--3way", "--keep", "--committer-date-is-author-date", "--empty=keep", *paths, check=False
    )
    if result.returncode == 0:
        return
    if git.operation_in_progress() is None:
        raise CarryError(f"git am failed in {git.repo}: {summarize_git_output(result.output)}")
    applied = len(git.commits(target.upstream_tag, "HEAD"))
    entry = series.entries[min(applied, len(series.entries) - 1)]
    files = git.unmerged_paths() or git.current_patch_paths()
    where = ", ".join(files) if files else "see `git am --show-current-patch=diff`"
    corrupt = next((line.strip() for line in result.output.splitlines() if "corrupt patch" in line), None)
    if corrupt is not None:
        # Not a conflict to resolve: the file itself is broken (truncated, hand-edited).
        git.run("am", "--abort", check=False)
        raise CarryError(
            f"{series.label}/{entry.filename} is broken (git: {corrupt}): restore it with "
            f"`git checkout -- {series.label}/{entry.filename}`, or write it again with `carry export` "
            "(the `git am` was aborted; a previous branch is kept as carry-backup/...)"
        )
    raise CarryError(
        f"{series.label}/{entry.filename} does not apply to {target.label} ({where}): resolve it in "
        f"upstream/{target.name} and run `git am --continue`, then `carry export`; or `git am --abort` "
        f"and fix {series.label}/{entry.filename}"
    )


# --- branch -> patches/ ---


class ExportState(enum.Enum):
    NOTHING_TO_WRITE = "nothing-to-write"  # no commits, and no series folder to empty
    UNCHANGED = "unchanged"
    WROTE = "wrote"


@dataclass(frozen=True)
class Exported:
    package: str
    line: str
    branch: str
    folder: str
    state: ExportState
    patches: int = 0
    revision: int | None = None
    # Files in the folder that no series line names: left in place, for the user to decide.
    strays: tuple[str, ...] = ()
    exit_code: ClassVar[int] = 0

    def describe(self) -> list[str]:
        """What happened, in the words `carry` shows."""
        label = f"{self.package} {self.line}"
        if self.state is ExportState.NOTHING_TO_WRITE:
            return [f"export: {label}: no patches on {self.branch}, nothing to write"]
        lines = [
            f"export: {self.folder}/{stray} is not in the series and was left in place: "
            f"commit it on {self.branch} and export, or delete it"
            for stray in self.strays
        ]
        if self.state is ExportState.UNCHANGED:
            return [*lines, f"export: {label}: patches/ unchanged (revision {self.revision})"]
        return [
            *lines,
            f"export: {label}: wrote {self.patches} patch(es) to {self.folder} (revision {self.revision})",
        ]


def export(
    project: Project, target: Target, force: bool = False, runner: Runner = run_subprocess
) -> Exported:
    git = open_checkout(project, target, runner, "carry export")
    require_branch(git, target)
    require_clean(git, target, "carry export")
    require_descends(git, target, "carry export")
    # An export killed while it replaced the folder left it beside it; that export is dead (the
    # CLI holds the checkout's lock), so its old folder comes back before it is read.
    recover_folder(project.patches_dir / target.name / target.version)
    folder = read_series_folder(project.patches_dir, target.name, target.version)
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=project.scratch_dir, prefix="export-") as tmp:
        names = export_branch(git, target, Path(tmp))
        exported = {name: (Path(tmp) / name).read_bytes() for name in names}
    if folder.carries_nothing is not None and names:
        raise CarryError(
            f"{folder.label}/{CARRIES_NOTHING_FILE} says {target.label} carries nothing, but "
            f"{target.branch} has {len(names)} commit(s): delete that file if the line carries patches "
            "now; nothing was written"
        )
    if not names and (not folder.exists or folder.carries_nothing is not None):
        return Exported(
            target.name, target.version, target.branch, folder.label, ExportState.NOTHING_TO_WRITE
        )
    _refuse_overwriting_strays(folder, names)
    if not force:
        _refuse_losing_work(folder, target, names, exported, _applied_digest(git, target))
    content = contents_digest(exported, names)
    unchanged = revision_digest(content, folder.revision) == folder.recorded_digest
    revision = folder.revision if unchanged else folder.revision + 1
    changed = _write_series(
        folder, names, exported, render_revision_file(revision, revision_digest(content, revision))
    )
    return Exported(
        target.name,
        target.version,
        target.branch,
        folder.label,
        ExportState.WROTE if changed else ExportState.UNCHANGED,
        len(names),
        revision,
        tuple(folder.strays),
    )


def _refuse_overwriting_strays(folder: SeriesFolder, names: list[str]) -> None:
    clashes = [name for name in names if name in folder.strays]
    if clashes:
        raise CarryError(
            f"{folder.label}/{clashes[0]} is not in {folder.label}/series and exporting would overwrite it: "
            f"move it out of {folder.label}, then export again; nothing was written"
        )


def _refuse_losing_work(
    folder: SeriesFolder, target: Target, names: list[str], exported: dict[str, bytes], applied: str | None
) -> None:
    """Refuse an export that would throw away patches: a branch that lost commits, or files
    someone edited by hand that the branch does not carry."""
    dropped = [name for name in folder.listed if name not in names]
    if len(names) < len(folder.listed):
        raise CarryError(
            f"exporting {target.branch} would shrink {folder.label} from {len(folder.listed)} to "
            f"{len(names)} patch(es) ({dropped[0]} would go): if the branch lost commits (after "
            "`git am --abort`, say), `carry apply` rebuilds it from the files; to drop patches on "
            "purpose, `carry export --force`; nothing was written"
        )
    if not folder.edited_since_export() or (applied is not None and applied == folder.digest()):
        return
    overwritten = [name for name in folder.listed if exported.get(name) != folder.contents.get(name)]
    if not overwritten and list(folder.listed) == names:
        return
    which = overwritten[0] if overwritten else SERIES_FILE
    raise CarryError(
        f"{folder.label} was edited by hand since revision {folder.revision} was recorded, and exporting "
        f"{target.branch} would overwrite {which}: `carry apply` rebuilds {target.branch} from the files "
        "(keeps their version), `carry export --force` keeps the branch's; nothing was written"
    )


def _write_series(
    folder: SeriesFolder, names: list[str], exported: dict[str, bytes], revision_text: str
) -> bool:
    """Make the folder hold the exported patches, their series and revision, and whatever else it
    held that the previous series did not list (REBASE.md, strays), written as one unit: a fault
    part-way (a full disk) leaves it as it was. Returns whether anything changed."""
    wanted = {name: exported[name] for name in names}
    wanted[SERIES_FILE] = render_series_file(names).encode()
    wanted[REVISION_FILE] = revision_text.encode()
    on_disk = folder.directory.iterdir() if folder.exists else iter(())
    present = {path.name: path.read_bytes() for path in on_disk if path.is_file()}
    kept = {name: data for name, data in present.items() if name not in wanted and name not in folder.listed}
    files = kept | wanted
    if files == present:
        return False
    replace_folder(folder.directory, files)
    return True
