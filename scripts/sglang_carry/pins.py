"""Pinned upstream releases, read from ``upstream/<name>.toml``."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.tags import Tag, sys_tags
from packaging.utils import parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .errors import CarryError


@dataclass(frozen=True)
class PinnedFile:
    filename: str
    sha256: str
    url: str | None = None

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")

    def wheel_tags(self) -> frozenset[Tag]:
        return parse_wheel_filename(self.filename)[3]


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
    """The artifact to use on this interpreter: a compatible wheel, else the sdist."""
    wheels = [f for f in release.files if f.is_wheel]
    if not wheels:
        return release.files[0]
    for tag in sys_tags():
        for pinned in wheels:
            if tag in pinned.wheel_tags():
                return pinned
    names = ", ".join(f.filename for f in wheels)
    raise CarryError(
        f"no pinned {release.name} {release.version} wheel fits this Python ({names}): "
        f"pin one for this platform in upstream/{release.name}.toml"
    )


def _require(table: dict[str, object], key: str, where: str) -> str:
    value = table.get(key)
    if not isinstance(value, str) or not value:
        raise CarryError(f"{where}: missing string field '{key}'")
    return value


CI_SCHEDULES = ("every", "nightly")


def _optional(table: dict[str, object], key: str, where: str, allowed: tuple[str, ...] = ()) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or (allowed and value not in allowed):
        wanted = " or ".join(f"'{a}'" for a in allowed) if allowed else "a non-empty string"
        raise CarryError(f"{where}: '{key}' must be {wanted}")
    return value


def load_upstream(path: Path) -> Upstream:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise CarryError(f"{path}: cannot read pin file ({exc})") from exc
    name = _require(data, "name", str(path))
    subdir = data.get("source_subdir", "")
    if not isinstance(subdir, str):
        raise CarryError(f"{path}: 'source_subdir' must be a string")
    releases = []
    raw_releases = data.get("release", [])
    if not isinstance(raw_releases, list) or not raw_releases:
        raise CarryError(f"{path}: no [[release]] pinned")
    for raw in raw_releases:
        where = f"{path} release {raw.get('version', '?')}"
        version = _require(raw, "version", where)
        try:
            Version(version)
        except InvalidVersion as exc:
            raise CarryError(f"{where}: '{version}' is not a PEP 440 version") from exc
        files = []
        for raw_file in raw.get("files", []):
            sha256 = _require(raw_file, "sha256", where).lower()
            if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
                raise CarryError(f"{where}: sha256 '{sha256}' is not 64 hex digits")
            url = raw_file.get("url")
            files.append(PinnedFile(_require(raw_file, "filename", where), sha256, url))
        if not files:
            raise CarryError(f"{where}: no files pinned")
        releases.append(
            Release(
                name,
                version,
                _require(raw, "git_tag", where),
                tuple(files),
                test_env=_optional(raw, "test_env", where),
                ci=_optional(raw, "ci", where, CI_SCHEDULES),
            )
        )
    return Upstream(name, subdir.strip("/"), tuple(releases))


def load_all(upstream_dir: Path) -> dict[str, Upstream]:
    pins = {}
    for path in sorted(upstream_dir.glob("*.toml")):
        upstream = load_upstream(path)
        pins[upstream.name] = upstream
    if not pins:
        raise CarryError(f"no pins in {upstream_dir}: add upstream/<name>.toml")
    return pins
