"""Every subprocess the tool starts goes through a Runner, so tests can replace it."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class Completed:
    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return (self.stdout + self.stderr).strip()


class Runner(Protocol):
    def __call__(
        self,
        args: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        capture: bool = True,
    ) -> Completed: ...


def run_subprocess(
    args: Sequence[str],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
    capture: bool = True,
) -> Completed:
    """Run a command; ``env`` is added to the current environment, never a replacement.

    Output is decoded as UTF-8 whatever the user's locale says, and undecodable bytes survive the
    round trip (surrogateescape), so a patch read through here is written back byte for byte.
    """
    full_env = {**os.environ, **env} if env else None
    proc = subprocess.run(
        list(args),
        cwd=cwd,
        env=full_env,
        input=stdin,
        encoding="utf-8",
        errors="surrogateescape",
        capture_output=capture,
        check=False,
    )
    return Completed(tuple(args), proc.returncode, proc.stdout or "", proc.stderr or "")
