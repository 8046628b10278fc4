"""The worktrees ("slots") verify tests in: each checked out at one commit after another, so a
commit shares with the previous one of its slot the bytecode and the compiled torch extension of
every file that did not change between them."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..git import Git
from ..project import Project, Target
from ..runner import Runner
from ..trees import tree_env_var

# A tree's torch JIT extensions are rebuilt whenever a file with one of these suffixes differs.
NATIVE_SUFFIXES = (".c", ".cc", ".cpp", ".cxx", ".h", ".hh", ".hpp", ".cu", ".cuh")


@dataclass
class Slot:
    """One worktree, checked out at one commit after another."""

    number: int
    path: Path
    commit: str | None = None


class WorktreePool:
    """Every run has a folder of its own under build/verify/: two verify runs (or a verify beside
    `./scripts/test`) never share a tree or a compiled extension, so none rebuilds or deletes what
    another is using."""

    def __init__(self, project: Project, target: Target, git: Git, runner: Runner) -> None:
        self.target = target
        self.git = git
        self.runner = runner
        parent = project.scratch_dir / "verify" / target.name
        parent.mkdir(parents=True, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(dir=parent, prefix="run-"))
        self.slots: list[Slot] = []
        self._lock = threading.Lock()

    def grow(self, count: int) -> list[Slot]:
        """At least ``count`` slots (made as they are needed); returns the first ``count``."""
        while len(self.slots) < count:
            number = len(self.slots)
            self.slots.append(Slot(number, self.base / f"slot-{number}"))
        return self.slots[:count]

    def tree(self, slot: Slot, commit: str) -> Path:
        """``slot``'s worktree at ``commit``, with no bytecode left of a file that changed."""
        if slot.commit is None:
            with self._lock:  # `git worktree add` writes the shared repository's admin files
                self.git.fresh_worktree(slot.path, commit)
        elif slot.commit != commit:
            tree_git = Git(slot.path, self.runner)
            changed = tree_git.changed_paths(slot.commit, commit)
            tree_git.run("checkout", "--quiet", "--force", "--detach", commit)
            for _, path in changed:
                if path.endswith(".py"):
                    source = slot.path / path
                    for stale in source.parent.glob(f"__pycache__/{source.stem}.*.pyc"):
                        stale.unlink(missing_ok=True)
        slot.commit = commit
        return slot.path

    def native_sources_key(self, commit: str) -> str:
        """A digest of the tree's native sources (paths and blob ids, straight from git)."""
        listing = self.git.out("ls-tree", "-r", "--full-tree", commit)
        digest = hashlib.sha256()
        for line in listing.splitlines():
            meta, path = line.split("\t", 1)
            if path.endswith(NATIVE_SUFFIXES):
                digest.update(f"{path}\0{meta.split()[2]}\n".encode())
        return digest.hexdigest()[:16]

    def environment(self, slot: Slot, commit: str) -> dict[str, str]:
        subdir = self.target.upstream.source_subdir
        tree = self.tree(slot, commit)
        extensions = self.base / "torch_extensions" / f"slot-{slot.number}" / self.native_sources_key(commit)
        return {
            tree_env_var(self.target.name): str(tree / subdir if subdir else tree),
            # torch's JIT build decides what to rebuild from file times and the build command,
            # and the command names the tree's path: a folder is only ever used by one slot (one
            # path) and one content of the native sources, so no stale build can be loaded.
            "TORCH_EXTENSIONS_DIR": str(extensions),
            # The trees are this run's scratch: their bytecode is what makes the next commit in
            # the slot cheap to import (stale bytecode is deleted at checkout, see `tree`).
            "PYTHONDONTWRITEBYTECODE": "",
        }

    def close(self) -> None:
        for slot in self.slots:
            self.git.run("worktree", "remove", "--force", str(slot.path), check=False)
        self.git.run("worktree", "prune", check=False)
        shutil.rmtree(self.base, ignore_errors=True)
