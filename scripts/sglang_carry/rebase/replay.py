"""Replaying the old series onto the new branch, one entry at a time, with what a conflict does
decided by a policy: stop (for --continue), or skip it and go on, trying first the port that an
existing new line records (--check)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from ..errors import CarryError
from ..git import Git, summarize_git_output
from ..progress import Reporter
from ..project import Project, Target
from ..runner import Runner
from ..series import Entry, Series
from ..verify import NONE, PASS
from .journal import ConflictStop, State, save
from .outcome import Outcome, PatchResult
from .report import (
    drop_when_matches,
    evidence_for_empty,
    evidence_for_fixed,
    porting_change,
    with_applied_upstream_status,
)


class ConflictPolicy(enum.Enum):
    STOP = "stop"  # save the journal and stop: the user resolves, then --continue
    SKIP = "skip"  # abort that patch's git am and go on (--check)
    RECORDED_PORT = "recorded-port"  # as SKIP, but first try the new line's recorded port


@dataclass
class Session:
    """One rebase at work: where it works and how it reports (passed to every step)."""

    project: Project
    git: Git
    journal: Path
    state: State
    runner: Runner
    report: Reporter
    # --check: in a scratch copy, changing nothing of the checkout.
    check: bool = False

    def save(self) -> None:
        save(self.journal, self.state)


def replay(session: Session, target: Target, series: Series, policy: ConflictPolicy) -> None:
    """Replay the entries from ``state.next_index`` on; a conflict under STOP raises ConflictStop."""
    state = session.state
    while state.next_index < len(series.entries):
        entry = series.entries[state.next_index]
        result = _replay_one(session, target, series, entry, policy)
        session.report.step(result.progress())
        if result.outcome is Outcome.CONFLICT and policy is ConflictPolicy.STOP:
            session.save()
            files = ", ".join(state.conflict_files) or "see `git am --show-current-patch=diff`"
            raise ConflictStop(
                f"{series.label}/{entry.filename} conflicts with {target.label} in {files}: resolve them "
                f"in upstream/{target.name}, `git add` them (or commit), then `carry rebase --continue`; "
                "or `carry rebase --abort` to undo the whole rebase"
            )
        state.results.append(result)
        state.next_index += 1
        session.save()


def _replay_one(
    session: Session, target: Target, series: Series, entry: Entry, policy: ConflictPolicy
) -> PatchResult:
    """Put one entry on the new branch and say how it went."""
    git, state = session.git, session.state
    patch = series.directory / entry.filename
    pristine = state.pristine.get(entry.filename, NONE)
    result = PatchResult(
        entry.filename, entry.subject, None, pristine, drop_when_matches(entry, state.name, state.new)
    )
    if entry.applied_upstream:
        git.run("am", "--keep", "--committer-date-is-author-date", "--empty=keep", str(patch))
        result.outcome = Outcome.APPLIED_UPSTREAM
        if pristine != PASS:
            result.note = f"UPSTREAM REGRESSED? its tests {pristine} on pristine {state.new}"
        return result
    if pristine == PASS and not state.keep:
        message = with_applied_upstream_status(
            git, message_of(git, patch), evidence_for_fixed(entry, state.name, state.old, state.new)
        )
        _commit_empty(git, patch, message)
        result.outcome = Outcome.FIXED_UPSTREAM
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
        result.outcome = Outcome.CONFLICT
        result.resolved_files = list(state.conflict_files)
        if policy is not ConflictPolicy.STOP:
            git.run("am", "--abort")
            state.stopped_at = None
            if policy is ConflictPolicy.RECORDED_PORT and _apply_recorded_port(git, state, entry):
                result.outcome = Outcome.PORTED
        return result
    after = git.rev("HEAD")
    if after == before:
        message = with_applied_upstream_status(
            git,
            message_of(git, patch),
            evidence_for_empty(entry, state.name, state.old, state.new, pristine),
        )
        _commit_empty(git, patch, message)
        result.outcome = Outcome.EMPTY
        if pristine != PASS:
            result.note = f"its diff is upstream, but its tests {pristine} on pristine {state.new}"
    else:
        result.outcome = Outcome.CLEAN if clean else Outcome.THREE_WAY
        if not clean:
            assert after is not None
            result.change = porting_change(
                patch.read_text(encoding="utf-8", errors="surrogateescape"), diff_of(git, after)
            )
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


def diff_of(git: Git, commit: str) -> str:
    return git.run("show", "--format=", "--full-index", commit).stdout


def message_of(git: Git, patch: Path) -> str:
    """The commit message git am would make of ``patch``: subject, blank line, body."""
    return git.mailinfo(patch.read_text(encoding="utf-8", errors="surrogateescape")).message


def _commit_empty(git: Git, patch: Path, message: str) -> None:
    """An empty commit with ``message``, authored as the patch was (what git am would record)."""
    mail = git.mailinfo(patch.read_text(encoding="utf-8", errors="surrogateescape"))
    env = {
        "GIT_AUTHOR_NAME": mail.author,
        "GIT_AUTHOR_EMAIL": mail.email,
        "GIT_AUTHOR_DATE": mail.date,
        "GIT_COMMITTER_DATE": mail.date,
    }
    git.run(
        "commit", "--quiet", "--allow-empty", "--no-verify", "--cleanup=verbatim", "-F", "-",
        env=env, stdin=message.rstrip("\n") + "\n",
    )  # fmt: skip
