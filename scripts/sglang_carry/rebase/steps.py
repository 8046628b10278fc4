"""The steps of a rebase between pinning and the end: choose the line, pin the new release, lay
down its pristine tree, test the old entries on it, replay them, and finish (export, verify,
REBASE.md); and the result a rebase returns."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ..errors import CarryError
from ..fetch import download, lay_checkout
from ..patching import export
from ..pins import Release, Upstream, load_upstream, select_file
from ..project import Project, Target
from ..registry import Fetcher, index_files, index_url, release_from_index
from ..series import Entry, Series
from ..verify import ERROR, FAIL, PASS, TestOutcome, TreeTester, Verdict, render_table, verify_target
from .journal import State
from .outcome import Outcome, PatchResult
from .replay import ConflictPolicy, Session, replay
from .report import render_report

REPORT_FILE = "REBASE.md"
DEFAULT_PACKAGE = "sglang"


@dataclass(frozen=True)
class Request:
    new: str
    package: str | None = None
    old: str | None = None
    keep: bool = False
    python: str | None = None
    index: str | None = None


@dataclass(frozen=True)
class RebaseResult:
    package: str
    old: str
    new: str
    check: bool
    patches: tuple[PatchResult, ...]
    # The new line's verdicts; None when it was not verified (a conflict under --check).
    verdicts: tuple[Verdict, ...] | None
    failing: tuple[str, ...]
    # Nothing to do: --check of `latest` when the line is the newest release already.
    up_to_date: bool = False

    @property
    def exit_code(self) -> int:
        return 1 if self.failing else 0

    def problem(self) -> str | None:
        if not self.failing:
            return None
        return f"{self.package} {self.old} -> {self.new}: not proven: {'; '.join(self.failing)}"


@dataclass(frozen=True)
class Aborted:
    package: str
    old: str
    new: str
    exit_code: int = 0


def choose_upstream(project: Project, package: str | None) -> Upstream:
    """PACKAGE, or without it the only pinned upstream, or sglang (the upstream this project is
    about) when there are several."""
    pins = project.pins()
    if package is not None:
        if package not in pins:
            raise CarryError(f"unknown upstream '{package}' (pinned: {', '.join(sorted(pins))})")
        return pins[package]
    if len(pins) == 1:
        return next(iter(pins.values()))
    if DEFAULT_PACKAGE in pins:
        return pins[DEFAULT_PACKAGE]
    raise CarryError(f"name the upstream to rebase (pinned: {', '.join(sorted(pins))})")


def parse_version(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion as exc:
        raise CarryError(f"'{version}' is not a PEP 440 version: give the release, e.g. 0.5.23") from exc


def pin_file(project: Project, name: str) -> Path:
    return project.upstream_dir / f"{name}.toml"


def pin(upstream: Upstream, old: Release, request: Request, fetch: Fetcher) -> tuple[Release | None, str]:
    """The release to append to the pin file (None when it is pinned already, and then trusted:
    it was reviewed when committed, and fetch checks every download against it)."""
    if upstream.has_version(request.new):
        return None, f"already pinned in upstream/{upstream.name}.toml (used as committed)"
    index = index_url(request.index)
    release = release_from_index(old, request.new, index_files(upstream.name, index, fetch), index)
    return release, f"read from {index} and appended to upstream/{upstream.name}.toml (review and commit it)"


def begin(
    request: Request,
    old: Target,
    python: str,
    command: str,
    pin_path: Path,
    pin_source: str,
    head_before: str = "",
) -> State:
    """The journal of a rebase (or a --check) of ``old`` onto ``request.new``, before any step."""
    return State(
        name=old.name,
        old=old.version,
        new=request.new,
        keep=request.keep,
        python=python,
        command=command,
        pin_file=str(pin_path),
        pin_source=pin_source,
        head_before=head_before,
    )


def new_target(state: State) -> Target:
    upstream = load_upstream(Path(state.pin_file)) if Path(state.pin_file).exists() else None
    if upstream is None or not upstream.has_version(state.new):
        raise CarryError(
            f"upstream/{state.name}.toml no longer pins {state.new}: `carry rebase --abort` and start again"
        )
    return Target(upstream, upstream.release(state.new))


def old_series(session: Session) -> Series:
    upstream = session.project.pins()[session.state.name]
    return session.project.series(upstream.release(session.state.old), session.runner)


def run(session: Session, policy: ConflictPolicy) -> RebaseResult:
    """Lay down the new release, test the old entries on it and replay them, then finish."""
    project, git, state = session.project, session.git, session.state
    target = new_target(state)
    series = old_series(session)
    if git.rev(target.upstream_tag) is None:
        pinned = select_file(target.release)
        if not (project.downloads_dir / pinned.filename).exists():
            state.created_download = pinned.filename
            session.save()
        artifact = download(project, target, pinned, session.runner, session.report)
        state.created_tag = True
        session.save()
        session.report.step(f"rebase: {lay_checkout(project, target, artifact, session.runner).describe()}")
    state.pristine = _pristine_outcomes(session, target, series)
    git.run("checkout", "--quiet", "-b", target.branch, target.upstream_tag)
    session.save()
    replay(session, target, series, policy)
    return finish(session, target)


def _pristine_outcomes(session: Session, target: Target, series: Series) -> dict[str, TestOutcome]:
    """Each entry's tests on the pristine new tree: pass means upstream has the fix."""
    tested = [entry for entry in series.entries if entry.tests]
    if not tested:
        return {}
    pristine = session.git.rev(target.upstream_tag)
    assert pristine is not None
    session.report.step(f"rebase: running the series' tests on pristine {target.label}")
    tester = TreeTester(
        session.project, target, session.git, session.state.python, session.runner, report=session.report
    )
    try:
        found = entry_outcomes(tester, pristine, tested)
    finally:
        tester.close()
    for filename, outcome in found.items():
        session.report.step(f"rebase: pristine {target.version}: {filename}: its tests {outcome}")
    return found


