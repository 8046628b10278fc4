"""A patch series: ``patches/<name>/<version>/series`` plus the patch files it lists."""

from __future__ import annotations

import hashlib
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CarryError
from .git import Git, summarize_git_output
from .runner import Runner, run_subprocess

SERIES_FILE = "series"
REVISION_FILE = "revision"
# A line that carries no patch on purpose says so, with the reason, in this file; without it an
# empty or missing series is taken for a line nobody has ported the series to yet.
CARRIES_NOTHING_FILE = "carries-nothing"
SERIES_HEADER = (
    "# Patch order for this upstream line. Written by `carry export`; edit the branch, not this.\n"
)
STATUSES = ("Pending", "Submitted", "Backport", "Inappropriate", "Applied-Upstream")
APPLIED_UPSTREAM = "Applied-Upstream"


@dataclass(frozen=True)
class Entry:
    filename: str
    subject: str
    trailers: dict[str, list[str]] = field(hash=False)
    has_diff: bool
    sha256: str
    # What git says is wrong with its diff (a truncated or hand-edited patch), or None.
    corrupt: str | None = None

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
    carries_nothing: str | None = None

    @property
    def label(self) -> str:
        return f"patches/{self.name}/{self.version}"

    def digest(self) -> str:
        return series_digest(self.directory, [e.filename for e in self.entries])

    def revision_is_current(self) -> bool:
        if not self.entries and self.recorded_digest is None:
            return self.revision == 0
        return self.recorded_digest == revision_digest(self.digest(), self.revision)

    def revision_changed_by_hand(self) -> int | None:
        """The revision `carry export` recorded for these very files, when only the number in
        the revision file differs from it (None: the files changed, or nothing did)."""
        if self.revision_is_current() or self.recorded_digest is None:
            return None
        return recorded_revision(self.digest(), self.recorded_digest)

    def require_current_revision(self) -> None:
        if self.revision_is_current():
            return
        recorded = self.revision_changed_by_hand()
        if recorded is not None:
            raise CarryError(
                f"{self.label}/{REVISION_FILE} says revision {self.revision}, but `carry export` "
                f"recorded these patches as revision {recorded} (only `carry export` changes it): "
                f"restore it with `git checkout -- {self.label}/{REVISION_FILE}`"
            )
        raise CarryError(
            f"{self.label} was edited by hand since revision {self.revision} was recorded: "
            f"`carry apply {self.name} --upstream {self.version}` rebuilds the branch from the files, "
            "then `carry export` records them as a new revision"
        )

    def require_something_to_carry(self) -> None:
        """Refuse to build or verify a line nobody has ported the series to (it would be upstream
        with a +carry version), unless the line says it carries nothing on purpose."""
        if self.entries or self.carries_nothing is not None:
            return
        raise CarryError(
            f"{self.name} {self.version} has no series in {self.label}, so it would be plain upstream: "
            f"port the series to it (commit on carry/{self.version}, then `carry export`), write why it "
            f"carries nothing into {self.label}/{CARRIES_NOTHING_FILE}, or pick another line with --upstream"
        )


def series_digest(directory: Path, filenames: Sequence[str]) -> str:
    """Hash of everything that defines the series; the revision grows whenever it changes."""
    return contents_digest({name: (directory / name).read_bytes() for name in filenames}, filenames)


def revision_digest(content_digest: str, revision: int) -> str:
    """What a revision file records as `series-sha256`: the series' contents and its revision
    together, so that a revision changed by hand (another version for the same patches, or one
    version for two series) is seen as an edit."""
    return hashlib.sha256(f"{content_digest}\nrevision {revision}\n".encode()).hexdigest()


# How far back `recorded_revision` looks for the number a hand edit replaced.
REVISION_SEARCH_LIMIT = 10_000


def recorded_revision(content_digest: str, recorded: str) -> int | None:
    """The revision whose digest, with these contents, is the recorded one."""
    return next(
        (n for n in range(1, REVISION_SEARCH_LIMIT) if revision_digest(content_digest, n) == recorded),
        None,
    )


