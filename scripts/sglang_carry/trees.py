"""Which upstream tree a test run imports, whatever branch the shared checkout is on.

A test that imported ``upstream/<name>`` as it stood ran against whichever line the last command
left checked out: after the line tests (which apply the oldest line last) the tool and CI tests
imported 0.5.20's tree and failed on modules only the default line has. So a run names its tree:
an explicit CARRY_TREE_<NAME>, else the default line's carry branch. Where the checkout is on that
branch, the checkout itself (a developer's uncommitted edits are what they mean to test); else a
detached worktree of the branch under build/default-trees/, refreshed when the branch moves.

Commands that must switch the checkout to another line for a while (the line tests, the e2e's
build of a line's wheel) do so inside ``found_branch_restored``, so none leaves the checkout on
another line than it found.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import CarryError
from .git import Git
from .line_state import DIFFERS, MISSING, NOT_DESCENDING, branch_state
from .project import Project, Target, default_target
from .runner import Runner, run_subprocess

DEFAULT_TREES = "default-trees"
# Laying down a worktree of sglang takes seconds; a holder of this much longer is stuck.
LOCK_TIMEOUT_S = 600.0
LOCK_POLL_S = 0.1


def tree_env_var(name: str) -> str:
    """Tests find the upstream tree to import through this variable (see tests/upstream/conftest.py)."""
    return f"CARRY_TREE_{name.upper()}"


@dataclass(frozen=True)
class DefaultTree:
    target: Target
    folder: Path  # the package's source folder inside the tree (the pin's source_subdir)
    is_checkout: bool  # the checkout itself (on the default branch), not a worktree of it


def default_tree(
    project: Project, name: str, runner: Runner = run_subprocess, lock_timeout_s: float = LOCK_TIMEOUT_S
) -> DefaultTree:
    """The tree of ``name``'s default line, at its carry branch's tip."""
    pins = project.pins()
    if name not in pins:
        raise CarryError(f"unknown upstream '{name}' (pinned: {', '.join(sorted(pins))})")
    target = default_target(project, pins[name])
    subdir = target.upstream.source_subdir
    git = Git(project.checkout(name), runner)
    if not git.exists():
        raise CarryError(
            f"no checkout in upstream/{name}: run `./scripts/carry fetch && ./scripts/carry apply`"
        )
    tip = git.rev(target.branch)
    if tip is None:
        raise CarryError(
            f"upstream/{name} has no branch {target.branch} (the default line): run `./scripts/carry apply`"
        )
    if git.current_branch() == target.branch:
        return DefaultTree(target, _inside(project.checkout(name), subdir), is_checkout=True)
    folder = project.scratch_dir / DEFAULT_TREES / f"{name}-{target.version}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Test processes started side by side (`carry verify` runs a few trees at a time) each resolve
    # this tree: unlocked, one removed the worktree while another laid it down.
    with _held(folder.with_name(f"{folder.name}.lock"), lock_timeout_s):
        worktree = Git(folder, runner)
        if not (worktree.exists() and worktree.rev("HEAD") == tip and not worktree.dirty_paths()):
            git.fresh_worktree(folder, tip)
    return DefaultTree(target, _inside(folder, subdir), is_checkout=False)


def require_imported_trees_ready(
    project: Project, tested: Target, command: str, runner: Runner = run_subprocess
) -> None:
    """The tests of any line import every pinned package: the tested line's from the tree under
    test, each other one from its default tree (``default_tree``), unless CARRY_TREE_<NAME> names
    a tree. A verdict is only about the tested line's patches if those other trees are what
    patches/ says: a pulled series not applied yet made an sglang entry read "fail fail WRONG"
    for a test that needed the newer kvcached series. So each must be laid down, reproduce its
    series and, where the checkout itself is imported, hold no uncommitted edit."""
    for name, upstream in sorted(project.pins().items()):
        if name == tested.name or os.environ.get(tree_env_var(name)):
            continue
        target = default_target(project, upstream)
        series = project.series(target.release, runner)
        git = Git(project.checkout(name), runner)
        imported = f"the tests of {tested.label} import {name}'s {target.branch}"
        again = f"then run `{command}` again"
        state = MISSING
        if git.exists() and git.rev(target.upstream_tag) is not None:
            state = branch_state(git, target, series, project.scratch_dir)
        if state is MISSING:
            raise CarryError(
                f"{imported}, which is not laid down in upstream/{name}: run "
                f"`carry fetch {name} && carry apply {name}`, {again}"
            )
        if state is DIFFERS:
            raise CarryError(
                f"{imported}, which differs from {series.label}: run `carry apply {name}` (or `carry export "
                f"{name}` to keep the branch), {again}"
            )
        if state is NOT_DESCENDING:
            raise CarryError(
                f"{imported}, which does not descend from {target.upstream_tag}: run `carry apply {name}` to "
                f"rebuild it from patches/, {again}"
            )
        dirty = git.dirty_paths() if git.current_branch() == target.branch else []
        if dirty:
            raise CarryError(
                f"{imported} from upstream/{name} itself, which has uncommitted changes ({dirty[0]}): "
                f"commit or stash them, {again}"
            )


@contextmanager
def _held(path: Path, timeout_s: float) -> Iterator[None]:
    """An flock on ``path`` (released by the kernel if its holder dies), waited for at most
    ``timeout_s`` seconds."""
    with path.open("a", encoding="utf-8") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise CarryError(
                        f"{path} was held for more than {timeout_s:.0f} s by another run laying down the"
                        " same tree: let it finish (or end it), then run this again"
                    ) from None
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _inside(tree: Path, subdir: str | None) -> Path:
    return tree / subdir if subdir else tree


@dataclass(frozen=True)
class FoundState:
    name: str
    branch: str | None  # None: HEAD was detached (or the checkout did not exist)
    commit: str | None


def found_states(project: Project, names: Sequence[str], runner: Runner = run_subprocess) -> list[FoundState]:
    states = []
    for name in names:
        git = Git(project.checkout(name), runner)
        if git.exists():
            states.append(FoundState(name, git.current_branch(), git.rev("HEAD")))
        else:
            states.append(FoundState(name, None, None))
    return states


def restore(project: Project, states: Sequence[FoundState], runner: Runner = run_subprocess) -> list[str]:
    """Put each checkout back on the branch (or detached commit) it was found on. A checkout left
    with uncommitted changes or a git operation stopped is not touched: restoring would lose that
    work, so it is reported instead (one line each)."""
    problems = []
    for state in states:
        git = Git(project.checkout(state.name), runner)
        if state.commit is None or not git.exists():
            continue
        if git.current_branch() == state.branch and (state.branch or git.rev("HEAD") == state.commit):
            continue
        found = state.branch or state.commit[:12]
        if git.operation_in_progress() is not None or git.dirty_paths():
            problems.append(
                f"upstream/{state.name} was left on {git.current_branch() or 'a detached HEAD'} with work in "
                f"progress, not put back on {found}: finish that work, then `git checkout {found}` there"
            )
            continue
        git.run("checkout", "--quiet", state.branch or state.commit)
    return problems


@contextmanager
def found_branch_restored(
    project: Project, names: Sequence[str], runner: Runner = run_subprocess
) -> Iterator[list[str]]:
    """Run the body, then put each checkout in ``names`` back where it was found. The list yielded
    is filled, on the way out, with what could not be put back (see ``restore``)."""
    states = found_states(project, names, runner)
    problems: list[str] = []
    try:
        yield problems
    finally:
        problems.extend(restore(project, states, runner))


def run_with_checkouts_restored(
    project: Project, command: Sequence[str], runner: Runner = run_subprocess
) -> tuple[int, list[str]]:
    """Run ``command`` (its output not captured), then put every pinned package's checkout back
    where it was found. Returns the command's exit status and what could not be put back."""
    with found_branch_restored(project, sorted(project.pins()), runner) as not_restored:
        code = runner(command, capture=False).returncode
    return code, not_restored
