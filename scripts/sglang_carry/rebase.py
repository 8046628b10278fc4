"""`carry rebase`: move a line's series onto a new upstream release.

The steps: pin the new release (from the package index, unless it is pinned already), lay down its
pristine tree, run every entry's tests on that pristine tree (an entry whose tests pass there is
fixed upstream), replay the old series onto ``carry/<new>`` one patch at a time with
``git am --3way``, export the new line, verify it and write ``REBASE.md`` beside it.

Until the rebase ends, everything it changed is recorded in a state file inside the checkout's git
directory, so that a conflict can stop it (`--continue` resumes, `--abort` undoes it all) and any
other failure undoes it at once: a rebase either finishes, stops at a conflict, or changes nothing.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .errors import CarryError
from .fetch import download, lay_checkout
from .git import Git, summarize_git_output
from .patching import apply, export, require_clean, require_line_ready, require_no_operation
from .pins import Release, Upstream, load_upstream, select_file
from .project import Project, Target, default_target
from .rebase_report import (
    PatchResult,
    drop_when_matches,
    evidence_for_empty,
    evidence_for_fixed,
    porting_change,
    render_patch_table,
    render_report,
    with_applied_upstream_status,
)
from .registry import (
    Fetcher,
    append_release,
    fetch_url,
    index_files,
    index_url,
    newest_version,
    release_from_index,
)
from .runner import Runner, run_subprocess
from .series import Entry, Series
from .testenv import test_python
from .verify import ERROR, FAIL, PASS, TreeTester, Verdict, render_table, verify_target

STATE_FILE = "rebase.json"
REPORT_FILE = "REBASE.md"
DEFAULT_PACKAGE = "sglang"
# NEW_VERSION meaning the newest final release on the index (for the nightly canary).
LATEST = "latest"

# Outcomes of one patch (PatchResult.outcome).
CLEAN = "clean"  # git am applied it as it was
THREE_WAY = "3-way"  # git am --3way merged it
EMPTY = "empty"  # its diff is already upstream: recorded Applied-Upstream
CONFLICT = "conflict"  # git am --3way stopped (--check only: it is skipped and reported)
RESOLVED = "resolved"  # stopped at a conflict; the user resolved it
# --check only: it conflicts, and the port the existing new line records for it applies instead
PORTED = "ported"
FIXED_UPSTREAM = "upstream"  # its tests pass on the pristine new tree: recorded Applied-Upstream
APPLIED_UPSTREAM = "applied-upstream"  # Applied-Upstream already on the old line
CARRIED = frozenset({CLEAN, THREE_WAY, RESOLVED, PORTED})


@dataclass(frozen=True)
class Request:
    new: str
    package: str | None = None
    old: str | None = None
    keep: bool = False
    python: str | None = None
    index: str | None = None


@dataclass
class State:
    """What a rebase changed so far and where it stands; saved as JSON after every step."""

    name: str
    old: str
    new: str
    keep: bool
    python: str
    command: str
    pin_file: str
    # The pin file's text before the rebase appended the new release; None if it did not.
    pin_before: str | None = None
    pin_source: str = ""
    created_tag: bool = False
    created_download: str | None = None
    # The branch (refs/heads/...) or commit the checkout had checked out before.
    head_before: str = ""
    pristine: dict[str, str] = field(default_factory=dict)
    results: list[PatchResult] = field(default_factory=list)
    next_index: int = 0
    stopped_at: str | None = None
    conflict_files: list[str] = field(default_factory=list)
    # --check beside an existing new line: its series folder, whose ports resolve conflicts.
    recorded_ports: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> State:
        data = json.loads(text)
        names = {f.name for f in fields(cls)}
        data["results"] = [PatchResult(**raw) for raw in data.get("results", [])]
        return cls(**{key: value for key, value in data.items() if key in names})


@dataclass(frozen=True)
class ScratchProject(Project):
    """A project whose pins, patches and checkouts live under ``base`` (for `--check`), while its
    tests still run from the real root."""

    base: Path

    @property
    def upstream_dir(self) -> Path:
        return self.base / "upstream"

    @property
    def patches_dir(self) -> Path:
        return self.base / "patches"

    @property
    def scratch_dir(self) -> Path:
        return self.base / "build"


# --- choosing the line ---


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


def _parse_version(version: str) -> Version:
    try:
        return Version(version)
    except InvalidVersion as exc:
        raise CarryError(f"'{version}' is not a PEP 440 version: give the release, e.g. 0.5.23") from exc


def state_path(project: Project, name: str, runner: Runner) -> Path | None:
    git = Git(project.checkout(name), runner)
    return git.state_file(STATE_FILE) if git.exists() else None


def _in_progress(project: Project, runner: Runner) -> list[tuple[Path, State]]:
    found = []
    for name in sorted(project.pins()):
        path = state_path(project, name, runner)
        if path is not None and path.exists():
            found.append((path, State.from_json(path.read_text(encoding="utf-8"))))
    return found


def _save(path: Path, state: State) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(state.to_json(), encoding="utf-8")


# --- the command ---


def rebase(
    project: Project,
    request: Request,
    check: bool = False,
    runner: Runner = run_subprocess,
    fetch: Fetcher = fetch_url,
) -> int:
    """Rebase (or with ``check`` try, in a scratch copy) the old line onto ``request.new``."""
    upstream = choose_upstream(project, request.package)
    old = (
        Target(upstream, upstream.release(request.old)) if request.old else default_target(project, upstream)
    )
    if request.new == LATEST:
        index = index_url(request.index)
        newest = newest_version(upstream.name, index_files(upstream.name, index, fetch))
        if newest is None:
            raise CarryError(f"{index} lists no final release of {upstream.name}: check --index-url")
        print(f"rebase: the newest {upstream.name} on {index} is {newest}")
        if check and newest <= old.release.parsed_version:
            print(f"rebase: {old.label} is the newest release already: nothing to check")
            return 0
        request = dataclasses.replace(request, new=str(newest))
    command = f"carry rebase {request.new} {upstream.name} --upstream {old.version}"
    if _parse_version(request.new) <= old.release.parsed_version:
        raise CarryError(
            f"{upstream.name} {request.new} is not newer than the {old.version} line: "
            "rebase onto a newer release, or name the older line with --upstream"
        )
    series = project.series(old.release, runner)
    if series.carries_nothing is not None:
        raise CarryError(
            f"{series.label} carries nothing on purpose, so there is nothing to rebase: pin {request.new} "
            f"and write patches/{upstream.name}/{request.new}/carries-nothing"
        )
    if check:
        # The scratch copy rebuilds the old line from patches/ and needs only its pristine tree:
        # the checkout's branches and state (and an existing new line) do not matter to it.
        series.require_something_to_carry()
        series.require_current_revision()
        if Git(project.checkout(upstream.name), runner).rev(old.upstream_tag) is None:
            raise CarryError(
                f"no checkout of {old.label} in upstream/{upstream.name}: "
                f"run `carry fetch {upstream.name} --upstream {old.version}` first"
            )
        return _check(project, request, upstream, old, runner, fetch)
    for _, state in _in_progress(project, runner):
        raise CarryError(
            f"a carry rebase of {state.name} {state.old} -> {state.new} is in progress: "
            "`carry rebase --continue` after resolving, or `carry rebase --abort`; nothing was changed"
        )
    git = Git(project.checkout(upstream.name), runner)
    if git.exists():
        require_no_operation(git, old, "carry rebase")
        require_clean(git, old, "carry rebase")
    git = require_line_ready(project, old, series, runner, "carry rebase")
    new_branch = f"carry/{request.new}"
    if git.rev(new_branch) is not None:
        raise CarryError(
            f"upstream/{upstream.name} already has {new_branch}: delete it (`git branch -D {new_branch}`) "
            "or work on it with apply/export; nothing was changed"
        )
    new_series_dir = project.patches_dir / upstream.name / request.new
    if new_series_dir.exists():
        raise CarryError(
            f"patches/{upstream.name}/{request.new} already exists: the line has been rebased; "
            "remove it to rebase again; nothing was changed"
        )
    pinned, pin_text = _pin(project, upstream, old.release, request, fetch)
    python = request.python or test_python(project, pinned or upstream.release(request.new))
    head = git.run("symbolic-ref", "--quiet", "HEAD", check=False)
    state = State(
        name=upstream.name,
        old=old.version,
        new=request.new,
        keep=request.keep,
        python=python,
        command=command,
        pin_file=str(_pin_file(project, upstream.name)),
        pin_source=pin_text,
        head_before=head.stdout.strip() if head.returncode == 0 else (git.rev("HEAD") or ""),
    )
    path = git.state_file(STATE_FILE)
    _save(path, state)
    with _undone_unless_done(project, git, path, state):
        if pinned is not None:
            state.pin_before = _read_pin(state)
            _save(path, state)  # before the change, so that even a killed rebase can be aborted
            append_release(Path(state.pin_file), pinned)
        failing = _run(project, git, path, state, runner, stop_at_conflict=True)
    return conclude(state, failing)


def _pin_file(project: Project, name: str) -> Path:
    return project.upstream_dir / f"{name}.toml"


def _read_pin(state: State) -> str:
    # Bytes decoded by hand: read_text would turn CRLF into LF, and --abort restores bytes.
    return Path(state.pin_file).read_bytes().decode("utf-8", "surrogateescape")


def _pin(
    project: Project, upstream: Upstream, old: Release, request: Request, fetch: Fetcher
) -> tuple[Release | None, str]:
    """The release to append to the pin file (None when it is pinned already, and then trusted:
    it was reviewed when committed, and fetch checks every download against it)."""
    if upstream.has_version(request.new):
        return None, f"already pinned in upstream/{upstream.name}.toml (used as committed)"
    index = index_url(request.index)
    release = release_from_index(old, request.new, index_files(upstream.name, index, fetch), index)
    return release, f"read from {index} and appended to upstream/{upstream.name}.toml (review and commit it)"


@contextmanager
def _undone_unless_done(project: Project, git: Git, path: Path, state: State) -> Iterator[None]:
    """Undo everything the rebase did when it fails other than by stopping at a conflict."""
    try:
        yield
    except ConflictStop:
        raise
    except BaseException:
        _undo(project, git, path, state)
        raise


class ConflictStop(CarryError):
    """The replay stopped at a conflict; the state is saved for --continue or --abort."""


# --- the steps ---


def _new_target(project: Project, state: State) -> Target:
    upstream = load_upstream(Path(state.pin_file)) if Path(state.pin_file).exists() else None
    if upstream is None or not upstream.has_version(state.new):
        raise CarryError(
            f"upstream/{state.name}.toml no longer pins {state.new}: `carry rebase --abort` and start again"
        )
    return Target(upstream, upstream.release(state.new))


def _old_series(project: Project, state: State, runner: Runner) -> Series:
    upstream = project.pins()[state.name]
    return project.series(upstream.release(state.old), runner)


def _run(
    project: Project, git: Git, path: Path, state: State, runner: Runner, stop_at_conflict: bool
) -> list[str]:
    """Lay down the new release, test the old entries on it and replay them, then finish."""
    target = _new_target(project, state)
    series = _old_series(project, state, runner)
    if git.rev(target.upstream_tag) is None:
        pinned = select_file(target.release)
        cached = project.downloads_dir / pinned.filename
        if not cached.exists():
            state.created_download = pinned.filename
            _save(path, state)
        artifact = download(project, target, pinned, runner)
        state.created_tag = True
        _save(path, state)
        print(f"rebase: {lay_checkout(project, target, artifact, runner)}")
    state.pristine = _pristine_outcomes(project, target, git, series, state.python, runner)
    git.run("checkout", "--quiet", "-b", target.branch, target.upstream_tag)
    _save(path, state)
    return _replay(project, git, path, state, target, series, runner, stop_at_conflict)


def _pristine_outcomes(
    project: Project, target: Target, git: Git, series: Series, python: str, runner: Runner
) -> dict[str, str]:
    """Each entry's tests on the pristine new tree: pass means upstream has the fix."""
    tested = [entry for entry in series.entries if entry.tests]
    if not tested:
        return {}
    pristine = git.rev(target.upstream_tag)
    assert pristine is not None
    print(f"rebase: running the series' tests on pristine {target.label}", flush=True)
    tester = TreeTester(project, target, git, python, runner)
    try:
        found = entry_outcomes(tester, pristine, tested)
    finally:
        tester.close()
    for filename, outcome in found.items():
        print(f"rebase: pristine {target.version}: {filename}: its tests {outcome}")
    return found


