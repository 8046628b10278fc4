"""What `carry` shows: progress as it happens, and each command's result as text or JSON. The
library returns results and reports progress; only this module writes to the terminal."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from .build import BuildResult
from .fetch import FetchResult
from .kinds import WHEEL, kind_of
from .patching import Applied, Exported
from .rebase import Aborted, RebaseResult
from .rebase.report import render_patch_table
from .results import CommandResult, to_json
from .simple_index import IndexResult
from .status import StatusResult
from .verify import VerifyResult, render_table


class ConsoleReporter:
    """Steps on ``out`` (stdout; stderr when stdout carries JSON), warnings on stderr, and the
    download meter only where it can be overwritten (a terminal)."""

    def __init__(self, out: TextIO | None = None) -> None:
        self._out = out
        self._metering = False

    @property
    def out(self) -> TextIO:
        # Looked up per write: the CLI wraps sys.stdout (for its error messages) after this is made.
        return self._out or sys.stdout

    def step(self, line: str) -> None:
        self._end_meter()
        print(line, file=self.out, flush=True)

    def warn(self, line: str) -> None:
        self._end_meter()
        print(line, file=sys.stderr, flush=True)

    def meter(self, line: str, done: bool = False) -> None:
        if not self.out.isatty():
            return
        print(f"\r{line}", end="", file=self.out, flush=True)
        self._metering = not done
        if done:
            print(file=self.out, flush=True)

    def _end_meter(self) -> None:
        if self._metering:
            print(file=self.out, flush=True)
            self._metering = False


def shown_path(path: Path, root: Path) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def text_lines(result: CommandResult, root: Path) -> list[str]:
    """What a result adds, as text, to the progress already shown; problems come back from
    ``problem``, for the error line."""
    if isinstance(result, Applied):
        return result.describe()
    if isinstance(result, Exported):
        return result.describe()
    if isinstance(result, BuildResult):
        # Artifact paths last, wheels at the very end, so scripts and users can take the last line.
        ordered = sorted(result.artifacts, key=lambda a: (kind_of(a.path.name) is WHEEL, a.path.name))
        return [str(shown_path(artifact.path, root)) for artifact in ordered]
    if isinstance(result, VerifyResult):
        if not result.rows:
            return ["verify: every line carries nothing on purpose; nothing to verify"]
        table = render_table([(row.line, row.verdict) for row in result.rows])
        done = [] if result.wrong else [f"verify: all {len(result.rows)} series entries proven"]
        return [table, *done]
    if isinstance(result, StatusResult):
        summary = [f"status: {result.problems} problem(s) to fix before `carry build`; exit 1"]
        return result.checkout.lines + (summary if result.problems else [])
    if isinstance(result, IndexResult):
        return [
            f"index: {len(result.files)} file(s) of {', '.join(result.projects)} in {result.folder}; install "
            f"with `pip install --no-deps --extra-index-url {result.folder.as_uri()} <project>==<version>`"
        ]
    if isinstance(result, RebaseResult):
        return _rebased(result)
    if isinstance(result, Aborted):
        rebase = f"{result.package} {result.old} -> {result.new}"
        return [f"rebase: aborted the rebase of {rebase}; everything is as it was"]
    if isinstance(result, FetchResult):
        return []  # each checkout was reported as it was laid
    return []


def _rebased(result: RebaseResult) -> list[str]:
    label = f"{result.package} {result.old}"
    if result.up_to_date:
        return [f"rebase: {label} is the newest release already: nothing to check"]
    lines = [render_patch_table(result.patches)]
    lines += [
        f"rebase: {patch.filename}: its Drop-When admits {result.new} ({condition}): {patch.outcome}"
        for patch in result.patches
        for condition in patch.drop_when
    ]
    if result.verdicts:
        lines.append(render_table([(f"{result.package} {result.new}", v) for v in result.verdicts]))
    if not result.failing:
        lines.append(f"rebase: {label} -> {result.new}: every patch carries or is upstream, verify green")
    return lines


def problem(result: CommandResult) -> str | None:
    """The one error line a result that did not succeed ends with."""
    if isinstance(result, (VerifyResult, RebaseResult)):
        return result.problem()
    return None


def as_json(results: list[CommandResult]) -> str:
    """One JSON document: a single result as itself, several (one per line) as a list."""
    if isinstance(results[0], StatusResult):
        return json.dumps(results[0].record(), indent=2, ensure_ascii=False)
    records = [to_json(result) for result in results]
    return json.dumps(records[0] if len(records) == 1 else records, indent=2, ensure_ascii=False)
