"""The kinds of upstream file the tool handles, one module each; a new kind is a new module
that implements ArtifactKind (base.py) and one entry in KINDS."""

from __future__ import annotations

from packaging.version import Version

from ..errors import CarryError
from .base import ArtifactKind, Changes, Repack, Wanted
from .sdist import Sdist
from .wheel import PROVENANCE_FILE, Wheel

WHEEL = Wheel()
SDIST = Sdist()
KINDS: tuple[ArtifactKind, ...] = (WHEEL, SDIST)

__all__ = [
    "KINDS",
    "PROVENANCE_FILE",
    "SDIST",
    "WHEEL",
    "ArtifactKind",
    "Changes",
    "Repack",
    "Wanted",
    "describe_kinds",
    "kind_of",
    "kind_or_none",
    "parse_or_none",
]


def kind_or_none(filename: str) -> ArtifactKind | None:
    return next((kind for kind in KINDS if kind.matches(filename)), None)


def describe_kinds() -> str:
    return ", ".join(f"{kind.name} ({kind.pattern})" for kind in KINDS)


def kind_of(filename: str) -> ArtifactKind:
    kind = kind_or_none(filename)
    if kind is None:
        raise CarryError(f"{filename} is none of the kinds of file the tool handles: {describe_kinds()}")
    return kind


def parse_or_none(filename: str) -> tuple[str, Version] | None:
    """The canonical project and version of a file of a known kind; None for anything else."""
    kind = kind_or_none(filename)
    if kind is None:
        return None
    try:
        return kind.parse(filename)
    except ValueError:
        return None