def entry_outcomes(tester: TreeTester, commit: str, entries: Sequence[Entry]) -> dict[str, str]:
    """Each entry's outcome at ``commit``: pass only if all its test ids pass. One pytest run for
    all of them where the tester can do that (``outcomes``), else one run per entry."""
    all_at_once = getattr(tester, "outcomes", None)
    if all_at_once is None:
        return {entry.filename: tester.outcome(commit, entry.tests) for entry in entries}
    ids = list(dict.fromkeys(test for entry in entries for test in entry.tests))
    per_id: dict[str, str] = all_at_once(commit, ids)
    combined = {}
    for entry in entries:
        found = [per_id.get(test, ERROR) for test in entry.tests]
        combined[entry.filename] = ERROR if ERROR in found else (PASS if set(found) == {PASS} else FAIL)
    return combined


def _replay(
    project: Project,
    git: Git,
    path: Path,
    state: State,
    target: Target,
    series: Series,
    runner: Runner,
    stop_at_conflict: bool,
) -> list[str]:
    """Replay the entries from ``state.next_index`` on, then finish; returns what is not proven."""
    entries = series.entries
    while state.next_index < len(entries):
        entry = entries[state.next_index]
        result = _replay_one(project, git, state, target, series, entry, stop_at_conflict)
        if result.outcome == CONFLICT and stop_at_conflict:
            _save(path, state)
            files = ", ".join(state.conflict_files) or "see `git am --show-current-patch=diff`"
            raise ConflictStop(
                f"{series.label}/{entry.filename} conflicts with {target.label} in {files}: resolve them "
                f"in upstream/{target.name}, `git add` them (or commit), then `carry rebase --continue`; "
                "or `carry rebase --abort` to undo the whole rebase"
            )
        state.results.append(result)
        state.next_index += 1
        _save(path, state)
    return _finish(project, git, path, state, target, runner)


