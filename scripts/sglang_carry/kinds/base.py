"""What every artifact kind provides (wheel.py, sdist.py), and the values passed to it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from packaging.version import Version

from ..progress import Reporter
from ..runner import Runner


@dataclass(frozen=True)
class Changes:
    """Files the series changes, as paths inside the artifact."""

    replaced: dict[str, bytes]
    deleted: frozenset[str]


@dataclass(frozen=True)
class Wanted:
    """A pinned file to download: its project's name and version as pinned, and its url if any."""

    project: str
    version: str
    filename: str
    url: str | None
    pin_file: str  # upstream/<name>.toml, for the messages


@dataclass(frozen=True)
class Repack:
    """What a patched artifact is made of."""

    project: str
    version: str
    local_version: str
    changes: Changes
    provenance: bytes


class ArtifactKind(Protocol):
    """One kind of upstream file (a wheel, an sdist): how the tool recognises, fetches, unpacks,
    repacks and renames it, and which file of a new release is the same kind as a pinned one."""

    name: str
    pattern: str  # its file names, for messages ("*.whl")

    def matches(self, filename: str) -> bool: ...

    def parse(self, filename: str) -> tuple[str, Version]:
        """The canonical project name and version a file name spells; ValueError if it cannot."""

    def renamed(self, filename: str, local_version: str) -> str:
        """The file name with ``local_version`` in place of its version, the rest kept."""

    def fit_here(self, filename: str) -> int | None:
        """How well the file fits this interpreter (lower is better), None when it does not."""

    def download(self, wanted: Wanted, incoming: Path, runner: Runner, report: Reporter) -> None:
        """Put the file into ``incoming`` (its hash is checked by the caller)."""

    def extract(self, artifact: Path, root: Path) -> None:
        """Unpack the upstream sources into ``root`` (metadata of the packaging itself left out)."""

    def repack(self, source: Path, output: Path, repack: Repack) -> None:
        """Write the patched artifact: ``source`` with the changes, version and provenance."""

    def counterpart(self, pinned: str, candidates: Sequence[str]) -> str | None:
        """The file among ``candidates`` (a new release's) of the same kind as ``pinned``."""
