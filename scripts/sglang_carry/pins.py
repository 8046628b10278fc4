"""Pinned upstream releases, read from ``upstream/<name>.toml``."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .errors import CarryError
from .kinds import ArtifactKind, describe_kinds, kind_of, kind_or_none
from .pin_schema import (
    FILE_FIELDS,
    RELEASE_FIELDS,
    TOP_LEVEL_FIELDS,
    Place,
    check_fields,
    read_text,
    required_string,
    string,
    tables,
)


@dataclass(frozen=True)
class PinnedFile:
    filename: str
    sha256: str
    url: str | None = None

    @property
    def kind(self) -> ArtifactKind:
        return kind_of(self.filename)


@dataclass(frozen=True)
class Release:
    name: str
    version: str
    git_tag: str
    files: tuple[PinnedFile, ...]
    # The test environment (a name in ci/test-envs.toml; None: the default one) and when CI runs
    # this line's upstream tests (None: every run for a package's default line, else nightly);
    # see testenv.py.
    test_env: str | None = None
    ci: str | None = None

    @property
    def parsed_version(self) -> Version:
        return Version(self.version)


@dataclass(frozen=True)
class Upstream:
    """One upstream project and every release of it this project carries a line for."""

    name: str
    source_subdir: str
    releases: tuple[Release, ...]

    def release(self, version: str | None) -> Release:
        """The release for ``version``, or the newest line when ``version`` is None."""
        if version is None:
            return max(self.releases, key=lambda r: r.parsed_version)
        for release in self.releases:
            if release.version == version:
                return release
        known = ", ".join(r.version for r in self.releases)
        raise CarryError(
            f"{self.name} {version} is not pinned (pinned: {known}): "
            f"add a [[release]] to upstream/{self.name}.toml"
        )

    def has_version(self, version: str) -> bool:
        return any(r.version == version for r in self.releases)


def select_file(release: Release) -> PinnedFile:
    """The artifact to use on this interpreter: the wheel that fits it best, else the sdist."""
    fits = [
        (rank, pinned)
        for pinned in release.files
        if (rank := pinned.kind.fit_here(pinned.filename)) is not None
    ]
    if fits:
        return min(fits, key=lambda fit: fit[0])[1]
    names = ", ".join(f.filename for f in release.files)
    raise CarryError(
        f"no pinned {release.name} {release.version} file fits this Python ({names}): "
        f"pin a wheel for this platform in upstream/{release.name}.toml"
    )


CI_SCHEDULES = ("every", "nightly")


def load_upstream(path: Path) -> Upstream:
    """Read a pin file, checked against its schema (pin_schema.py): the first problem is one line."""
    try:
        data = tomllib.loads(read_text(path))
    except tomllib.TOMLDecodeError as exc:
        raise Place(path).error(f"is not valid TOML ({exc})") from exc
    top = Place(path)
    check_fields(data, TOP_LEVEL_FIELDS, top)
    name = required_string(data, "name", top)
    if name != path.stem:
        raise top.error(
            f"says name = '{name}', but a pin file is named after its package: rename the file to "
            f"{name}.toml, or set name = '{path.stem}'"
        )
    subdir = string(data, "source_subdir", top, required=False, allow_empty=True) or ""
    raw_releases = tables(data, "release", top, "release")
    if not raw_releases:
        raise top.error("no [[release]] pinned")
    releases: list[Release] = []
    for index, raw in enumerate(raw_releases, 1):
        releases.append(_load_release(name, raw, top.inside(f"[[release]] {index}")))
    versions = [release.version for release in releases]
    twice = next((v for v in versions if versions.count(v) > 1), None)
    if twice is not None:
        raise top.error(f'pins {name} {twice} twice: keep one [[release]] with version = "{twice}"')
    return Upstream(name, subdir.strip("/"), tuple(releases))


def _load_release(name: str, raw: Mapping[str, object], place: Place) -> Release:
    check_fields(raw, RELEASE_FIELDS, place)
    version = required_string(raw, "version", place)
    place = place.inside(f"version {version}")
    try:
        Version(version)
    except InvalidVersion as exc:
        raise place.error(f"'{version}' is not a PEP 440 version") from exc
    files = []
    for index, raw_file in enumerate(tables(raw, "files", place, "release.files"), 1):
        where = place.inside(f"[[release.files]] {index}")
        check_fields(raw_file, FILE_FIELDS, where)
        filename = required_string(raw_file, "filename", where)
        if kind_or_none(filename) is None:
            raise where.error(
                f"'{filename}' is none of the kinds of file the tool handles: {describe_kinds()}"
            )
        sha256 = required_string(raw_file, "sha256", where)
        sha256 = sha256.lower()
        if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
            raise where.error(f"sha256 '{sha256}' is not 64 hex digits")
        files.append(PinnedFile(filename, sha256, string(raw_file, "url", where, required=False)))
    if not files:
        raise place.error("no files pinned: add a [[release.files]] with filename and sha256")
    git_tag = required_string(raw, "git_tag", place)
    ci = string(raw, "ci", place, required=False)
    if ci is not None and ci not in CI_SCHEDULES:
        raise place.error("'ci' must be 'every' or 'nightly'")
    return Release(name, version, git_tag, tuple(files), string(raw, "test_env", place, required=False), ci)


def load_all(upstream_dir: Path) -> dict[str, Upstream]:
    pins = {}
    for path in sorted(upstream_dir.glob("*.toml")):
        upstream = load_upstream(path)
        pins[upstream.name] = upstream
    if not pins:
        raise CarryError(f"no pins in {upstream_dir}: add upstream/<name>.toml")
    return pins
