"""Unpacking that refuses a member that would land outside its folder."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from ..errors import CarryError


def inside(root: Path, member: str, artifact: Path) -> Path:
    """Where a zip member goes, refused if it would land outside ``root`` (what tarfile's
    filter="data" does for tar files)."""
    relative = PurePosixPath(member)
    destination = (root / relative).resolve()
    if relative.is_absolute() or ".." in relative.parts or not destination.is_relative_to(root.resolve()):
        raise CarryError(
            f"{artifact.name} holds {member}, which would unpack outside the checkout: refusing it; "
            "check the pin and the file"
        )
    return destination