def _replay_one(
    project: Project,
    git: Git,
    state: State,
    target: Target,
    series: Series,
    entry: Entry,
    stop_at_conflict: bool,
) -> PatchResult:
    """Put one entry on the new branch and say how it went."""
    patch = series.directory / entry.filename
    pristine = state.pristine.get(entry.filename, "-")
    result = PatchResult(
        entry.filename, entry.subject, "", pristine, drop_when_matches(entry, state.name, state.new)
    )
    if entry.applied_upstream:
        git.run("am", "--keep", "--committer-date-is-author-date", "--empty=keep", str(patch))
        result.outcome = APPLIED_UPSTREAM
        if pristine != PASS:
            result.note = f"UPSTREAM REGRESSED? its tests {pristine} on pristine {state.new}"
        _print_step(result)
        return result
    if pristine == PASS and not state.keep:
        message = with_applied_upstream_status(
            _message(git, patch, project), evidence_for_fixed(entry, state.name, state.old, state.new)
        )
        _commit_empty(git, patch, project, message)
        result.outcome = FIXED_UPSTREAM
        _print_step(result)
        return result
    if pristine == PASS:
        result.note = "its tests pass on pristine: kept as a diff (--keep)"
    clean = git.run("apply", "--check", str(patch), check=False).returncode == 0
    before = git.rev("HEAD")
    am = git.run("am", "--3way", "--keep", "--committer-date-is-author-date", str(patch), check=False)
    if am.returncode != 0:
        if git.operation_in_progress() is None:
            raise CarryError(f"git am failed in {git.repo}: {summarize_git_output(am.output)}")
        state.stopped_at = before
        state.conflict_files = git.unmerged_paths() or git.current_patch_paths()
        result.outcome = CONFLICT
        result.resolved_files = list(state.conflict_files)
        if not stop_at_conflict:
            git.run("am", "--abort")  # --check goes on with the next patch
            state.stopped_at = None
            if _apply_recorded_port(git, state, entry):
                result.outcome = PORTED
        _print_step(result)
        return result
    after = git.rev("HEAD")
    if after == before:
        message = with_applied_upstream_status(
            _message(git, patch, project),
            evidence_for_empty(entry, state.name, state.old, state.new, pristine),
        )
        _commit_empty(git, patch, project, message)
        result.outcome = EMPTY
        if pristine != PASS:
            result.note = f"its diff is upstream, but its tests {pristine} on pristine {state.new}"
    else:
        result.outcome = CLEAN if clean else THREE_WAY
        if not clean:
            assert after is not None
            result.change = porting_change(
                patch.read_text(encoding="utf-8", errors="surrogateescape"), _diff(git, after)
            )
    _print_step(result)
    return result