def contents_digest(contents: Mapping[str, bytes], filenames: Sequence[str]) -> str:
    digest = hashlib.sha256()
    digest.update(render_series_file(filenames).encode())
    for filename in filenames:
        digest.update(filename.encode() + b"\0")
        digest.update(hashlib.sha256(contents[filename]).digest())
    return digest.hexdigest()


def render_series_file(filenames: Sequence[str]) -> str:
    return SERIES_HEADER + "".join(f"{name}\n" for name in filenames)


def render_revision_file(revision: int, digest: str) -> str:
    return (
        "# The N in <version>+carry.<N>. `carry export` raises it whenever the series changes,\n"
        "# so two different builds never share a version.\n"
        f"revision = {revision}\n"
        f'series-sha256 = "{digest}"\n'
    )


def parse_patch(
    filename: str, data: bytes, runner: Runner = run_subprocess, cwd: Path | None = None
) -> Entry:
    """An entry as git am reads it: the mail through `git mailinfo` (encoded non-ASCII subjects
    come out decoded), the trailers through `git interpret-trailers --parse`."""
    git = Git(cwd or Path.cwd(), runner)
    mail = git.mailinfo(data.decode("utf-8", "surrogateescape"))
    corrupt = None
    if mail.patch.strip():
        # Parsed by git without applying it, so a broken file is found before any branch is touched.
        checked = git.run("apply", "--numstat", "-", stdin=mail.patch, check=False)
        if checked.returncode != 0:
            lines = checked.output.splitlines()
            corrupt = next((line.strip() for line in lines if "corrupt patch" in line), None)
            corrupt = corrupt or summarize_git_output(checked.output)
    return Entry(
        filename=filename,
        subject=mail.subject.strip(),
        trailers=parse_trailers(git, mail.message),
        has_diff=bool(mail.patch.strip()),
        sha256=hashlib.sha256(data).hexdigest(),
        corrupt=corrupt,
    )


def parse_trailers(git: Git, message: str) -> dict[str, list[str]]:
    """Trailers of a commit message (subject, blank line, body), exactly as git sees them
    (continuation lines unfolded)."""
    trailers: dict[str, list[str]] = {}
    for line in git.out("interpret-trailers", "--parse", stdin=message).splitlines():
        key, _, value = line.partition(":")
        trailers.setdefault(key.strip(), []).append(value.strip())
    return trailers


