"""What `carry verify` runs, decided without running anything: which test ids on which commit
(each commit once, with every id wanted there), how a run that did not get through is split,
and each entry's verdict from the outcomes."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..series import Entry


class TestOutcome(enum.StrEnum):
    __test__ = False  # not a test class, whatever pytest thinks of the name

    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"  # pytest did not run it (a bad id, a crash)
    NONE = "-"  # not run: the entry names no tests


PASS, FAIL, ERROR, NONE = TestOutcome.PASS, TestOutcome.FAIL, TestOutcome.ERROR, TestOutcome.NONE


def combine(outcomes: Iterable[str]) -> TestOutcome:
    """An entry's outcome on one tree: error if any id errored, else fail if any failed."""
    found = set(outcomes)
    if not found or ERROR in found:
        return ERROR
    return FAIL if FAIL in found else PASS


def selects(test_id: str, nodeid: str) -> bool:
    """Whether pytest, given ``test_id`` (a folder, a file, a class or a test), runs ``nodeid``."""
    test_id = test_id.rstrip("/")
    return nodeid == test_id or nodeid.startswith((test_id + "::", test_id + "[", test_id + "/"))


def id_outcomes(tests: Iterable[str], cases: Mapping[str, str]) -> dict[str, TestOutcome]:
    """Each id's outcome from a report's cases: error when pytest ran nothing of it."""
    result = {}
    for test_id in tests:
        matched = [outcome for nodeid, outcome in cases.items() if selects(test_id, nodeid)]
        result[test_id] = combine(matched) if matched else ERROR
    return result


@dataclass(frozen=True)
class Verdict:
    entry: Entry
    without: str
    with_patch: str
    json_extra: ClassVar[tuple[str, ...]] = ("ok", "label")

    @property
    def expected_without(self) -> TestOutcome:
        return PASS if self.entry.applied_upstream else FAIL

    @property
    def ok(self) -> bool:
        return bool(self.entry.tests) and (self.without, self.with_patch) == (self.expected_without, PASS)

    @property
    def label(self) -> str:
        if not self.entry.tests:
            return "WRONG (no Test: trailer)"
        return "ok" if self.ok else f"WRONG (expected {self.expected_without} -> pass)"


@dataclass(frozen=True)
class EntrySides:
    """The two trees an entry is judged on: without it and with it."""

    entry: Entry
    before: str
    after: str


def entry_sides(entries: Sequence[Entry], commits: Sequence[str], pristine: str) -> list[EntrySides]:
    """Entry N is judged on commit N-1 (pristine for the first) and commit N; an Applied-Upstream
    entry on pristine and on the whole series."""
    sides = []
    for index, entry in enumerate(entries):
        if entry.applied_upstream:
            sides.append(EntrySides(entry, pristine, commits[-1]))
        else:
            sides.append(EntrySides(entry, commits[index - 1] if index else pristine, commits[index]))
    return sides


@dataclass
class TreeRun:
    """One commit's pytest run: every id wanted there, in the groups they were asked for."""

    commit: str
    groups: list[list[str]]

    @property
    def tests(self) -> list[str]:
        return list(dict.fromkeys(test for group in self.groups for test in group))

    def parts_after_failure(self) -> list[list[str]]:
        """The runs to make when the whole did not get through: by group (an entry's ids) when
        there are several, else id by id, so one bad id or one failing test spoils only its own
        part. Nothing to split for a single id."""
        if len(self.groups) > 1:
            return [list(group) for group in self.groups]
        tests = self.tests
        return [[test] for test in tests] if len(tests) > 1 else []


class Plan:
    """The ids wanted per commit, each (commit, id) at most once however often it is asked."""

    def __init__(self) -> None:
        self._runs: dict[str, TreeRun] = {}

    def want(self, commit: str, tests: Sequence[str], done: Iterable[tuple[str, str]] = ()) -> None:
        finished = set(done)
        pending = [test for test in tests if (commit, test) not in finished]
        if pending:
            self._runs.setdefault(commit, TreeRun(commit, [])).groups.append(pending)

    def take(self) -> list[TreeRun]:
        """The runs wanted so far, in the order their commits were first asked for; the plan is
        then empty."""
        runs, self._runs = list(self._runs.values()), {}
        return runs
