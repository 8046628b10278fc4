"""Thin typed wrapper over the git command line: git does all patch work in this project."""

from __future__ import annotations

import shutil
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import CarryError
from .runner import Completed, Runner, run_subprocess

# Fixed identities and settings so that the same inputs give the same commits and the same
# exported bytes on every machine, whatever the user's git configuration says.
CARRY_IDENTITY = {
    "GIT_COMMITTER_NAME": "sglang-carry",
    "GIT_COMMITTER_EMAIL": "sglang-carry@localhost",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_TERMINAL_PROMPT": "0",
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
            detail = result.output.splitlines()[-1] if result.output else "no output"
            raise CarryError(f"git {args[0]} failed in {self.repo}: {detail}")
        return result

    def out(self, *args: str, env: Mapping[str, str] | None = None) -> str:
        return self.run(*args, env=env).stdout.strip()

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

    def am_in_progress(self) -> bool:
        return (self.repo / ".git" / "rebase-apply").exists()

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
