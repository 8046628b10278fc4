"""Patched artifacts: the official wheel (or sdist) with only the series' files replaced, a local
version ``<version>+carry.<N>``, a provenance record, and byte-for-byte reproducible output."""

from __future__ import annotations

import base64
import csv
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import ClassVar

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import Version

from .errors import CarryError
from .fetch import check_hash, download, sha256_of
from .files import naming, place
from .git import Git
from .patching import require_line_ready
from .pins import PinnedFile, select_file
from .progress import SILENT, Reporter, Stopwatch
from .project import Project, Target
from .runner import Runner, run_subprocess
from .series import Series

PROVENANCE_FILE = "sglang_carry_provenance.json"
_METADATA_VERSION = re.compile(rb"^Version: .*$", re.MULTILINE)
_PYPROJECT_VERSION = re.compile(rb'^version\s*=\s*"[^"]*"', re.MULTILINE)


@dataclass(frozen=True)
class Changes:
    """Files the series changes, as paths inside the artifact."""

    replaced: dict[str, bytes]
    deleted: frozenset[str]


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


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _wheel_info(arcname: str, template: zipfile.ZipInfo) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(arcname, date_time=template.date_time)
    info.external_attr = template.external_attr or (0o644 << 16)
    info.create_system = 3
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_wheel(
    source: Path, output: Path, local_version: str, changes: Changes, provenance_bytes: bytes
) -> None:
    with zipfile.ZipFile(source) as src, zipfile.ZipFile(output, "w") as out:
        infos = [info for info in src.infolist() if not info.is_dir()]
        old_dist_info = _dist_info_dir(infos, source)
        new_dist_info = (
            f"{old_dist_info.removesuffix('.dist-info').rsplit('-', 1)[0]}-{local_version}.dist-info"
        )
        stamp = next(i for i in infos if i.filename == f"{old_dist_info}/METADATA")
        rows: list[tuple[str, str, str]] = []

        def add(arcname: str, data: bytes, template: zipfile.ZipInfo) -> None:
            out.writestr(_wheel_info(arcname, template), data, compresslevel=6)
            rows.append((arcname, record_hash(data), str(len(data))))

        missing = set(changes.replaced)
        dist_info_files: list[tuple[str, bytes, zipfile.ZipInfo]] = []
        for info in infos:
            arcname = info.filename
            if arcname.startswith(f"{old_dist_info}/"):
                inner = arcname[len(old_dist_info) + 1 :]
                if inner != "RECORD":
                    data = src.read(info)
                    if inner == "METADATA":
                        data = _METADATA_VERSION.sub(f"Version: {local_version}".encode(), data, count=1)
                    dist_info_files.append((f"{new_dist_info}/{inner}", data, info))
                continue
            if arcname in changes.deleted:
                continue
            missing.discard(arcname)
            replaced = changes.replaced.get(arcname)
            add(arcname, src.read(info) if replaced is None else replaced, info)
        for arcname in sorted(missing):
            add(arcname, changes.replaced[arcname], stamp)
        for arcname, data, info in dist_info_files:
            add(arcname, data, info)
        add(f"{new_dist_info}/{PROVENANCE_FILE}", provenance_bytes, stamp)
        record_name = f"{new_dist_info}/RECORD"
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerows([*rows, (record_name, "", "")])
        out.writestr(_wheel_info(record_name, stamp), buffer.getvalue().encode(), compresslevel=6)


def _dist_info_dir(infos: list[zipfile.ZipInfo], source: Path) -> str:
    for info in infos:
        parts = PurePosixPath(info.filename).parts
        if len(parts) == 2 and parts[0].endswith(".dist-info") and parts[1] == "METADATA":
            return parts[0]
    raise CarryError(f"{source.name} has no .dist-info/METADATA: is it a wheel?")


def verify_wheel_record(path: Path) -> int:
    """Check every file against RECORD (pip does not); returns how many entries were checked."""
    with zipfile.ZipFile(path) as wheel:
        names = [i.filename for i in wheel.infolist() if not i.is_dir()]
        record_name = next((n for n in names if n.endswith(".dist-info/RECORD")), None)
        if record_name is None:
            raise CarryError(f"{path.name} has no RECORD")
        rows = list(csv.reader(io.StringIO(wheel.read(record_name).decode())))
        listed = {row[0] for row in rows}
        unlisted = sorted(set(names) - listed)
        if unlisted:
            raise CarryError(f"{path.name}: {unlisted[0]} is not in RECORD")
        for arcname, digest, size in rows:
            if arcname == record_name:
                continue
            data = wheel.read(arcname)
            if digest != record_hash(data) or size != str(len(data)):
                raise CarryError(f"{path.name}: RECORD hash of {arcname} does not match its content")
        return len(rows)


