"""A rebase's journal: what it changed so far and where it stands, saved inside the checkout's
git directory after every step, and the undo that puts all of it back. A rebase either finishes,
stops at a conflict (the journal kept for --continue or --abort), or changes nothing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..errors import CarryError
from ..git import Git
from ..project import Project
from ..runner import Runner
from ..verify.plan import TestOutcome
from .outcome import Outcome, PatchResult

STATE_FILE = "rebase.json"


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
    pristine: dict[str, TestOutcome] = field(default_factory=dict)
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
        results = []
        for raw in data.get("results", []):
            outcome = raw.get("outcome")
            outcomes = {
                "outcome": Outcome(outcome) if outcome else None,
                "pristine": TestOutcome(raw["pristine"]),
            }
            results.append(PatchResult(**(raw | outcomes)))
        data["results"] = results
        data["pristine"] = {name: TestOutcome(value) for name, value in data.get("pristine", {}).items()}
        return cls(**{key: value for key, value in data.items() if key in names})


def state_path(project: Project, name: str, runner: Runner) -> Path | None:
    git = Git(project.checkout(name), runner)
    return git.state_file(STATE_FILE) if git.exists() else None


def in_progress(project: Project, runner: Runner) -> list[tuple[Path, State]]:
    found = []
    for name in sorted(project.pins()):
        path = state_path(project, name, runner)
        if path is not None and path.exists():
            found.append((path, State.from_json(path.read_text(encoding="utf-8"))))
    return found


def the_one_in_progress(project: Project, runner: Runner) -> tuple[Path, State, Git]:
    found = in_progress(project, runner)
    if not found:
        raise CarryError("no carry rebase is in progress: start one with `carry rebase NEW_VERSION`")
    path, state = found[0]
    return path, state, Git(project.checkout(state.name), runner)


def save(path: Path, state: State) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(state.to_json(), encoding="utf-8")


def read_pin(state: State) -> str:
    # Bytes decoded by hand: read_text would turn CRLF into LF, and --abort restores bytes.
    return Path(state.pin_file).read_bytes().decode("utf-8", "surrogateescape")


class ConflictStop(CarryError):
    """The replay stopped at a conflict; the state is saved for --continue or --abort."""


@contextmanager
def undone_unless_done(project: Project, git: Git, path: Path, state: State) -> Iterator[None]:
    """Undo everything the rebase did when it fails other than by stopping at a conflict."""
    try:
        yield
    except ConflictStop:
        raise
    except BaseException:
        undo(project, git, path, state)
        raise


def undo(project: Project, git: Git, path: Path, state: State) -> None:
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