def read_utf8(path: Path) -> str:
    """A text file the series is made of; not UTF-8 is one line, never a traceback."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CarryError(
            f"{path} is not UTF-8 (byte {exc.start}): save it as UTF-8, or `git checkout -- {path}`"
        ) from exc


def read_series_names(series_path: Path) -> list[str]:
    names = []
    for raw in read_utf8(series_path).splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if "/" in line or "\\" in line or line in (".", ".."):
            raise CarryError(
                f"{series_path} lists '{line}', which is not a file in its folder: a series lists "
                "patch files by name only"
            )
        names.append(line)
    return names


def read_carries_nothing(directory: Path, label: str) -> str | None:
    """The reason a line carries nothing on purpose, or None when it does not say so."""
    path = directory / CARRIES_NOTHING_FILE
    if not path.exists():
        return None
    reason = " ".join(read_utf8(path).split())
    if not reason:
        raise CarryError(
            f"{label}/{CARRIES_NOTHING_FILE} is empty: write in it why this line carries nothing"
        )
    return reason


def has_series(patches_dir: Path, name: str, version: str) -> bool:
    """Whether the line has a series to build: patches listed, or nothing carried on purpose."""
    directory = patches_dir / name / version
    if (directory / CARRIES_NOTHING_FILE).exists():
        return True
    series_path = directory / SERIES_FILE
    return series_path.is_file() and bool(read_series_names(series_path))


def load_series(patches_dir: Path, name: str, version: str, runner: Runner = run_subprocess) -> Series:
    directory = patches_dir / name / version
    label = f"patches/{name}/{version}"
    series_path = directory / SERIES_FILE
    carries_nothing = read_carries_nothing(directory, label)
    if not series_path.exists():
        if directory.exists() and any(directory.glob("*.patch")):
            raise CarryError(f"{label} has patch files but no series file: list them in {label}/series")
        return Series(name, version, directory, (), 0, None, carries_nothing)
    names = read_series_names(series_path)
    if names and carries_nothing is not None:
        raise CarryError(
            f"{label}/series lists {len(names)} patch(es) but {label}/{CARRIES_NOTHING_FILE} says the line "
            "carries nothing: delete one of the two"
        )
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
        entry = parse_patch(filename, path.read_bytes(), runner, directory)
        _check_entry(label, entry)
        entries.append(entry)
    strays = sorted(p.name for p in directory.glob("*.patch") if p.name not in seen)
    if strays:
        raise CarryError(
            f"{label}/{strays[0]} is not listed in {label}/series: add it to the series or delete it"
        )
    revision, digest = read_revision(directory, label)
    return Series(name, version, directory, tuple(entries), revision, digest, carries_nothing)


def _check_entry(label: str, entry: Entry) -> None:
    where = f"{label}/{entry.filename}"
    if not entry.subject.strip():
        raise CarryError(
            f"{where} is not a patch in git's mail format (it has no Subject: line): restore it with "
            f"`git checkout -- {where}`, or write it again with `carry export`"
        )
    if entry.corrupt is not None:
        raise CarryError(
            f"{where} is broken (git: {entry.corrupt}): restore it with `git checkout -- {where}`, or "
            "write it again with `carry export`"
        )
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
    restore = f"restore it with `git checkout -- {label}/{REVISION_FILE}`"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        revision = data["revision"]
        digest = data["series-sha256"]
    except (tomllib.TOMLDecodeError, KeyError, UnicodeDecodeError) as exc:
        raise CarryError(f"{label}/{REVISION_FILE} is unreadable ({exc}): {restore}") from exc
    # bool is an int to Python; `revision = true` is not a revision.
    if type(revision) is not int or not isinstance(digest, str):
        raise CarryError(
            f"{label}/{REVISION_FILE} has wrong field types (revision must be an integer, "
            f"series-sha256 a string): {restore}"
        )
    if revision < 1:
        raise CarryError(
            f"{label}/{REVISION_FILE} says revision {revision}; a revision is a positive integer that "
            f"only `carry export` raises: {restore}"
        )
    return revision, digest


@dataclass(frozen=True)
class SeriesFolder:
    """What ``patches/<name>/<version>/`` holds right now, read without judging it: `carry export`
    compares it with the branch before it writes anything."""

    directory: Path
    label: str
    listed: tuple[str, ...]
    contents: dict[str, bytes] = field(hash=False)
    revision: int
    recorded_digest: str | None
    strays: tuple[str, ...]
    carries_nothing: str | None

    @property
    def exists(self) -> bool:
        return self.directory.exists()

    def digest(self) -> str | None:
        if any(name not in self.contents for name in self.listed):
            return None
        return contents_digest(self.contents, self.listed)

    def edited_since_export(self) -> bool:
        """True when the files or the revision are not what the last `carry export` recorded (a
        hand edit)."""
        if not self.listed and self.recorded_digest is None:
            return False
        content = self.digest()
        return content is None or revision_digest(content, self.revision) != self.recorded_digest


def read_series_folder(patches_dir: Path, name: str, version: str) -> SeriesFolder:
    directory = patches_dir / name / version
    label = f"patches/{name}/{version}"
    series_path = directory / SERIES_FILE
    listed = tuple(dict.fromkeys(read_series_names(series_path))) if series_path.is_file() else ()
    contents = {n: (directory / n).read_bytes() for n in listed if (directory / n).is_file()}
    revision, digest = read_revision(directory, label)
    strays = tuple(sorted(p.name for p in directory.glob("*.patch") if p.name not in listed))
    return SeriesFolder(
        directory, label, listed, contents, revision, digest, strays, read_carries_nothing(directory, label)
    )
