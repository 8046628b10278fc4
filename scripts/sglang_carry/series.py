"""A patch series: ``patches/<name>/<version>/series`` plus the patch files it lists."""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CarryError

SERIES_FILE = "series"
REVISION_FILE = "revision"
SERIES_HEADER = (
    "# Patch order for this upstream line. Written by `carry export`; edit the branch, not this.\n"
)
STATUSES = ("Pending", "Submitted", "Backport", "Inappropriate", "Applied-Upstream")
APPLIED_UPSTREAM = "Applied-Upstream"
_TRAILER = re.compile(r"^([A-Za-z0-9][A-Za-z0-9-]*):\s*(.*)$")


@dataclass(frozen=True)
class Entry:
    filename: str
    subject: str
    trailers: dict[str, list[str]] = field(hash=False)
    has_diff: bool
    sha256: str

    @property
    def status(self) -> str:
        values = self.trailers.get("Upstream-Status", [""])
        return values[0].split(" ", 1)[0]

    @property
    def status_line(self) -> str:
        return self.trailers.get("Upstream-Status", [""])[0]

    @property
    def tests(self) -> list[str]:
        return [test for value in self.trailers.get("Test", []) for test in value.split()]

    @property
    def applied_upstream(self) -> bool:
        return self.status == APPLIED_UPSTREAM


@dataclass(frozen=True)
class Series:
    name: str
    version: str
    directory: Path
    entries: tuple[Entry, ...]
    revision: int
    recorded_digest: str | None

    @property
    def label(self) -> str:
        return f"patches/{self.name}/{self.version}"

    def digest(self) -> str:
        return series_digest(self.directory, [e.filename for e in self.entries])

    def revision_is_current(self) -> bool:
        if not self.entries and self.recorded_digest is None:
            return self.revision == 0
        return self.recorded_digest == self.digest()

    def require_current_revision(self) -> None:
        if not self.revision_is_current():
            raise CarryError(
                f"{self.label} changed since revision {self.revision} was recorded: "
                "run `carry export` to record the new revision"
            )


def series_digest(directory: Path, filenames: list[str]) -> str:
    """Hash of everything that defines the series; the revision grows whenever it changes."""
    digest = hashlib.sha256()
    digest.update(render_series_file(filenames).encode())
    for filename in filenames:
        digest.update(filename.encode() + b"\0")
        digest.update(hashlib.sha256((directory / filename).read_bytes()).digest())
    return digest.hexdigest()


def render_series_file(filenames: list[str]) -> str:
    return SERIES_HEADER + "".join(f"{name}\n" for name in filenames)


def render_revision_file(revision: int, digest: str) -> str:
    return (
        "# The N in <version>+carry.<N>. `carry export` raises it whenever the series changes,\n"
        "# so two different builds never share a version.\n"
        f"revision = {revision}\n"
        f'series-sha256 = "{digest}"\n'
    )


def parse_patch(filename: str, text: str) -> Entry:
    lines = text.splitlines()
    subject_parts: list[str] = []
    index = 0
    in_subject = False
    while index < len(lines) and lines[index].strip():
        line = lines[index]
        if line.startswith("Subject:"):
            subject_parts = [line[len("Subject:") :].strip()]
            in_subject = True
        elif in_subject and line[:1] in (" ", "\t"):
            subject_parts.append(line.strip())
        else:
            in_subject = False
        index += 1
    body: list[str] = []
    for line in lines[index:]:
        if line == "---" or line.startswith("diff --git "):
            break
        body.append(line)
    has_diff = any(line.startswith("diff --git ") for line in lines)
    return Entry(
        filename=filename,
        subject=" ".join(subject_parts),
        trailers=parse_trailers(body),
        has_diff=has_diff,
        sha256=hashlib.sha256(text.encode()).hexdigest(),
    )


def parse_trailers(body: list[str]) -> dict[str, list[str]]:
    """Trailers of the last paragraph of a commit message, as git interpret-trailers sees them."""
    paragraphs: list[list[str]] = [[]]
    for line in body:
        if line.strip():
            paragraphs[-1].append(line)
        elif paragraphs[-1]:
            paragraphs.append([])
    last = next((p for p in reversed(paragraphs) if p), [])
    trailers: dict[str, list[str]] = {}
    key = None
    for line in last:
        match = _TRAILER.match(line)
        if match:
            key = match.group(1)
            trailers.setdefault(key, []).append(match.group(2).strip())
        elif key is not None and line[:1] in (" ", "\t"):
            trailers[key][-1] = f"{trailers[key][-1]} {line.strip()}"
        else:
            return {}
    return trailers


def read_series_names(series_path: Path) -> list[str]:
    names = []
    for raw in series_path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def load_series(patches_dir: Path, name: str, version: str) -> Series:
    directory = patches_dir / name / version
    label = f"patches/{name}/{version}"
    series_path = directory / SERIES_FILE
    if not series_path.exists():
        if directory.exists() and any(directory.glob("*.patch")):
            raise CarryError(f"{label} has patch files but no series file: list them in {label}/series")
        return Series(name, version, directory, (), 0, None)
    names = read_series_names(series_path)
    seen: set[str] = set()
    entries = []
    for filename in names:
        if filename in seen:
            raise CarryError(f"{label}/series lists {filename} twice: keep one line for it")
        seen.add(filename)
        path = directory / filename
        if not path.is_file():
            raise CarryError(
                f"{label}/series lists {filename}, which is not there: restore it or drop the line"
            )
        entry = parse_patch(filename, path.read_text())
        _check_entry(label, entry)
        entries.append(entry)
    strays = sorted(p.name for p in directory.glob("*.patch") if p.name not in seen)
    if strays:
        raise CarryError(
            f"{label}/{strays[0]} is not listed in {label}/series: add it to the series or delete it"
        )
    revision, digest = read_revision(directory, label)
    return Series(name, version, directory, tuple(entries), revision, digest)


def _check_entry(label: str, entry: Entry) -> None:
    where = f"{label}/{entry.filename}"
    if entry.status not in STATUSES:
        raise CarryError(
            f"{where}: Upstream-Status trailer is '{entry.status_line}', "
            f"expected one of {', '.join(STATUSES)}"
        )
    if entry.applied_upstream and entry.has_diff:
        raise CarryError(f"{where}: an {APPLIED_UPSTREAM} entry carries no diff; drop the diff")
    if not entry.applied_upstream and not entry.has_diff:
        raise CarryError(
            f"{where}: has no diff; mark it Upstream-Status: {APPLIED_UPSTREAM} or add the change"
        )


def read_revision(directory: Path, label: str) -> tuple[int, str | None]:
    path = directory / REVISION_FILE
    if not path.exists():
        return 0, None
    try:
        data = tomllib.loads(path.read_text())
        revision = data["revision"]
        digest = data["series-sha256"]
    except (tomllib.TOMLDecodeError, KeyError) as exc:
        raise CarryError(f"{label}/{REVISION_FILE} is unreadable ({exc}): run `carry export`") from exc
    if not isinstance(revision, int) or not isinstance(digest, str):
        raise CarryError(f"{label}/{REVISION_FILE} has wrong field types: run `carry export`")
    return revision, digest
