"""What is pinned, fetched, applied and carried, for every line; non-zero when a line needs work."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from . import leftovers
from .checkout_lock import working
from .errors import CarryError
from .fetch import sha256_of
from .git import Git
from .line_state import DIFFERS, MATCHES, MISSING, NOT_DESCENDING, BranchState, branch_state
from .pins import select_file
from .progress import SILENT, Reporter
from .project import Project, Target
from .rebase import state_path as rebase_state_path
from .results import to_json
from .runner import Runner, run_subprocess
from .series import Series

_BRANCH_TEXT = {
    MISSING: "no branch (run `carry apply`)",
    MATCHES: "matches patches/",
    DIFFERS: "DIFFERS from patches/ (`carry export` keeps the branch, `carry apply` the files)",
    NOT_DESCENDING: "does NOT descend from its upstream tag (rebase it, or `carry apply`)",
}


class DownloadState(enum.StrEnum):
    MISSING = "missing"
    OK = "ok"
    WRONG_SHA256 = "wrong-sha256"


class SeriesState(enum.StrEnum):
    BROKEN = "broken"  # unreadable: a missing or corrupt patch, a bad series file
    CARRIES_NOTHING = "carries-nothing"  # on purpose (carries-nothing names why)
    NONE = "none"  # no series yet
    RECORDED = "recorded"  # as `carry export` wrote it
    EDITED = "edited"  # changed by hand since its revision was recorded


class CheckoutPresence(enum.StrEnum):
    MISSING = "missing"
    PRESENT = "present"


# A line's series is maintained (built, verified, tested by the nightly) in these states.
MAINTAINED = frozenset({SeriesState.RECORDED, SeriesState.CARRIES_NOTHING, SeriesState.EDITED})


@dataclass
class LineStatus:
    """One line's state: ``record`` for --json, ``lines`` for people, ``problems`` for the exit code
    (things `carry build` would refuse, other than steps not taken yet)."""

    target: Target
    record: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def describe(project: Project, target: Target, runner: Runner) -> LineStatus:
    line = LineStatus(target)
    line.record.update(name=target.name, version=target.version, git_tag=target.release.git_tag)
    # The test environment the line's tests run in (ci/test-envs.toml; null: the default one).
    line.record["test_env"] = target.release.test_env
    line.lines.append(f"{target.label} (tag {target.release.git_tag})")
    _describe_download(project, target, line)
    series = _describe_series(project, target, runner, line)
    if series is not None:
        _describe_checkout(project, target, series, runner, line)
    line.record["problems"] = line.problems
    return line


def _describe_download(project: Project, target: Target, line: LineStatus) -> None:
    try:
        pinned = select_file(target.release)
    except CarryError as exc:
        line.record["pin"] = {"error": str(exc)}
        line.lines.append(f"  pin       {exc}")
        line.problems.append(str(exc))
        return
    cached = project.downloads_dir / pinned.filename
    if not cached.exists():
        download, shown = DownloadState.MISSING, f"not fetched ({_fetch_hint(target)} fetches it)"
    elif sha256_of(cached) == pinned.sha256:
        download, shown = DownloadState.OK, "fetched, sha256 ok"
    else:
        download, shown = (
            DownloadState.WRONG_SHA256,
            f"fetched with the WRONG sha256 ({_fetch_hint(target)} downloads it again)",
        )
        line.problems.append(f"{pinned.filename} in {project.downloads_dir.name}/ does not match its pin")
    line.record["pin"] = {"file": pinned.filename, "sha256": pinned.sha256, "download": download}
    line.lines.append(f"  pin       {pinned.filename} sha256 {pinned.sha256[:16]}… {shown}")


def _entries(series: Series) -> str:
    count = len(series.entries)
    return f"{count} {'entry' if count == 1 else 'entries'}"


def _describe_series(project: Project, target: Target, runner: Runner, line: LineStatus) -> Series | None:
    label = f"patches/{target.name}/{target.version}"
    try:
        series = project.series(target.release, runner)
    except CarryError as exc:
        line.record["series"] = {"path": label, "state": SeriesState.BROKEN, "error": str(exc)}
        line.lines.append(f"  series    BROKEN: {exc}")
        line.problems.append(f"{label} is broken")
        return None
    if series.carries_nothing is not None:
        state, shown = SeriesState.CARRIES_NOTHING, f"carries nothing on purpose ({series.carries_nothing})"
    elif not series.entries:
        state, shown = SeriesState.NONE, "no series yet (build and verify refuse this line)"
    elif series.revision_is_current():
        state, shown = SeriesState.RECORDED, f"{_entries(series)}, revision {series.revision} recorded"
    elif (recorded := series.revision_changed_by_hand()) is not None:
        state = SeriesState.EDITED
        shown = (
            f"{_entries(series)}, revision CHANGED by hand to {series.revision} "
            f"(recorded: {recorded}; `git checkout -- {label}/revision` restores it)"
        )
        line.problems.append(f"{label}/revision was changed by hand from {recorded} to {series.revision}")
    else:
        state = SeriesState.EDITED
        shown = f"{_entries(series)}, EDITED by hand since revision {series.revision} (see README)"
        line.problems.append(f"{label} was edited by hand since its revision was recorded")
    line.record["series"] = {
        "path": label,
        "state": state,
        "revision": series.revision,
        "entries": [{"file": e.filename, "upstream_status": e.status_line} for e in series.entries],
    }
    line.lines.append(f"  series    {label}: {shown}")
    line.lines.extend(f"    {entry.filename}  [{entry.status_line}]" for entry in series.entries)
    return series


def _fetch_hint(target: Target) -> str:
    """The fetch that reaches this very line: plain `carry fetch` takes each package's newest."""
    return f"`carry fetch {target.name} --upstream {target.version}`"