def _apply_recorded_port(git: Git, state: State, entry: Entry) -> bool:
    """Whether the new line already in patches/ ports this entry (same file name) in a form that
    applies where the old one conflicted; if so it is now committed."""
    if state.recorded_ports is None:
        return False
    port = Path(state.recorded_ports) / entry.filename
    if not port.is_file():
        return False
    am = git.run("am", "--3way", "--keep", "--committer-date-is-author-date", str(port), check=False)
    if am.returncode != 0:
        git.run("am", "--abort", check=False)
        return False
    return True


def _print_step(result: PatchResult) -> None:
    note = f" ({result.note})" if result.note else ""
    print(f"rebase: {result.filename}: {result.outcome}{note}", flush=True)


def _diff(git: Git, commit: str) -> str:
    return git.run("show", "--format=", "--full-index", commit).stdout


def _message(git: Git, patch: Path, project: Project) -> str:
    """The commit message git am would make of ``patch``: subject, blank line, body."""
    info, body = _mailinfo(git, patch, project)
    return info.get("Subject", "") + "\n\n" + body


def _mailinfo(git: Git, patch: Path, project: Project) -> tuple[dict[str, str], str]:
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=project.scratch_dir, prefix="mailinfo-") as tmp:
        msg, diff = Path(tmp) / "msg", Path(tmp) / "patch"
        text = patch.read_text(encoding="utf-8", errors="surrogateescape")
        out = git.run("mailinfo", "-k", str(msg), str(diff), stdin=text).stdout
        body = msg.read_text(encoding="utf-8", errors="surrogateescape")
    info = {}
    for line in out.splitlines():
        key, _, value = line.partition(": ")
        info[key] = value
    return info, body


