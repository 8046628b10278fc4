"""Thin typed wrapper over the git command line: git does all patch work in this project."""

from __future__ import annotations

import shutil
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import CarryError
from .runner import Completed, Runner, run_subprocess

# Fixed identities and settings so that the same inputs give the same commits and the same
# exported bytes on every machine, whatever the user's git configuration says. The locale is
# fixed too: the tool reads git's state through exit codes and plumbing, and the messages it
# passes on to the user are then the ones this README documents.
CARRY_IDENTITY = {
    "GIT_COMMITTER_NAME": "sglang-carry",
    "GIT_COMMITTER_EMAIL": "sglang-carry@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
    "LC_ALL": "C",
    "LANGUAGE": "",
}
PRISTINE_AUTHOR = {
    "GIT_AUTHOR_NAME": "upstream",
    "GIT_AUTHOR_EMAIL": "upstream@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
STABLE_CONFIG = (
    "-c",
    "core.autocrlf=false",
    "-c",
    "diff.noprefix=false",
    "-c",
    "diff.mnemonicPrefix=false",
    "-c",
    "diff.renames=false",
    "-c",
    "format.signature=",
    "-c",
    "format.numbered=false",
    "-c",
    "am.threeWay=false",
    "-c",
    "advice.detachedHead=false",
    "-c",
    "init.defaultBranch=main",
)


# At most this many of git's error lines go into the one-line message the user sees.
_MAX_DETAIL_LINES = 3


def summarize_git_output(output: str) -> str:
    """One line from git's output that keeps the lines naming files (git's `error:`/`fatal:`
    lines) and git's closing advice, instead of only the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if not lines:
        return "no output"
    kept = [line for line in lines if line.startswith(("fatal:", "error:"))][:_MAX_DETAIL_LINES]
    if lines[-1] not in kept:
        kept.append(lines[-1])
    return " / ".join(kept)


@dataclass(frozen=True)
class Operation:
    """A git operation that stopped half way and waits for the user (see `operation_in_progress`)."""

    name: str
    resume: str
    abort: str

    def describe(self, where: str) -> str:
        return (
            f"a git {self.name} is in progress in {where}: "
            f"finish it (`{self.resume}`) or abort it (`{self.abort}`)"
        )


_AM = Operation("am", "git am --continue", "git am --abort")
_REBASE = Operation("rebase", "git rebase --continue", "git rebase --abort")
_MERGE = Operation("merge", "git commit", "git merge --abort")
_CHERRY_PICK = Operation("cherry-pick", "git cherry-pick --continue", "git cherry-pick --abort")
_REVERT = Operation("revert", "git revert --continue", "git revert --abort")


@dataclass(frozen=True)
class MailInfo:
    """A patch file as `git am` reads it (`git mailinfo -k`: the subject kept as it is)."""

    subject: str
    author: str
    email: str
    date: str
    body: str  # the commit message after the subject: up to the `---` or the diff
    patch: str  # the diff, empty for a commit that has none

    @property
    def message(self) -> str:
        """The commit message git am makes of it: subject, blank line, body."""
        return self.subject + "\n\n" + self.body


class Git:
    def __init__(self, repo: Path, runner: Runner = run_subprocess) -> None:
        self.repo = repo
        self.runner = runner

    def run(
        self,
        *args: str,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        check: bool = True,
    ) -> Completed:
        full_env = {**CARRY_IDENTITY, **(env or {})}
        result = self.runner(["git", *STABLE_CONFIG, *args], cwd=self.repo, env=full_env, stdin=stdin)
        if check and result.returncode != 0:
            raise CarryError(f"git {args[0]} failed in {self.repo}: {summarize_git_output(result.output)}")
        return result

    def out(self, *args: str, env: Mapping[str, str] | None = None, stdin: str | None = None) -> str:
        return self.run(*args, env=env, stdin=stdin).stdout.strip()

    def exists(self) -> bool:
        return (self.repo / ".git").exists()

    def rev(self, ref: str) -> str | None:
        result = self.run("rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}", check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def current_branch(self) -> str | None:
        result = self.run("symbolic-ref", "--quiet", "--short", "HEAD", check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def dirty_paths(self) -> list[str]:
        status = self.run("status", "--porcelain", "--untracked-files=all").stdout
        return [line[3:] for line in status.splitlines() if line]

    def git_path(self, name: str) -> Path:
        """Where git keeps ``name`` for this checkout (worktree-aware: never a hard-coded .git/)."""
        return self.git_paths(name)[name]

    def git_paths(self, *names: str) -> dict[str, Path]:
        args = [arg for name in names for arg in ("--git-path", name)]
        found = self.out("rev-parse", *args).splitlines()
        return {name: self.repo / path for name, path in zip(names, found, strict=True)}

    def operation_in_progress(self) -> Operation | None:
        """The am, rebase, merge, cherry-pick or revert that stopped here, if any."""
        paths = self.git_paths(
            "rebase-apply", "rebase-merge", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD", "sequencer"
        )
        if paths["rebase-apply"].is_dir():
            # git am and the apply backend of git rebase share rebase-apply/; am leaves "applying".
            return _AM if (paths["rebase-apply"] / "applying").exists() else _REBASE
        if paths["rebase-merge"].is_dir():
            return _REBASE
        if paths["MERGE_HEAD"].exists():
            return _MERGE
        if paths["CHERRY_PICK_HEAD"].exists():
            return _CHERRY_PICK
        if paths["REVERT_HEAD"].exists():
            return _REVERT
        sequencer_todo = paths["sequencer"] / "todo"
        if sequencer_todo.exists():
            first = sequencer_todo.read_text().split(maxsplit=1)
            return _REVERT if first and first[0] in ("revert", "r") else _CHERRY_PICK
        return None

    def is_ancestor(self, ancestor: str, descendant: str) -> bool:
        result = self.run("merge-base", "--is-ancestor", ancestor, descendant, check=False)
        if result.returncode not in (0, 1):
            raise CarryError(f"git merge-base failed in {self.repo}: {summarize_git_output(result.output)}")
        return result.returncode == 0

    def nearest_tag(self, ref: str, pattern: str) -> str | None:
        """The closest tag matching ``pattern`` that ``ref`` descends from."""
        result = self.run("describe", "--tags", "--abbrev=0", "--match", pattern, ref, check=False)
        if result.returncode != 0:
            return None
        return result.stdout.strip() or None

    def unmerged_paths(self) -> list[str]:
        return self.out("diff", "--name-only", "--diff-filter=U").splitlines()

    def current_patch_paths(self) -> list[str]:
        """Files the patch git am stopped at touches (read from the patch, not from messages)."""
        patch = self.run("am", "--show-current-patch=diff", check=False)
        if patch.returncode != 0 or not patch.stdout.strip():
            return []
        numstat = self.run("apply", "--numstat", "-z", "-", stdin=patch.stdout, check=False)
        paths = []
        for record in numstat.stdout.split("\0"):
            fields = record.split("\t", 2)
            if len(fields) == 3 and fields[2]:
                paths.append(fields[2])
        return paths

    def state_file(self, name: str) -> Path:
        """A file of the tool's own inside this checkout's git directory."""
        return self.git_path(f"sglang-carry/{name}")

    def commits(self, base: str, tip: str) -> list[str]:
        listing = self.out("rev-list", "--reverse", f"{base}..{tip}")
        return listing.split()

    def changed_paths(self, base: str, tip: str, under: Sequence[str] = ()) -> list[tuple[str, str]]:
        """(status letter, path) for each file that differs between two commits."""
        listing = self.out("diff", "--name-status", "--no-renames", base, tip, "--", *under)
        rows = []
        for line in listing.splitlines():
            status, path = line.split("\t", 1)
            rows.append((status[0], path))
        return rows

    def fresh_worktree(self, path: Path, ref: str) -> Path:
        """A detached worktree of ``ref`` at ``path``, replacing whatever was left there."""
        if path.exists():
            self.run("worktree", "remove", "--force", str(path), check=False)
            shutil.rmtree(path, ignore_errors=True)
        self.run("worktree", "prune")
        self.run("worktree", "add", "--quiet", "--detach", str(path), ref)
        return path

    def read_files(self, ref: str, paths: Sequence[str], scratch: Path) -> dict[str, bytes]:
        """Bytes of ``paths`` at ``ref``, through git archive so binary content survives."""
        if not paths:
            return {}
        archive = scratch / "files.tar"
        self.run("archive", "--format=tar", "-o", str(archive), ref, "--", *paths)
        with tarfile.open(archive) as tar:
            contents = {}
            for member in tar.getmembers():
                if member.isfile():
                    handle = tar.extractfile(member)
                    assert handle is not None
                    contents[member.name] = handle.read()
        archive.unlink()
        return contents

    def mailinfo(self, text: str) -> MailInfo:
        with tempfile.TemporaryDirectory(prefix="carry-mailinfo-") as tmp:
            message, patch = Path(tmp) / "msg", Path(tmp) / "patch"
            out = self.run("mailinfo", "-k", str(message), str(patch), stdin=text).stdout
            body = message.read_text(encoding="utf-8", errors="surrogateescape")
            diff = patch.read_text(encoding="utf-8", errors="surrogateescape")
        info = dict(line.partition(": ")[::2] for line in out.splitlines())
        return MailInfo(
            info.get("Subject", ""),
            info.get("Author", ""),
            info.get("Email", ""),
            info.get("Date", ""),
            body,
            diff,
        )
