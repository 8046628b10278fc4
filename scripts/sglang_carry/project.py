"""Where things live in a sglang-carry checkout, and which (upstream, release) pairs a command targets."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import CarryError
from .pins import Release, Upstream, load_all
from .runner import Runner, run_subprocess
from .series import Series, has_series, load_series


@dataclass(frozen=True)
class Project:
    root: Path

    @classmethod
    def find(cls, start: Path) -> Project:
        for candidate in (start, *start.parents):
            if (candidate / "upstream").is_dir() and (candidate / "patches").is_dir():
                return cls(candidate)
        raise CarryError(
            f"{start} is not inside a sglang-carry checkout (no upstream/ and patches/): run carry "
            "from the checkout, or name its folder with --root"
        )

    @property
    def upstream_dir(self) -> Path:
        return self.root / "upstream"

    @property
    def patches_dir(self) -> Path:
        return self.root / "patches"

    @property
    def downloads_dir(self) -> Path:
        return self.upstream_dir / ".downloads"

    @property
    def dist_dir(self) -> Path:
        return self.root / "dist"

    @property
    def scratch_dir(self) -> Path:
        """Work space for builds and exports; never inside dist/, so no partial file lands there."""
        return self.root / "build"

    def checkout(self, name: str) -> Path:
        return self.upstream_dir / name

    def pins(self) -> dict[str, Upstream]:
        return load_all(self.upstream_dir)

    def series(self, release: Release, runner: Runner = run_subprocess) -> Series:
        return load_series(self.patches_dir, release.name, release.version, runner)

    def has_series(self, release: Release) -> bool:
        return has_series(self.patches_dir, release.name, release.version)


@dataclass(frozen=True)
class Target:
    upstream: Upstream
    release: Release
    # Newer pinned versions passed over because they have no series yet (default line only).
    skipped_newer: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.upstream.name

    @property
    def version(self) -> str:
        return self.release.version

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}"

    @property
    def upstream_tag(self) -> str:
        return f"upstream/{self.version}"

    @property
    def branch(self) -> str:
        return f"carry/{self.version}"


def select_targets(
    project: Project, packages: Sequence[str], version: str | None, every_line: bool = False
) -> list[Target]:
    """The lines a command works on: named packages (default all) at ``version``. Without a
    version, each package's newest line that has a series (so a freshly pinned release is never
    built unpatched by default), or with ``every_line`` all pinned lines."""
    pins = project.pins()
    for package in packages:
        if package not in pins:
            raise CarryError(f"unknown upstream '{package}' (pinned: {', '.join(sorted(pins))})")
    names = list(packages) or sorted(pins)
    if version is not None:
        if not packages:
            names = [name for name in names if pins[name].has_version(version)]
            if not names:
                raise CarryError(f"no upstream has version {version} pinned: add it to upstream/<name>.toml")
        return [Target(pins[name], pins[name].release(version)) for name in names]
    if every_line:
        return [
            Target(pins[name], release)
            for name in names
            for release in sorted(pins[name].releases, key=lambda r: r.parsed_version)
        ]
    return [default_target(project, pins[name]) for name in names]


def default_target(project: Project, upstream: Upstream) -> Target:
    newest_first = sorted(upstream.releases, key=lambda r: r.parsed_version, reverse=True)
    for index, release in enumerate(newest_first):
        if project.has_series(release):
            return Target(upstream, release, tuple(r.version for r in newest_first[:index]))
    # No line has a series yet: the newest, which build and verify then refuse with a reason.
    return Target(upstream, newest_first[0])
