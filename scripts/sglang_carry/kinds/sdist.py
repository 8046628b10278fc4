"""Source distributions (.tar.gz): fetched from their pinned URL, unpacked without their top
folder, repacked reproducibly (PAX, mtime from the members, gzip without a name or time) with the
version in PKG-INFO and pyproject.toml set to the local one."""

from __future__ import annotations

import gzip
import io
import re
import tarfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from packaging.utils import parse_sdist_filename
from packaging.version import Version

from ..errors import CarryError
from ..progress import Reporter, megabytes
from ..runner import Runner
from .base import Repack, Wanted
from .wheel import METADATA_VERSION, PROVENANCE_FILE

SUFFIX = ".tar.gz"
_PYPROJECT_VERSION = re.compile(rb'^version\s*=\s*"[^"]*"', re.MULTILINE)
# Fits anywhere, after every wheel that fits (fit_here: lower is better).
ANYWHERE = 1 << 20


class Sdist:
    name = "sdist"
    pattern = "*" + SUFFIX

    def matches(self, filename: str) -> bool:
        return filename.endswith(SUFFIX)

    def parse(self, filename: str) -> tuple[str, Version]:
        name, version = parse_sdist_filename(filename)  # InvalidSdistFilename is a ValueError
        return str(name), version

    def renamed(self, filename: str, local_version: str) -> str:
        spelled_name = filename.removesuffix(SUFFIX).rpartition("-")[0]
        return f"{spelled_name}-{local_version}{SUFFIX}"

    def fit_here(self, filename: str) -> int | None:
        return ANYWHERE

    def download(self, wanted: Wanted, incoming: Path, runner: Runner, report: Reporter) -> None:
        _url_download(wanted, incoming, report)

    def extract(self, artifact: Path, root: Path) -> None:
        with tarfile.open(artifact) as sdist:
            for member in sdist.getmembers():
                parts = PurePosixPath(member.name).parts
                if len(parts) < 2:
                    continue
                member.name = str(PurePosixPath(*parts[1:]))
                sdist.extract(member, root, filter="data")

    def repack(self, source: Path, output: Path, repack: Repack) -> None:
        write_sdist(source, output, repack)

    def counterpart(self, pinned: str, candidates: Sequence[str]) -> str | None:
        return next((c for c in candidates if self.matches(c)), None)


def _url_download(wanted: Wanted, incoming: Path, report: Reporter) -> None:
    if not wanted.url:
        raise CarryError(f"{wanted.filename} has no url in {wanted.pin_file}: add one")
    try:
        with (
            urllib.request.urlopen(wanted.url, timeout=120) as response,
            (incoming / wanted.filename).open("wb") as out,
        ):
            total = int(response.headers.get("Content-Length") or 0)
            done = 0
            for block in iter(lambda: response.read(1 << 20), b""):
                out.write(block)
                done += len(block)
                of_total = f" of {megabytes(total)}" if total else ""
                report.meter(f"fetch: {wanted.filename}: {megabytes(done)}{of_total}")
            report.meter(f"fetch: {wanted.filename}: {megabytes(done)}", done=True)
    except OSError as exc:
        raise CarryError(f"cannot download {wanted.url} ({exc}): check the network") from exc


def write_sdist(source: Path, output: Path, repack: Repack) -> None:
    name, changes, local_version = repack.project, repack.changes, repack.local_version
    old_top, new_top = f"{name}-{repack.version}", f"{name}-{local_version}"
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
        _add_member(out, f"{new_top}/{PROVENANCE_FILE}", template, repack.provenance)


def _set_sdist_version(relative: str, data: bytes, local_version: str) -> bytes:
    if relative == "PKG-INFO" or relative.endswith(".egg-info/PKG-INFO"):
        return METADATA_VERSION.sub(f"Version: {local_version}".encode(), data, count=1)
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