def _commit_empty(git: Git, patch: Path, project: Project, message: str) -> None:
    """An empty commit with ``message``, authored as the patch was (what git am would record)."""
    info, _ = _mailinfo(git, patch, project)
    env = {
        "GIT_AUTHOR_NAME": info.get("Author", ""),
        "GIT_AUTHOR_EMAIL": info.get("Email", ""),
        "GIT_AUTHOR_DATE": info.get("Date", ""),
        "GIT_COMMITTER_DATE": info.get("Date", ""),
    }
    git.run(
        "commit", "--quiet", "--allow-empty", "--no-verify", "--cleanup=verbatim", "-F", "-",
        env=env, stdin=message.rstrip("\n") + "\n",
    )  # fmt: skip


def _finish(
    project: Project, git: Git, path: Path, state: State, target: Target, runner: Runner
) -> list[str]:
    """Export the new line, verify it, write REBASE.md, print the table; the rebase is then over."""
    conflicts = [r for r in state.results if r.outcome == CONFLICT]
    verdicts: list[Verdict] | None = None
    new_names: list[str] = []
    if not conflicts:
        export(project, target, runner=runner)
        new_series = project.series(target.release, runner)
        new_names = [entry.filename for entry in new_series.entries]
        verdicts = verify_target(project, target, state.python, runner)
    old_range = f"upstream/{state.old}..carry/{state.old}"
    new_range = f"{target.upstream_tag}..HEAD"
    range_diff = git.run("range-diff", "--no-color", old_range, new_range, check=False).stdout
    verify_table = render_table([(target.label, v) for v in verdicts]) if verdicts else ""
    report = render_report(state, new_names, range_diff, verify_table, verdicts is not None)
    if not conflicts:
        (series_dir := project.patches_dir / state.name / state.new).mkdir(parents=True, exist_ok=True)
        (series_dir / REPORT_FILE).write_text(report, encoding="utf-8")
    print(render_patch_table(state.results))
    for result in state.results:
        for condition in result.drop_when:
            print(
                f"rebase: {result.filename}: its Drop-When admits {state.new} ({condition}): {result.outcome}"
            )
    if verify_table:
        print(verify_table)
    path.unlink(missing_ok=True)
    return failing_patches(state, verdicts)