def entry_outcomes(tester: TreeTester, commit: str, entries: Sequence[Entry]) -> dict[str, TestOutcome]:
    """Each entry's outcome at ``commit``: pass only if all its test ids pass, in one pytest run."""
    ids = list(dict.fromkeys(test for entry in entries for test in entry.tests))
    per_id = tester.outcomes(commit, ids)
    combined: dict[str, TestOutcome] = {}
    for entry in entries:
        found = [per_id.get(test, ERROR) for test in entry.tests]
        combined[entry.filename] = ERROR if ERROR in found else (PASS if set(found) == {PASS} else FAIL)
    return combined


def finish(session: Session, target: Target) -> RebaseResult:
    """Export the new line, verify it and write REBASE.md; the rebase is then over."""
    project, git, state, runner = session.project, session.git, session.state, session.runner
    conflicts = [r for r in state.results if r.outcome is Outcome.CONFLICT]
    verdicts: list[Verdict] | None = None
    new_names: list[str] = []
    if not conflicts:
        for line in export(project, target, runner=runner).describe():
            session.report.step(line)
        new_series = project.series(target.release, runner)
        new_names = [entry.filename for entry in new_series.entries]
        verdicts = verify_target(project, target, state.python, runner, session.report)
    old_range = f"upstream/{state.old}..carry/{state.old}"
    new_range = f"{target.upstream_tag}..HEAD"
    range_diff = git.run("range-diff", "--no-color", old_range, new_range, check=False).stdout
    verify_table = render_table([(target.label, v) for v in verdicts]) if verdicts else ""
    report = render_report(state, new_names, range_diff, verify_table, verdicts is not None)
    if not conflicts:
        (series_dir := project.patches_dir / state.name / state.new).mkdir(parents=True, exist_ok=True)
        (series_dir / REPORT_FILE).write_text(report, encoding="utf-8")
    session.journal.unlink(missing_ok=True)
    return RebaseResult(
        state.name,
        state.old,
        state.new,
        session.check,
        tuple(state.results),
        None if verdicts is None else tuple(verdicts),
        tuple(failing_patches(state, verdicts)),
    )


def failing_patches(state: State, verdicts: list[Verdict] | None) -> list[str]:
    failing = []
    for result in state.results:
        if result.outcome is Outcome.CONFLICT:
            failing.append(f"{result.filename} conflicts ({', '.join(result.resolved_files)})")
        elif result.outcome in (Outcome.APPLIED_UPSTREAM, Outcome.EMPTY) and result.pristine != PASS:
            failing.append(
                f"{result.filename} is upstream but its tests {result.pristine} on pristine {state.new}"
            )
    if verdicts is None:
        failing.append("the new line was not verified")
    else:
        failing.extend(f"{v.entry.filename} {v.label}" for v in verdicts if not v.ok)
    return failing
