"""One lock per checkout, held by every command that writes.

Two commands at once in one checkout trip over each other: the loser of two `carry apply` saw a
good patch "not apply" and was told to `git am --abort` the winner's run; two first-time builds
ended in git's "tag already exists". The lock is an flock on build/carry.lock, which the kernel
releases when its holder dies (a SIGKILLed command leaves nothing to clean up); the file names the
holder, for the message of the command that waits or refuses.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from . import leftovers
from .errors import CarryError
from .progress import SILENT, Reporter
from .project import Project

LOCK_FILE = "carry.lock"


@dataclass(frozen=True)
class Holder:
    """Who holds the lock, as it wrote itself into the file (None fields: not written yet)."""

    pid: int | None
    command: str | None

    def describe(self) -> str:
        if self.pid is None:
            return "another carry command"
        return f"`carry {self.command}` (pid {self.pid})"


def lock_path(project: Project) -> Path:
    return project.scratch_dir / LOCK_FILE


def read_holder(path: Path) -> Holder:
    try:
        pid, _, command = path.read_text(encoding="utf-8", errors="replace").strip().partition(" ")
        return Holder(int(pid), command or None)
    except (OSError, ValueError):
        return Holder(None, None)


@contextmanager
def hold(
    project: Project, command: str, wait: bool, on_wait: Callable[[Holder], None] = lambda _: None
) -> Iterator[None]:
    """Hold the checkout's lock for `command`. When another command holds it: with `wait`, tell
    `on_wait` who, then wait for it; without, refuse."""
    path = lock_path(project)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = read_holder(path)
            if not wait:
                raise CarryError(
                    f"{holder.describe()} is working in this checkout (it holds {path}): "
                    "let it finish, then run this again, or drop --no-wait to wait for it"
                ) from None
            on_wait(holder)
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()} {command}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextmanager
def writing(
    project: Project,
    command: str,
    wait: bool,
    on_wait: Callable[[Holder], None] = lambda _: None,
    report: Reporter = SILENT,
) -> Iterator[None]:
    """What every command that writes does first, the CLI's and the nightly's alike: hold the
    checkout's lock, then remove what a command killed part-way left (reported)."""
    with hold(project, command, wait, on_wait):
        for leftover in leftovers.remove(project):
            report.warn(
                f"carry {command}: removed {leftover.describe(project.root)}, left by a carry command "
                "killed part-way"
            )
        yield


def working(project: Project) -> Holder | None:
    """Who holds the checkout's lock right now, without waiting for it (None: nobody)."""
    path = lock_path(project)
    if not path.exists():
        return None
    with path.open("r", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return read_holder(path)
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
    return None