def _describe_checkout(
    project: Project, target: Target, series: Series, runner: Runner, line: LineStatus
) -> None:
    git = Git(project.checkout(target.name), runner)
    if not git.exists() or git.rev(target.upstream_tag) is None:
        line.record["checkout"] = {"state": CheckoutPresence.MISSING}
        line.lines.append(f"  checkout  missing (run {_fetch_hint(target)})")
        return
    head = git.current_branch() or "detached HEAD"
    dirty = len(git.dirty_paths())
    operation = git.operation_in_progress()
    if operation is not None:
        state = f"git {operation.name} in progress (`{operation.resume}` or `{operation.abort}`)"
        branch = BranchState.UNKNOWN
        line.problems.append(f"a git {operation.name} is in progress in upstream/{target.name}")
    else:
        state = f"{dirty} uncommitted change(s)" if dirty else "clean"
        branch = branch_state(git, target, series, project.scratch_dir)
        if branch == DIFFERS:
            line.problems.append(f"{target.branch} differs from {series.label}")
        elif branch == NOT_DESCENDING:
            line.problems.append(f"{target.branch} does not descend from {target.upstream_tag}")
    line.record["checkout"] = {
        "state": CheckoutPresence.PRESENT,
        "head": head,
        "uncommitted": dirty,
        "operation": operation.name if operation else None,
        "branch": branch,
    }
    shown = _BRANCH_TEXT.get(branch, "state unknown")
    line.lines.append(f"  checkout  upstream/{target.name} on {head}, {state}; {target.branch} {shown}")


@dataclass
class CheckoutStatus:
    """The checkout's own state, beside its lines': the same three views as LineStatus."""

    record: dict[str, Any] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def describe_checkout(project: Project, runner: Runner) -> CheckoutStatus:
    """What concerns the whole checkout: a command at work in it, an interrupted rebase, and the
    leftovers of a command killed part-way (which the next writing command removes)."""
    found = CheckoutStatus()
    holder = working(project)
    found.record["working"] = None if holder is None else {"pid": holder.pid, "command": holder.command}
    found.record["rebases"] = []
    found.record["leftovers"] = []
    if holder is not None:
        found.lines.append(
            f"checkout  {holder.describe()} is working in this checkout: its files are in progress"
        )
        return found
    for name in sorted(project.pins()):
        state = rebase_state_path(project, name, runner)
        if state is not None and state.exists():
            found.record["rebases"].append(str(state))
            found.lines.append(
                f"rebase    a `carry rebase` of {name} stopped part-way (its state: {state}; the pin "
                "file may be changed): `carry rebase --continue` goes on, `carry rebase --abort` undoes it"
            )
            found.problems.append(f"a rebase of {name} is in progress")
    for leftover in leftovers.find(project):
        found.record["leftovers"].append(str(leftover.path))
        found.lines.append(
            f"leftover  {leftover.describe(project.root)}, from a carry command killed part-way: "
            "the next carry command that writes removes it"
        )
        found.problems.append(f"{leftover.path} is a leftover")
    return found


@dataclass(frozen=True)
class StatusResult:
    lines: tuple[LineStatus, ...]
    checkout: CheckoutStatus

    @property
    def problems(self) -> int:
        return sum(len(line.problems) for line in self.lines) + len(self.checkout.problems)

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def record(self) -> dict[str, Any]:
        """The state as `carry status --json` prints it (ci/schemas/status.schema.json)."""
        return {
            "ok": self.problems == 0,
            "lines": [to_json(line.record) for line in self.lines],
            "checkout": to_json(self.checkout.record),
        }


def status(
    project: Project, targets: list[Target], runner: Runner = run_subprocess, report: Reporter = SILENT
) -> StatusResult:
    """Each line's state, reported as it is found (a slow line does not hold back the others)."""
    found = []
    for target in targets:
        line = describe(project, target, runner)
        report.step("\n".join(line.lines))
        found.append(line)
    checkout = describe_checkout(project, runner)
    return StatusResult(tuple(found), checkout)