def conclude(state: State, failing: list[str]) -> int:
    if failing:
        raise CarryError(f"{state.name} {state.old} -> {state.new}: not proven: {'; '.join(failing)}")
    print(
        f"rebase: {state.name} {state.old} -> {state.new}: every patch carries or is upstream, verify green"
    )
    return 0


def failing_patches(state: State, verdicts: list[Verdict] | None) -> list[str]:
    failing = []
    for result in state.results:
        if result.outcome == CONFLICT:
            failing.append(f"{result.filename} conflicts ({', '.join(result.resolved_files)})")
        elif result.outcome in (APPLIED_UPSTREAM, EMPTY) and result.pristine != PASS:
            failing.append(
                f"{result.filename} is upstream but its tests {result.pristine} on pristine {state.new}"
            )
    if verdicts is None:
        failing.append("the new line was not verified")
    else:
        failing.extend(f"{v.entry.filename} {v.label}" for v in verdicts if not v.ok)
    return failing


# --- --continue and --abort ---


def _the_one_in_progress(project: Project, runner: Runner) -> tuple[Path, State, Git]:
    found = _in_progress(project, runner)
    if not found:
        raise CarryError("no carry rebase is in progress: start one with `carry rebase NEW_VERSION`")
    path, state = found[0]
    return path, state, Git(project.checkout(state.name), runner)


