"""How one patch fared in a rebase, and the record of it that the journal keeps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..verify.plan import TestOutcome


class Outcome(enum.StrEnum):
    CLEAN = "clean"
    THREE_WAY = "3-way"
    RESOLVED = "resolved"
    PORTED = "ported"
    CONFLICT = "conflict"
    EMPTY = "empty"
    FIXED_UPSTREAM = "upstream"
    APPLIED_UPSTREAM = "applied-upstream"

    @property
    def meaning(self) -> str:
        return _MEANING[self]

    @property
    def carried(self) -> bool:
        """Whether the entry is on the new line with its diff."""
        return self in (Outcome.CLEAN, Outcome.THREE_WAY, Outcome.RESOLVED, Outcome.PORTED)

    @property
    def dropped(self) -> bool:
        """Whether this rebase recorded it Applied-Upstream, without its diff."""
        return self in (Outcome.EMPTY, Outcome.FIXED_UPSTREAM)


_MEANING = {
    Outcome.CLEAN: "applied as it was",
    Outcome.THREE_WAY: "applied by git's 3-way merge",
    Outcome.RESOLVED: "conflicted; resolved by hand",
    Outcome.PORTED: "conflicts; the port that the existing new line records applies (--check only)",
    Outcome.CONFLICT: "does not apply: conflicts",
    Outcome.EMPTY: "its diff is already upstream: recorded Applied-Upstream (no diff)",
    Outcome.FIXED_UPSTREAM: "its tests pass on the pristine new tree: recorded Applied-Upstream (no diff)",
    Outcome.APPLIED_UPSTREAM: "already Applied-Upstream on the old line",
}


@dataclass
class PatchResult:
    filename: str
    subject: str
    outcome: Outcome | None  # None until the entry is replayed
    pristine: TestOutcome  # its tests on the pristine new tree
    drop_when: list[str] = field(default_factory=list)
    note: str = ""
    change: str = ""
    resolved_files: list[str] = field(default_factory=list)

    def porting(self) -> str:
        """What porting the patch took, in a few words."""
        files = ", ".join(self.resolved_files)
        if self.outcome is Outcome.CLEAN:
            return "nothing"
        if self.outcome is Outcome.THREE_WAY:
            return f"git's 3-way merge; {self.change}"
        if self.outcome is Outcome.RESOLVED:
            return f"resolved by hand in {files}; {self.change}"
        if self.outcome is Outcome.PORTED:
            return f"conflicts in {files}; the recorded port applies"
        if self.outcome is Outcome.CONFLICT:
            return f"conflicts in {files or '?'}"
        if self.outcome is Outcome.APPLIED_UPSTREAM:
            return "nothing (no diff)"
        return "nothing: its diff dropped"

    def progress(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"rebase: {self.filename}: {self.outcome}{note}"
