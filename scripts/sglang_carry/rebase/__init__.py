"""`carry rebase`: move a line's series onto a new upstream release.

The steps: pin the new release (from the package index, unless it is pinned already), lay down its
pristine tree, run every entry's tests on that pristine tree (an entry whose tests pass there is
fixed upstream), replay the old series onto ``carry/<new>`` one patch at a time with
``git am --3way``, export the new line, verify it and write ``REBASE.md`` beside it.

The package: journal.py (the saved state and its undo), replay.py (one entry after another, and
the conflict policy), steps.py (the steps around the replay, and the result), check.py (--check
in a scratch copy), report.py (REBASE.md and the evidence in a dropped entry), outcome.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ..errors import CarryError
from ..git import Git, summarize_git_output
from ..line_state import require_clean, require_line_ready, require_no_operation
from ..progress import SILENT, Reporter
from ..project import Project, Target, default_target
from ..registry import Fetcher, append_release, fetch_url, index_files, index_url, newest_version
from ..runner import Runner, run_subprocess
from ..testenv import test_python
from ..trees import require_imported_trees_ready
from ..verify import NONE
from . import check as check_in_scratch
from .journal import (
    STATE_FILE,
    State,
    in_progress,
    read_pin,
    save,
    state_path,
    the_one_in_progress,
    undo,
    undone_unless_done,
)
from .outcome import Outcome, PatchResult
from .replay import ConflictPolicy, Session, diff_of, replay
from .report import drop_when_matches, porting_change
from .steps import (
    REPORT_FILE,
    Aborted,
    RebaseResult,
    Request,
    begin,
    choose_upstream,
    finish,
    new_target,
    old_series,
    parse_version,
    pin,
    pin_file,
    run,
)

# NEW_VERSION meaning the newest final release on the index (for the nightly canary).
LATEST = "latest"

__all__ = [
    "LATEST",
    "REPORT_FILE",
    "STATE_FILE",
    "Aborted",
    "Outcome",
    "PatchResult",
    "RebaseResult",
    "Request",
    "rebase",
    "rebase_abort",
    "rebase_continue",
    "state_path",
]


def rebase(
    project: Project,
    request: Request,
    check: bool = False,
    runner: Runner = run_subprocess,
    fetch: Fetcher = fetch_url,
    report: Reporter = SILENT,
) -> RebaseResult:
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
        report.step(f"rebase: the newest {upstream.name} on {index} is {newest}")
        if check and newest <= old.release.parsed_version:
            return RebaseResult(upstream.name, old.version, str(newest), True, (), None, (), up_to_date=True)
        request = dataclasses.replace(request, new=str(newest))
    command = f"carry rebase {request.new} {upstream.name} --upstream {old.version}"
    if parse_version(request.new) <= old.release.parsed_version:
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
        # Before anything is pinned or replayed: every step that runs tests imports the others.
        again = f"carry rebase --check {request.new} {upstream.name} --upstream {old.version}"
        require_imported_trees_ready(project, old, again, runner)
        return check_in_scratch.check(project, request, upstream, old, runner, fetch, report)
    for _, state in in_progress(project, runner):
        raise CarryError(
            f"a carry rebase of {state.name} {state.old} -> {state.new} is in progress: "
            "`carry rebase --continue` after resolving, or `carry rebase --abort`; nothing was changed"
        )
    git = Git(project.checkout(upstream.name), runner)
    if git.exists():
        require_no_operation(git, old, "carry rebase")
        require_clean(git, old, "carry rebase")
    git = require_line_ready(project, old, series, runner, "carry rebase")
    require_imported_trees_ready(project, old, command, runner)
    new_branch = f"carry/{request.new}"
    if git.rev(new_branch) is not None:
        raise CarryError(
            f"upstream/{upstream.name} already has {new_branch}: delete it (`git branch -D {new_branch}`) "
            "or work on it with apply/export; nothing was changed"
        )
    if (project.patches_dir / upstream.name / request.new).exists():
        raise CarryError(
            f"patches/{upstream.name}/{request.new} already exists: the line has been rebased; "
            "remove it to rebase again; nothing was changed"
        )
    pinned, pin_text = pin(upstream, old.release, request, fetch)
    python = request.python or test_python(project, pinned or upstream.release(request.new))
    head = git.run("symbolic-ref", "--quiet", "HEAD", check=False)
    head_before = head.stdout.strip() if head.returncode == 0 else (git.rev("HEAD") or "")
    state = begin(request, old, python, command, pin_file(project, upstream.name), pin_text, head_before)
    session = Session(project, git, git.state_file(STATE_FILE), state, runner, report)
    session.save()
    with undone_unless_done(project, git, session.journal, state):
        if pinned is not None:
            state.pin_before = read_pin(state)
            session.save()  # before the change, so that even a killed rebase can be aborted
            append_release(Path(state.pin_file), pinned)
        return run(session, ConflictPolicy.STOP)


def rebase_continue(
    project: Project, runner: Runner = run_subprocess, report: Reporter = SILENT
) -> RebaseResult:
    path, state, git = the_one_in_progress(project, runner)
    session = Session(project, git, path, state, runner, report)
    target = new_target(state)
    require_imported_trees_ready(project, target, "carry rebase --continue", runner)
    series = old_series(session)
    if state.stopped_at is not None:
        entry = series.entries[state.next_index]
        label = f"{series.label}/{entry.filename}"
        _take_resolution(git, target, state, label)
        result = PatchResult(
            entry.filename, entry.subject, Outcome.RESOLVED, state.pristine.get(entry.filename, NONE),
            drop_when_matches(entry, state.name, state.new), resolved_files=list(state.conflict_files),
        )  # fmt: skip
        tip = git.rev("HEAD")
        assert tip is not None
        text = (series.directory / entry.filename).read_text(encoding="utf-8", errors="surrogateescape")
        result.change = porting_change(text, diff_of(git, tip))
        report.step(result.progress())
        state.results.append(result)
        state.next_index += 1
        state.stopped_at = None
        state.conflict_files = []
        save(path, state)
    # Else it failed after the last conflict (while exporting, say): it goes on from where it was.
    replay(session, target, series, ConflictPolicy.STOP)
    return finish(session, target)


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


def rebase_abort(project: Project, runner: Runner = run_subprocess) -> Aborted:
    path, state, git = the_one_in_progress(project, runner)
    undo(project, git, path, state)
    return Aborted(state.name, state.old, state.new)
