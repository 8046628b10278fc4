"""Progress, reported and not printed: library functions tell a Reporter what happens, and the
command line decides where (and whether) it shows (cli_render.py)."""

from __future__ import annotations

import time
from typing import Protocol


class Reporter(Protocol):
    def step(self, line: str) -> None:
        """One line about a step, as it happens ("fetch: downloading ...", "... (12.3 s)")."""

    def warn(self, line: str) -> None:
        """Something the user should look at that does not stop the command."""

    def meter(self, line: str, done: bool = False) -> None:
        """Progress inside a step (a download's megabytes), each call replacing the last; ``done``
        ends it. Shown only where a line can be overwritten."""


class Silent:
    """The library's default: nothing is shown, results say what happened."""

    def step(self, line: str) -> None:
        pass

    def warn(self, line: str) -> None:
        pass

    def meter(self, line: str, done: bool = False) -> None:
        pass


SILENT: Reporter = Silent()


class Recorder:
    """Keeps every line it is told (tests, and callers that log the steps themselves)."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.warnings: list[str] = []

    def step(self, line: str) -> None:
        self.steps.append(line)

    def warn(self, line: str) -> None:
        self.warnings.append(line)

    def meter(self, line: str, done: bool = False) -> None:
        pass


class Stopwatch:
    def __init__(self) -> None:
        self.started = time.monotonic()

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def __str__(self) -> str:
        return f"{self.seconds:.1f} s"


def megabytes(size: int) -> str:
    return f"{size / 1_000_000:.1f} MB"