def rebase_continue(project: Project, runner: Runner = run_subprocess) -> int:
    path, state, git = _the_one_in_progress(project, runner)
    target = _new_target(project, state)
    series = _old_series(project, state, runner)
    if state.stopped_at is None:
        # It failed after the last conflict (while exporting, say): go on from where it was.
        failing = _replay(project, git, path, state, target, series, runner, stop_at_conflict=True)
        return conclude(state, failing)
    entry = series.entries[state.next_index]
    label = f"{series.label}/{entry.filename}"
    _take_resolution(git, target, state, label)
    result = PatchResult(
        entry.filename, entry.subject, RESOLVED, state.pristine.get(entry.filename, "-"),
        drop_when_matches(entry, state.name, state.new), resolved_files=list(state.conflict_files),
    )  # fmt: skip
    tip = git.rev("HEAD")
    assert tip is not None
    text = (series.directory / entry.filename).read_text(encoding="utf-8", errors="surrogateescape")
    result.change = porting_change(text, _diff(git, tip))
    _print_step(result)
    state.results.append(result)
    state.next_index += 1
    state.stopped_at = None
    state.conflict_files = []
    _save(path, state)
    failing = _replay(project, git, path, state, target, series, runner, stop_at_conflict=True)
    return conclude(state, failing)


def _take_resolution(git: Git, target: Target, state: State, label: str) -> None:
    """Accept the user's resolution: staged (we run `git am --continue`) or already committed."""
    if git.current_branch() != target.branch:
        raise CarryError(
            f"upstream/{target.name} is not on {target.branch}: `git checkout {target.branch}`, then "
            "`carry rebase --continue`"
        )
    operation = git.operation_in_progress()
    head = git.rev("HEAD")
    if operation is not None and operation.name == "am":
        unmerged = git.unmerged_paths()
        if unmerged:
            raise CarryError(
                f"{label} still has unresolved files in upstream/{target.name} ({', '.join(unmerged)}): "
                "resolve them and `git add` them, then `carry rebase --continue`"
            )
        if head == state.stopped_at:
            done = git.run("am", "--continue", check=False)
            if done.returncode != 0:
                raise CarryError(
                    f"git am --continue did not commit {label} ({summarize_git_output(done.output)}): "
                    "stage the resolution with `git add`, then `carry rebase --continue`; or "
                    "`carry rebase --abort`"
                )
        else:
            git.run("am", "--quit")  # the user committed the resolution with git commit
    elif operation is not None:
        raise CarryError(operation.describe(f"upstream/{target.name}") + ", then `carry rebase --continue`")
    assert state.stopped_at is not None
    added = git.commits(state.stopped_at, "HEAD")
    if not added:
        raise CarryError(
            f"{label} was not committed on {target.branch} (was `git am --abort` or `--skip` run?): "
            "`carry rebase --abort` and start again"
        )
    if len(added) != 1 or not git.is_ancestor(state.stopped_at, "HEAD"):
        raise CarryError(
            f"{target.branch} has {len(added)} new commits where {label} should be one: squash them into "
            "one (`git reset --soft HEAD~N` and `git commit`), then `carry rebase --continue`"
        )
    if git.dirty_paths():
        raise CarryError(
            f"upstream/{target.name} has uncommitted changes besides the resolution of {label}: commit "
            "or discard them, then `carry rebase --continue`"
        )


def rebase_abort(project: Project, runner: Runner = run_subprocess) -> int:
    path, state, git = _the_one_in_progress(project, runner)
    _undo(project, git, path, state)
    print(f"rebase: aborted the rebase of {state.name} {state.old} -> {state.new}; everything is as it was")
    return 0


def _undo(project: Project, git: Git, path: Path, state: State) -> None:
    """Put back everything the rebase changed, in the reverse order it changed it."""
    operation = git.operation_in_progress()
    if operation is not None and operation.name == "am":
        git.run("am", "--abort", check=False)
    if state.head_before:
        if state.head_before.startswith("refs/heads/"):
            git.run("checkout", "--quiet", "--force", state.head_before.removeprefix("refs/heads/"))
        else:
            git.run("checkout", "--quiet", "--force", "--detach", state.head_before)
        git.run("clean", "--quiet", "--force", "-d")
    new_branch = f"carry/{state.new}"
    if git.rev(new_branch) is not None:
        git.run("branch", "--quiet", "-D", new_branch)
    if state.created_tag and git.rev(f"upstream/{state.new}") is not None:
        git.run("tag", "--delete", f"upstream/{state.new}")
    if state.created_download:
        (project.downloads_dir / state.created_download).unlink(missing_ok=True)
    shutil.rmtree(project.patches_dir / state.name / state.new, ignore_errors=True)
    if state.pin_before is not None:
        Path(state.pin_file).write_bytes(state.pin_before.encode("utf-8", "surrogateescape"))
    git.run("worktree", "prune", check=False)
    path.unlink(missing_ok=True)


