"""What a carry command killed part-way leaves behind, found and (once it is provably dead) removed.

A SIGKILLed build leaves its wheel in progress (build/tmp*.partial, tens of MB), a fetch its
download (upstream/.downloads/.incoming-*), an export its new series folder; nothing cleaned them.
Only while no command holds the checkout's lock are such files leftovers: a live command's are
work in progress. A writing command removes them right after it takes the lock; status, which
takes no lock, reports them (unless a command is at work) and fails.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from .files import INCOMING_SUFFIX, OUTGOING_SUFFIX, recover_folder, replaced_by
from .project import Project


@dataclass(frozen=True)
class Leftover:
    path: Path
    size: int  # bytes, a folder's files summed

    def describe(self, root: Path) -> str:
        shown = self.path.relative_to(root) if self.path.is_relative_to(root) else self.path
        return f"{shown} ({self.size / 1e6:.1f} MB)"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def find(project: Project) -> list[Leftover]:
    """Every file or folder here that only a command killed part-way leaves."""
    scratch, downloads = project.scratch_dir, project.downloads_dir
    candidates = [
        *scratch.glob("tmp*"),  # a wheel being built, and its unpacked tree (build.py)
        *scratch.glob("export-*"),  # a branch being exported (patching.py)
        *scratch.glob("compare-*"),  # a branch being compared with its series (line_state.py)
        *scratch.glob("pristine-*"),  # a pristine tree being laid down (fetch.py)
        *scratch.glob("rebase-check-*"),  # a scratch copy of `carry rebase --check`
        *downloads.glob(".incoming-*"),  # a download (fetch.py)
        *project.patches_dir.glob(f"*/.*{INCOMING_SUFFIX}"),  # a series folder being replaced
        *project.patches_dir.glob(f"*/.*{OUTGOING_SUFFIX}"),
        *project.patches_dir.glob("*/*/.*.partial"),  # a file being replaced (files.py)
        *project.upstream_dir.glob(".*.partial"),  # a pin file being rewritten (registry.py)
    ]
    return [Leftover(path, _size(path)) for path in sorted(candidates)]


def remove(project: Project) -> list[Leftover]:
    """Remove the leftovers; only for a caller that holds the checkout's lock. A series folder
    set aside by an export killed while it swapped folders is put back, not removed."""
    found = find(project)
    for leftover in found:
        path = leftover.path
        if path.name.endswith((INCOMING_SUFFIX, OUTGOING_SUFFIX)):
            recover_folder(replaced_by(path))
        elif path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return found
