"""Patched artifacts: the official wheel (or sdist) with only the series' files replaced, a local
version ``<version>+carry.<N>``, a provenance record, and byte-for-byte reproducible output; how
each kind of file is repacked is in kinds/."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from packaging.version import Version

from .errors import CarryError
from .fetch import check_hash, download, sha256_of
from .files import naming, place
from .git import Git
from .kinds import PROVENANCE_FILE, Changes, Repack, kind_of
from .line_state import require_line_ready
from .pins import PinnedFile, select_file
from .progress import SILENT, Reporter, Stopwatch
from .project import Project, Target
from .runner import Runner, run_subprocess
from .series import Series

__all__ = ["PROVENANCE_FILE", "BuildResult", "BuiltArtifact", "artifact_name", "build", "build_all"]


def provenance(
    target: Target, series: Series, artifact: Path, sha256: str, local_version: str, changes: Changes
) -> bytes:
    record = {
        "name": target.name,
        "version": local_version,
        "upstream": {
            "version": target.version,
            "git_tag": target.release.git_tag,
            "file": artifact.name,
            "sha256": sha256,
        },
        "series": {
            "path": series.label,
            "revision": series.revision,
            "sha256": series.recorded_digest,
            "patches": [
                {
                    "file": entry.filename,
                    "sha256": entry.sha256,
                    "subject": entry.subject,
                    "upstream_status": entry.status_line,
                }
                for entry in series.entries
            ],
        },
        "changed_files": sorted([*changes.replaced, *changes.deleted]),
    }
    return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()


def artifact_name(source: Path, version: str, local_version: str) -> str:
    """The upstream file's name with ``local_version`` in place of ``version``, the rest (the
    name as the file spells it, the wheel tags) kept as they are."""
    kind = kind_of(source.name)
    try:
        _, file_version = kind.parse(source.name)
    except ValueError as exc:
        raise CarryError(f"{source.name} is not a {kind.name} file name ({exc}): fix the pin") from exc
    if file_version != Version(version):
        raise CarryError(f"{source.name} is version {file_version}, not the pinned {version}: fix the pin")
    return kind.renamed(source.name, local_version)


def collect_changes(project: Project, target: Target, git: Git) -> Changes:
    subdir = target.upstream.source_subdir
    prefix = f"{subdir}/" if subdir else ""
    rows = git.changed_paths(target.upstream_tag, target.branch, [subdir] if subdir else [])
    kept = [path for status, path in rows if status != "D"]
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=project.scratch_dir) as tmp:
        contents = git.read_files(target.branch, kept, Path(tmp))
    return Changes(
        replaced={path.removeprefix(prefix): data for path, data in contents.items()},
        deleted=frozenset(path.removeprefix(prefix) for status, path in rows if status == "D"),
    )


@dataclass(frozen=True)
class _Line:
    """What every artifact of one line is built from: read and checked once per line."""

    series: Series
    changes: Changes
    local_version: str


def _ready_line(project: Project, target: Target, runner: Runner) -> _Line:
    series = project.series(target.release, runner)
    git = require_line_ready(project, target, series, runner, "carry build")
    changes = collect_changes(project, target, git)
    return _Line(series, changes, f"{target.version}+carry.{series.revision}")


def build(
    project: Project, target: Target, runner: Runner = run_subprocess, pinned: PinnedFile | None = None
) -> Path:
    """Build the patched artifact from ``pinned`` (default: the pinned file for this interpreter)."""
    return _build_from(
        project, target, _ready_line(project, target, runner), pinned or select_file(target.release)
    )


def _build_from(project: Project, target: Target, line: _Line, pinned: PinnedFile) -> Path:
    source = project.downloads_dir / pinned.filename
    if not source.exists():
        raise CarryError(f"{pinned.filename} is not downloaded: run `carry fetch` first")
    check_hash(source, pinned, "cached download")
    final = project.dist_dir / artifact_name(source, target.version, line.local_version)
    record = provenance(target, line.series, source, pinned.sha256, line.local_version, line.changes)
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    # Built in build/, then copied into dist/ and renamed there: dist/ never holds a partial file,
    # even when it is on another filesystem than build/.
    handle, partial_name = tempfile.mkstemp(dir=project.scratch_dir, suffix=".partial")
    os.close(handle)
    partial = Path(partial_name)
    try:
        # A full build/ names the file being written, not "a file".
        with naming(partial):
            repack = Repack(target.name, target.version, line.local_version, line.changes, record)
            pinned.kind.repack(source, partial, repack)
        _place_in_dist(project, partial, final)
    finally:
        partial.unlink(missing_ok=True)
    return final


def _place_in_dist(project: Project, built: Path, final: Path) -> None:
    try:
        project.dist_dir.mkdir(parents=True, exist_ok=True)
        place(built, final)
    except OSError as exc:
        shown = final.relative_to(project.root) if final.is_relative_to(project.root) else final
        raise CarryError(
            f"cannot write {shown} ({exc.strerror or exc}): make {project.dist_dir} writable "
            "(or remove it) and run `carry build` again"
        ) from exc


@dataclass(frozen=True)
class BuiltArtifact:
    package: str
    line: str
    path: Path
    # The pinned upstream file it was built from, and whether pip would pick it for the
    # interpreter that built it (the artifact to install and test here).
    source: str
    for_this_interpreter: bool
    sha256: str
    seconds: float


@dataclass(frozen=True)
class BuildResult:
    artifacts: tuple[BuiltArtifact, ...]
    # Lines pinned newer than the one built, which have no series yet, per package.
    skipped_newer: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    exit_code: ClassVar[int] = 0

    def here(self, package: str) -> BuiltArtifact | None:
        """The artifact of ``package`` for the interpreter that built it."""
        return next((a for a in self.artifacts if a.package == package and a.for_this_interpreter), None)


def build_all(
    project: Project,
    targets: list[Target],
    runner: Runner = run_subprocess,
    all_platforms: bool = False,
    report: Reporter = SILENT,
) -> BuildResult:
    """Build each target's artifact; with ``all_platforms``, one from every file its release
    pins (each wheel's tags kept: the series changes pure-Python files only), downloading the
    pinned files not yet here, hash-checked, and nothing else."""
    built: list[BuiltArtifact] = []
    skipped: list[tuple[str, str, tuple[str, ...]]] = []
    for target in targets:
        if target.skipped_newer:
            skipped.append((target.name, target.version, tuple(target.skipped_newer)))
            report.step(
                f"build: {target.name} {', '.join(target.skipped_newer)} pinned without a series; building "
                f"{target.version}, the newest line with one (--upstream VERSION picks another)"
            )
        here = select_file(target.release)
        line = _ready_line(project, target, runner)
        for pinned in target.release.files if all_platforms else (here,):
            watch = Stopwatch()
            if all_platforms:
                download(project, target, pinned, runner, report)
            path = _build_from(project, target, line, pinned)
            report.step(f"build: {target.label}: {path.name} ({watch})")
            built.append(
                BuiltArtifact(
                    target.name,
                    target.version,
                    path,
                    pinned.filename,
                    pinned == here,
                    sha256_of(path),
                    round(watch.seconds, 1),
                )
            )
    return BuildResult(tuple(built), tuple(skipped))
