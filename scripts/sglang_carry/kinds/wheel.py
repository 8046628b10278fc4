"""Wheels: fetched with pip (exactly the pinned tags, whatever interpreter runs the tool), unpacked
without their dist-info, repacked with a new dist-info (version, RECORD, provenance)."""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import re
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from packaging.tags import Tag, sys_tags
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from ..errors import CarryError
from ..progress import Reporter
from ..runner import Runner
from .base import Repack, Wanted
from .unpack import inside

PROVENANCE_FILE = "sglang_carry_provenance.json"
METADATA_VERSION = re.compile(rb"^Version: .*$", re.MULTILINE)


class Wheel:
    name = "wheel"
    pattern = "*.whl"

    def matches(self, filename: str) -> bool:
        return filename.endswith(".whl")

    def parse(self, filename: str) -> tuple[str, Version]:
        name, version, _, _ = parse_wheel_filename(filename)  # InvalidWheelFilename is a ValueError
        return str(name), version

    def renamed(self, filename: str, local_version: str) -> str:
        spelled_name, _version, rest = filename.split("-", 2)
        return f"{spelled_name}-{local_version}-{rest}"

    def fit_here(self, filename: str) -> int | None:
        tags = tags_of(filename)
        return next((rank for rank, tag in enumerate(sys_tags()) if tag in tags), None)

    def download(self, wanted: Wanted, incoming: Path, runner: Runner, report: Reporter) -> None:
        _pip_download(wanted, incoming, runner)

    def extract(self, artifact: Path, root: Path) -> None:
        with zipfile.ZipFile(artifact) as wheel:
            for info in wheel.infolist():
                top = PurePosixPath(info.filename).parts[0]
                if top.endswith(".dist-info") or info.is_dir():
                    continue
                destination = inside(root, info.filename, artifact)
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_bytes(wheel.read(info))
                mode = (info.external_attr >> 16) & 0o777
                if mode & 0o111:
                    destination.chmod(0o755)

    def repack(self, source: Path, output: Path, repack: Repack) -> None:
        write_wheel(source, output, repack)
        verify_wheel_record(output)

    def counterpart(self, pinned: str, candidates: Sequence[str]) -> str | None:
        """The wheel for the same interpreter, ABI and platform (the lowest glibc when several fit,
        as it runs on the most machines)."""
        wheels = [c for c in candidates if self.matches(c)]
        same_tags = [c for c in wheels if tags_of(c) == tags_of(pinned)]
        if same_tags:
            return same_tags[0]
        kind = _wheel_kind(pinned)
        fits = [c for c in wheels if _wheel_kind(c) == kind]
        return min(fits, key=_glibc) if fits else None


def tags_of(filename: str) -> frozenset[Tag]:
    return parse_wheel_filename(filename)[3]


_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(.+)$")


def _platform_kind(platform: str) -> str:
    """A wheel platform without its glibc version: a new release may raise manylinux_2_28 to 2_34."""
    match = _MANYLINUX.match(platform)
    return f"manylinux_*_{match.group(3)}" if match else platform


def _wheel_kind(filename: str) -> frozenset[tuple[str, str, str]]:
    tags: frozenset[Tag] = parse_wheel_filename(filename)[3]
    return frozenset((t.interpreter, t.abi, _platform_kind(t.platform)) for t in tags)


def _glibc(filename: str) -> tuple[int, int]:
    """The oldest glibc the wheel needs; (0, 0) when it names none."""
    found = [m for t in parse_wheel_filename(filename)[3] if (m := _MANYLINUX.match(t.platform))]
    return min(((int(m.group(1)), int(m.group(2))) for m in found), default=(0, 0))


def pip_download_args(filename: str, dest: Path, name: str, version: str) -> list[str]:
    """pip arguments that fetch exactly this wheel, whatever the running interpreter is."""
    _, _, _, tags = parse_wheel_filename(filename)
    tag = sorted(tags, key=str)[0]
    return [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--platform",
        tag.platform,
        "--implementation",
        tag.interpreter[:2],
        "--python-version",
        tag.interpreter[2:],
        "--abi",
        tag.abi,
        "--dest",
        str(dest),
        f"{name}=={version}",
    ]


def _pip_download(wanted: Wanted, incoming: Path, runner: Runner) -> None:
    # On a terminal pip draws its own progress bar; elsewhere (CI logs) its output is kept for the
    # error line instead.
    interactive = sys.stderr.isatty()
    args = pip_download_args(wanted.filename, incoming, wanted.project, wanted.version)
    result = runner(args, capture=not interactive)
    if result.returncode != 0:
        last = result.output.splitlines()[-1] if result.output else "pip's message is above"
        if "No matching distribution" in result.output or "from versions: none" in result.output:
            # pip reached its index, which has no such file: no network problem to look for.
            raise CarryError(
                f"pip found no {wanted.filename} on its index ({last}): check the pin's version and "
                f"file name in {wanted.pin_file}, and which index pip uses (pip config list)"
            )
        raise CarryError(f"pip could not download {wanted.filename} ({last}): check the network and the pin")


def record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def _wheel_info(arcname: str, template: zipfile.ZipInfo) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(arcname, date_time=template.date_time)
    info.external_attr = template.external_attr or (0o644 << 16)
    info.create_system = 3
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_wheel(source: Path, output: Path, repack: Repack) -> None:
    local_version, changes, provenance_bytes = repack.local_version, repack.changes, repack.provenance
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
                        data = METADATA_VERSION.sub(f"Version: {local_version}".encode(), data, count=1)
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