def write_sdist(
    source: Path,
    output: Path,
    name: str,
    version: str,
    local_version: str,
    changes: Changes,
    provenance_bytes: bytes,
) -> None:
    old_top, new_top = f"{name}-{version}", f"{name}-{local_version}"
    with (
        tarfile.open(source) as src,
        output.open("wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as compressed,
        tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as out,
    ):
        stamp = 0
        missing = set(changes.replaced)
        for member in src.getmembers():
            parts = PurePosixPath(member.name).parts
            if parts[0] != old_top:
                raise CarryError(f"{source.name}: {member.name} is outside {old_top}/")
            relative = str(PurePosixPath(*parts[1:])) if len(parts) > 1 else ""
            if relative in changes.deleted:
                continue
            stamp = max(stamp, int(member.mtime))
            data = None
            if member.isfile():
                missing.discard(relative)
                handle = src.extractfile(member)
                assert handle is not None
                replaced = changes.replaced.get(relative)
                data = handle.read() if replaced is None else replaced
                data = _set_sdist_version(relative, data, local_version)
            _add_member(out, f"{new_top}/{relative}".rstrip("/"), member, data)
        template = tarfile.TarInfo()
        template.mtime = stamp
        template.mode = 0o644
        for relative in sorted(missing):
            _add_member(out, f"{new_top}/{relative}", template, changes.replaced[relative])
        _add_member(out, f"{new_top}/{PROVENANCE_FILE}", template, provenance_bytes)


def _set_sdist_version(relative: str, data: bytes, local_version: str) -> bytes:
    if relative == "PKG-INFO" or relative.endswith(".egg-info/PKG-INFO"):
        return _METADATA_VERSION.sub(f"Version: {local_version}".encode(), data, count=1)
    if relative == "pyproject.toml":
        return _PYPROJECT_VERSION.sub(f'version = "{local_version}"'.encode(), data, count=1)
    return data


def _add_member(out: tarfile.TarFile, arcname: str, template: tarfile.TarInfo, data: bytes | None) -> None:
    info = tarfile.TarInfo(arcname)
    info.mtime = template.mtime
    info.mode = template.mode
    info.type = template.type
    info.linkname = template.linkname
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    if data is None:
        out.addfile(info)
        return
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))


def artifact_name(source: Path, version: str, local_version: str) -> str:
    """The upstream file's name with ``local_version`` in place of ``version``, the rest (the
    name as the file spells it, the wheel tags) kept as they are."""
    try:
        if source.name.endswith(".whl"):
            file_version = parse_wheel_filename(source.name)[1]
            spelled_name, _, rest = source.name.split("-", 2)
            renamed = f"{spelled_name}-{local_version}-{rest}"
        else:
            file_version = parse_sdist_filename(source.name)[1]
            spelled_name = source.name.removesuffix(".tar.gz").rpartition("-")[0]
            renamed = f"{spelled_name}-{local_version}.tar.gz"
    except (InvalidWheelFilename, InvalidSdistFilename) as exc:
        raise CarryError(f"{source.name} is not a wheel or sdist file name ({exc}): fix the pin") from exc
    if file_version != Version(version):
        raise CarryError(f"{source.name} is version {file_version}, not the pinned {version}: fix the pin")
    return renamed


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


def build(
    project: Project, target: Target, runner: Runner = run_subprocess, pinned: PinnedFile | None = None
) -> Path:
    """Build the patched artifact from ``pinned`` (default: the pinned file for this interpreter)."""
    series = project.series(target.release, runner)
    git = require_line_ready(project, target, series, runner, "carry build")
    pinned = pinned or select_file(target.release)
    source = project.downloads_dir / pinned.filename
    if not source.exists():
        raise CarryError(f"{pinned.filename} is not downloaded: run `carry fetch` first")
    check_hash(source, pinned, "cached download")
    local_version = f"{target.version}+carry.{series.revision}"
    final = project.dist_dir / artifact_name(source, target.version, local_version)
    changes = collect_changes(project, target, git)
    record = provenance(target, series, source, pinned.sha256, local_version, changes)
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    # Built in build/, then copied into dist/ and renamed there: dist/ never holds a partial file,
    # even when it is on another filesystem than build/.
    handle, partial_name = tempfile.mkstemp(dir=project.scratch_dir, suffix=".partial")
    os.close(handle)
    partial = Path(partial_name)
    try:
        # A full build/ names the file being written, not "a file".
        with naming(partial):
            if source.name.endswith(".whl"):
                write_wheel(source, partial, local_version, changes, record)
                verify_wheel_record(partial)
            else:
                write_sdist(source, partial, target.name, target.version, local_version, changes, record)
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
        for pinned in target.release.files if all_platforms else (here,):
            watch = Stopwatch()
            if all_platforms:
                download(project, target, pinned, runner, report)
            path = build(project, target, runner, pinned)
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