# --- --check ---


def _check(
    project: Project, request: Request, upstream: Upstream, old: Target, runner: Runner, fetch: Fetcher
) -> int:
    """The whole rebase in a scratch copy under build/: the repo's files, branches and tags stay
    as they are."""
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(dir=project.scratch_dir, prefix="rebase-check-"))
    print(f"rebase: --check works in {base.relative_to(project.root)} and removes it at the end", flush=True)
    try:
        scratch = ScratchProject(project.root, base)
        _copy_into_scratch(project, scratch, upstream.name, old, runner)
        scratch_upstream = scratch.pins()[upstream.name]
        pinned, pin_text = _pin(scratch, scratch_upstream, old.release, request, fetch)
        # The environments live in the real checkout, not in the scratch copy.
        python = request.python or test_python(project, pinned or scratch_upstream.release(request.new))
        git = Git(scratch.checkout(upstream.name), runner)
        state = State(
            name=upstream.name,
            old=old.version,
            new=request.new,
            keep=request.keep,
            python=python,
            command=f"carry rebase --check {request.new} {upstream.name} --upstream {old.version}",
            pin_file=str(_pin_file(scratch, upstream.name)),
            pin_source=pin_text.replace(str(base) + "/", ""),
        )
        recorded = project.patches_dir / upstream.name / request.new
        if recorded.is_dir():
            state.recorded_ports = str(recorded)
            print(
                f"rebase: patches/{upstream.name}/{request.new} exists: a patch that conflicts is "
                "tried in the form that line records",
                flush=True,
            )
        if pinned is not None:
            append_release(Path(state.pin_file), pinned)
        failing = _run(scratch, git, git.state_file(STATE_FILE), state, runner, stop_at_conflict=False)
        return conclude(state, failing)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _copy_into_scratch(
    project: Project, scratch: ScratchProject, name: str, old: Target, runner: Runner
) -> None:
    """Pins and the old series copied, downloads linked, the checkout's pristine tags fetched into
    a new repository that borrows the real one's objects (nothing is written there), and the old
    line rebuilt there from its patches with `carry apply`."""
    scratch.upstream_dir.mkdir(parents=True)
    for pin in project.upstream_dir.glob("*.toml"):
        shutil.copy2(pin, scratch.upstream_dir / pin.name)
    shutil.copytree(project.patches_dir / name / old.version, scratch.patches_dir / name / old.version)
    scratch.downloads_dir.mkdir()
    if project.downloads_dir.is_dir():
        for cached in project.downloads_dir.iterdir():
            if cached.is_file() and not cached.name.startswith("."):
                (scratch.downloads_dir / cached.name).symlink_to(cached.resolve())
    real = Git(project.checkout(name), runner)
    clone = Git(scratch.checkout(name), runner)
    clone.repo.mkdir()
    clone.run("init", "--quiet")
    objects = real.out("rev-parse", "--path-format=absolute", "--git-common-dir")
    (clone.git_path("objects") / "info" / "alternates").write_text(f"{objects}/objects\n")
    exclude = real.git_path("info/exclude")
    if exclude.exists():
        clone.git_path("info").mkdir(exist_ok=True)
        shutil.copy2(exclude, clone.git_path("info/exclude"))
    clone.run("fetch", "--quiet", "--no-tags", str(real.repo), "refs/tags/upstream/*:refs/tags/upstream/*")
    apply(scratch, Target(scratch.pins()[name], old.release), runner)
