"""`carry rebase` on a tiny local upstream: a fake package index, the fake pip of conftest and a
fake test runner that judges each test id by calling the tree's own code (no network, no pytest)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from email.message import Message
from pathlib import Path

import pytest

from sglang_carry.cli_render import ConsoleReporter, text_lines
from sglang_carry.errors import CarryError
from sglang_carry.git import Git
from sglang_carry.patching import export
from sglang_carry.pins import PinnedFile, Release, load_upstream
from sglang_carry.rebase import Aborted, RebaseResult, Request, rebase, rebase_abort, rebase_continue
from sglang_carry.rebase.journal import State
from sglang_carry.rebase.outcome import Outcome, PatchResult
from sglang_carry.rebase.report import drop_when_matches, render_report, with_applied_upstream_status
from sglang_carry.registry import (
    IndexFile,
    fetch_url,
    index_files,
    index_url,
    release_from_index,
    render_release,
)
from sglang_carry.runner import Completed
from sglang_carry.series import Entry, load_series
from sglang_carry.verify import TestOutcome
from sglang_carry.verify.pytest_run import command_ids

from .conftest import DEMO_FILES, DemoProject, git, make_wheel, patch_message, sha256_file

CORE = "python/demo/core.py"
OLD_CORE = "def answer():\n    return 41\n\n\n" + "".join(
    f"def f{i}():\n    return {i}\n\n\n" for i in range(10)
)
OLD_FILES = {**DEMO_FILES, "demo/core.py": OLD_CORE}


def core(*replacements: tuple[str, str], base: str = OLD_CORE) -> str:
    for old, new in replacements:
        assert old in base
        base = base.replace(old, new)
    return base


FIX_ANSWER = ("return 41", "return 42")
FIX_NINE = ("return 9\n", "return 99\n")


def module(tree: Path, relative: str) -> dict[str, object]:
    namespace: dict[str, object] = {}
    exec((tree / relative).read_text(), namespace)
    return namespace


def call(tree: Path, name: str) -> object:
    function = module(tree, "demo/core.py")[name]
    assert callable(function)
    return function()


# Each test id is judged by calling the code of the tree it runs on, as the real test would.
RULES: dict[str, Callable[[Path], bool]] = {
    "tests/test_answer.py": lambda tree: call(tree, "answer") == 42,
    "tests/test_nine.py": lambda tree: call(tree, "f9") == 99,
    "tests/test_value.py": lambda tree: module(tree, "demo/__init__.py")["VALUE"] == 1,
}


class FakeTests:
    """Stands in for pytest (and, through conftest's fake pip, for pip download)."""

    def __init__(self, demo: DemoProject) -> None:
        self.demo = demo
        self.runs: list[tuple[str, tuple[str, ...]]] = []

    def __call__(
        self,
        args: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        capture: bool = True,
    ) -> Completed:
        if "pytest" in args:
            assert env is not None
            tree = Path(env["CARRY_TREE_DEMO"])
            ids = tuple(command_ids(args))
            self.runs.append((str(tree), ids))
            if any(test not in RULES for test in ids):
                return Completed(tuple(args), 4, "", "ERROR: file or directory not found")
            outcomes = {test: RULES[test](tree) for test in ids}
            report = next((arg.split("=", 1)[1] for arg in args if arg.startswith("--report-log=")), None)
            if report is not None:
                write_report_log(Path(report), outcomes)
            return Completed(tuple(args), 0 if all(outcomes.values()) else 1, "", "")
        return self.demo.pip(args, cwd=cwd, env=env, stdin=stdin, capture=capture)


def write_report_log(path: Path, outcomes: Mapping[str, bool]) -> None:
    """A pytest-reportlog file: one test per test file here."""
    lines = [
        json.dumps(
            {"$report_type": "TestReport", "nodeid": f"{test}::test", "when": "call", "outcome": outcome}
        )
        for test, passed in outcomes.items()
        for outcome in ["passed" if passed else "failed"]
    ]
    path.write_text("".join(line + "\n" for line in lines))


class FakeIndex:
    """A PEP 691 index page per package, made from the wheels given."""

    def __init__(self) -> None:
        self.wheels: list[Path] = []
        self.urls: list[str] = []

    def __call__(self, url: str) -> bytes:
        self.urls.append(url)
        files = [
            {
                "filename": wheel.name,
                "url": f"https://files.example/{wheel.name}",
                "hashes": {"sha256": sha256_file(wheel)},
                "yanked": False,
            }
            for wheel in self.wheels
        ]
        return json.dumps({"meta": {"api-version": "1.1"}, "name": "demo", "files": files}).encode()


class Rebasing:
    """The old line 1.1 (three entries) and a new upstream release 1.2 on the index."""

    def __init__(self, demo: DemoProject, new_core: str, drop_when: str = "upstream fixes it") -> None:
        self.demo = demo
        self.tests = FakeTests(demo)
        self.index = FakeIndex()
        demo.lay_down("tiny")
        demo.pin_release("1.1", OLD_FILES)
        demo.fetch(version="1.1")
        demo.commit_change(CORE, core(FIX_ANSWER), message("Fix the answer", "tests/test_answer.py"))
        demo.commit_change(
            CORE, core(FIX_ANSWER, FIX_NINE), message("Fix nine", "tests/test_nine.py", drop_when)
        )
        demo.commit_empty(message("Upstream has the value", "tests/test_value.py", status="Applied-Upstream"))
        assert export(demo.project, demo.target(version="1.1")).exit_code == 0
        new_wheel = make_wheel(demo.artifacts, "demo", "1.2", {**OLD_FILES, "demo/core.py": new_core})
        self.index.wheels.append(new_wheel)
        demo.pip.files["demo==1.2"] = new_wheel
        self.old_series = demo.snapshot(demo.series_dir.with_name("1.1"))

    def run(self, keep: bool = False, check: bool = False, new: str = "1.2") -> int:
        request = Request(new, "demo", "1.1", keep=keep, python=sys.executable)
        report = ConsoleReporter()
        return self.shown(rebase(self.demo.project, request, check, self.tests, self.index, report))

    def resume(self) -> int:
        return self.shown(rebase_continue(self.demo.project, self.tests, ConsoleReporter()))

    def abort(self) -> int:
        return self.shown(rebase_abort(self.demo.project, self.tests))

    def shown(self, result: RebaseResult | Aborted) -> int:
        """The result kept, and shown as `carry rebase` shows it."""
        self.result = result
        for line in text_lines(result, self.demo.root):
            print(line)
        return result.exit_code

    def outcomes(self) -> list[tuple[str, str]]:
        """(patch, outcome) of the last rebase's result."""
        assert isinstance(self.result, RebaseResult)
        return [(patch.filename, str(patch.outcome)) for patch in self.result.patches]

    @property
    def new_dir(self) -> Path:
        return self.demo.series_dir.with_name("1.2")

    def new_entries(self) -> list[tuple[str, bool]]:
        series = load_series(self.demo.root / "patches", "demo", "1.2")
        return [(entry.status, entry.has_diff) for entry in series.entries]

    def report(self) -> str:
        return (self.new_dir / "REBASE.md").read_text()


def message(subject: str, tests: str, drop_when: str = "upstream fixes it", status: str = "Pending") -> str:
    return patch_message(subject, status=status, tests=tests).replace(
        "Drop-When: upstream fixes it", f"Drop-When: {drop_when}"
    )


def fingerprint(demo: DemoProject) -> dict[str, str]:
    """Every file of the project (the checkout's work tree included) by hash, and the checkout's
    refs and HEAD: what --abort and --check must leave as they were."""
    checkout_git = demo.checkout / ".git"
    prints = {}
    for path in sorted(demo.root.rglob("*")):
        if path.is_file() and checkout_git not in path.parents and demo.root / ".git" not in path.parents:
            prints[str(path.relative_to(demo.root))] = hashlib.sha256(path.read_bytes()).hexdigest()
    prints["<refs>"] = git(demo.checkout, "for-each-ref", "--format=%(refname) %(objectname)").stdout
    prints["<HEAD>"] = git(demo.checkout, "symbolic-ref", "HEAD", check=False).stdout
    prints["<HEAD commit>"] = git(demo.checkout, "rev-parse", "HEAD").stdout
    prints["<status>"] = git(demo.checkout, "status", "--porcelain", "--untracked-files=all").stdout
    return prints


def commit_project(demo: DemoProject) -> None:
    """Make the project a git repository, as a clone is, to check `git status` after the rebase."""
    (demo.root / ".gitignore").write_text("/build/\n/upstream/*/\n/upstream/.downloads/\n")
    git(demo.root, "init", "-q")
    git(demo.root, "add", "-A")
    git(demo.root, "commit", "-q", "-m", "project")


def project_status(demo: DemoProject) -> str:
    return git(demo.root, "status", "--porcelain", "--untracked-files=all").stdout


# --- the tests ---


def test_clean_replay_pins_lays_down_exports_and_reports(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    rebasing = Rebasing(demo, core(base=OLD_CORE + "NEW = 1\n"))
    capsys.readouterr()
    assert rebasing.run() == 0
    out = capsys.readouterr().out
    assert rebasing.outcomes() == [
        ("0001-Fix-the-answer.patch", "clean"),
        ("0002-Fix-nine.patch", "clean"),
        ("0003-Upstream-has-the-value.patch", "applied-upstream"),
    ]
    # The pin: appended in the file's style, with the index's sha256.
    pinned = load_upstream(demo.root / "upstream" / "demo.toml").release("1.2")
    assert [(f.filename, f.sha256) for f in pinned.files] == [
        ("demo-1.2-py3-none-any.whl", sha256_file(rebasing.index.wheels[0]))
    ]
    assert pinned.git_tag == "v1.2"
    assert rebasing.index.urls == ["https://pypi.org/simple/demo/"]
    assert rebasing.new_entries() == [("Pending", True), ("Pending", True), ("Applied-Upstream", False)]
    assert git(demo.checkout, "symbolic-ref", "--short", "HEAD").stdout.strip() == "carry/1.2"
    assert git(demo.checkout, "merge-base", "--is-ancestor", "upstream/1.1", "upstream/1.2").returncode == 0
    report = rebasing.report()
    assert "# demo 1.1 -> 1.2" in report
    assert "| 0001-Fix-the-answer.patch | 0001-Fix-the-answer.patch | clean | fail | nothing |" in report
    assert "## git range-diff upstream/1.1..carry/1.1 upstream/1.2..carry/1.2" in report
    assert "1:  " in report and " = 1:  " in report  # range-diff: same patch
    assert re.search(r"demo 1.2 +0001-Fix-the-answer.patch +fail +pass +ok", report)  # the verify table
    assert "every patch carries or is upstream, verify green" in out
    assert demo.snapshot(demo.series_dir.with_name("1.1")) == rebasing.old_series
    assert not (demo.checkout / ".git" / "sglang-carry" / "rebase.json").exists()


def test_three_way_merge_that_succeeds(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    # 1.2 changes a line inside the first patch's context, not next to the line it changes: plain
    # `git apply` refuses, the 3-way merge succeeds.
    rebasing = Rebasing(demo, core(("def f0():", "def f0() -> int:")))
    capsys.readouterr()
    assert rebasing.run() == 0
    assert rebasing.outcomes()[:2] == [
        ("0001-Fix-the-answer.patch", "3-way"),
        ("0002-Fix-nine.patch", "clean"),
    ]
    assert "3-way | fail | git's 3-way merge; the same 2 +/- lines as the old patch |" in rebasing.report()
    assert "def f0() -> int:" in (demo.checkout / CORE).read_text()


def test_empty_patch_is_recorded_applied_upstream(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1.2 has the second patch's diff exactly; --keep, so it is replayed and found empty.
    rebasing = Rebasing(demo, core(FIX_NINE))
    capsys.readouterr()
    assert rebasing.run(keep=True) == 0
    assert rebasing.outcomes()[1] == ("0002-Fix-nine.patch", "empty")
    assert rebasing.new_entries()[1] == ("Applied-Upstream", False)
    patch = (rebasing.new_dir / "0002-Fix-nine.patch").read_text()
    assert "its diff is already in the pristine 1.2 tree" in " ".join(patch.split())
    assert "Test: tests/test_nine.py" in patch


def test_conflict_then_continue_with_the_resolution_staged(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    rebasing = Rebasing(demo, core(("return 41", "return 40")))
    with pytest.raises(CarryError) as stopped:
        rebasing.run()
    assert str(stopped.value) == (
        "patches/demo/1.1/0001-Fix-the-answer.patch conflicts with demo 1.2 in python/demo/core.py: "
        "resolve them in upstream/demo, `git add` them (or commit), then `carry rebase --continue`; "
        "or `carry rebase --abort` to undo the whole rebase"
    )
    # Not resolved yet: refused, the stop stays.
    with pytest.raises(
        CarryError, match=r"still has unresolved files in upstream/demo \(python/demo/core.py\)"
    ):
        rebasing.resume()
    # Refused while stopped: another rebase.
    with pytest.raises(CarryError, match=r"a carry rebase of demo 1.1 -> 1.2 is in progress"):
        rebasing.run()
    (demo.checkout / CORE).write_text(core(("return 41", "return 42")))
    git(demo.checkout, "add", CORE)
    capsys.readouterr()
    assert rebasing.resume() == 0
    assert rebasing.outcomes() == [
        ("0001-Fix-the-answer.patch", "resolved"),
        ("0002-Fix-nine.patch", "clean"),
        ("0003-Upstream-has-the-value.patch", "applied-upstream"),
    ]
    assert rebasing.new_entries() == [("Pending", True), ("Pending", True), ("Applied-Upstream", False)]
    assert (
        "resolved by hand in python/demo/core.py; 1 of the old patch's 2 +/- lines replaced by 1 new ones"
        in rebasing.report()
    )
    with pytest.raises(CarryError, match=r"no carry rebase is in progress"):
        rebasing.resume()


def test_conflict_then_continue_after_the_user_committed(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, core(("return 41", "return 40")))
    with pytest.raises(CarryError, match=r"conflicts with demo 1.2"):
        rebasing.run()
    (demo.checkout / CORE).write_text(core(("return 41", "return 42")))
    git(demo.checkout, "add", CORE)
    assert git(demo.checkout, "am", "--continue").returncode == 0
    # Meanwhile tiny's branch moved: --continue (which goes on to verify) is refused, the stop kept.
    tiny = demo.root / "upstream" / "tiny"
    demo.commit_change("tiny/__init__.py", "X = 3\n", "work not exported", repo=tiny)
    with pytest.raises(
        CarryError, match=r"import tiny's carry/0.3, which differs.*`carry rebase --continue` again"
    ):
        rebasing.resume()
    git(tiny, "reset", "-q", "--hard", "upstream/0.3")
    assert rebasing.resume() == 0
    assert rebasing.new_entries()[0] == ("Pending", True)


def test_conflict_then_abort_leaves_everything_byte_identical(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, core(("return 41", "return 40")))
    commit_project(demo)
    before = fingerprint(demo)
    with pytest.raises(CarryError, match=r"conflicts with demo 1.2"):
        rebasing.run()
    assert project_status(demo) == " M upstream/demo.toml\n"  # the new pin, for review
    assert rebasing.abort() == 0
    assert fingerprint(demo) == before
    assert project_status(demo) == ""
    assert git(demo.checkout, "rev-parse", "--verify", "--quiet", "upstream/1.2", check=False).returncode != 0
    with pytest.raises(CarryError, match=r"no carry rebase is in progress"):
        rebasing.abort()
    # And it can be done again from the start.
    with pytest.raises(CarryError, match=r"conflicts with demo 1.2"):
        rebasing.run()


def test_entry_whose_tests_pass_on_the_new_pristine_becomes_applied_upstream(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    # 1.2 fixes f9 its own way (a later definition wins); the patch still applies.
    rebasing = Rebasing(demo, OLD_CORE + "def f9():\n    return 99\n", drop_when="rebased onto demo >= 1.2")
    capsys.readouterr()
    assert rebasing.run() == 0
    capsys.readouterr()
    assert rebasing.outcomes()[1] == ("0002-Fix-nine.patch", "upstream")
    assert rebasing.new_entries() == [
        ("Pending", True),
        ("Applied-Upstream", False),
        ("Applied-Upstream", False),
    ]
    patch = " ".join((rebasing.new_dir / "0002-Fix-nine.patch").read_text().split())
    assert (
        "Applied upstream in demo 1.2: the tests of this entry (tests/test_nine.py) pass on the "
        "pristine 1.2 tree" in patch
    )
    assert "(Upstream-Status on 1.1: Pending)" in patch
    assert "Upstream-Status: Applied-Upstream" in patch and "Upstream-Status: Pending" not in patch
    assert "Test: tests/test_nine.py" in patch and "Drop-When: rebased onto demo >= 1.2" in patch
    report = rebasing.report()
    assert "- `0002-Fix-nine.patch` (Fix nine): its tests pass on the pristine 1.2 tree" in report
    assert "- `0002-Fix-nine.patch` (upstream): rebased onto demo >= 1.2" in report


def test_keep_leaves_an_entry_fixed_upstream_as_a_diff(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    rebasing = Rebasing(demo, OLD_CORE + "def f9():\n    return 99\n")
    capsys.readouterr()
    # Kept, but then verify cannot prove it: its test passes without it.
    assert rebasing.run(keep=True) == 1
    assert isinstance(rebasing.result, RebaseResult)
    assert re.search(
        r"not proven: 0002-Fix-nine.patch WRONG \(expected fail -> pass\)", str(rebasing.result.problem())
    )
    assert rebasing.outcomes()[1] == ("0002-Fix-nine.patch", "clean")
    assert rebasing.new_entries()[1] == ("Pending", True)
    assert "its tests pass on the pristine 1.2 tree, but it was kept (--keep)" in rebasing.report()


def test_check_changes_nothing(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    rebasing = Rebasing(demo, OLD_CORE + "def f9():\n    return 99\n")
    commit_project(demo)
    before = fingerprint(demo)
    capsys.readouterr()
    assert rebasing.run(check=True) == 0
    out = capsys.readouterr().out
    assert rebasing.outcomes()[1] == ("0002-Fix-nine.patch", "upstream")
    assert "verify green" in out
    assert fingerprint(demo) == before
    assert project_status(demo) == ""
    assert not any((demo.root / "build").glob("rebase-check-*"))


def test_check_fails_naming_each_conflicting_patch(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    rebasing = Rebasing(demo, core(("return 41", "return 40"), ("return 9\n", "return 8\n")))
    before = fingerprint(demo)
    assert rebasing.run(check=True) == 1
    assert isinstance(rebasing.result, RebaseResult)
    message = str(rebasing.result.problem())
    assert "0001-Fix-the-answer.patch conflicts (python/demo/core.py)" in message
    assert "0002-Fix-nine.patch conflicts (python/demo/core.py)" in message
    assert fingerprint(demo) == before


def test_refused_while_a_git_operation_is_in_progress(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, OLD_CORE)
    git(demo.checkout, "checkout", "-q", "-b", "side", "upstream/1.1")
    demo.commit_change(CORE, core(("return 41", "return 43")), "side change")
    git(demo.checkout, "checkout", "-q", "carry/1.1")
    assert git(demo.checkout, "cherry-pick", "side", check=False).returncode != 0
    before = fingerprint(demo)
    with pytest.raises(
        CarryError, match=r"a git cherry-pick is in progress in upstream/demo: .*nothing was changed"
    ):
        rebasing.run()
    assert fingerprint(demo) == before
    assert rebasing.index.urls == []


def test_refused_while_the_checkout_is_dirty(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, OLD_CORE)
    (demo.checkout / CORE).write_text("work in progress\n")
    before = fingerprint(demo)
    with pytest.raises(CarryError, match=r"upstream/demo has uncommitted changes \(python/demo/core.py\)"):
        rebasing.run()
    assert fingerprint(demo) == before


def test_other_refusals_change_nothing(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, OLD_CORE)
    before = fingerprint(demo)
    with pytest.raises(CarryError, match=r"demo 1.1 is not newer than the 1.1 line"):
        rebasing.run(new="1.1")
    with pytest.raises(CarryError, match=r"demo 1.3 is not on https://pypi.org/simple \(newest there: 1.2\)"):
        rebasing.run(new="1.3")
    git(demo.checkout, "branch", "carry/1.2", "upstream/1.1")
    with pytest.raises(CarryError, match=r"upstream/demo already has carry/1.2"):
        rebasing.run()
    git(demo.checkout, "branch", "-D", "carry/1.2")
    assert fingerprint(demo) == before
    rebasing.new_dir.mkdir()
    with pytest.raises(CarryError, match=r"patches/demo/1.2 already exists"):
        rebasing.run()


def test_file_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = tmp_path / "index" / "demo"
    page.mkdir(parents=True)
    files = [{"filename": "demo-1.2.tar.gz", "url": "../../demo-1.2.tar.gz", "hashes": {"sha256": "ab" * 32}}]
    (page / "index.json").write_text(json.dumps({"files": files}))
    found = index_files("Demo", (tmp_path / "index").as_uri(), fetch_url)
    assert [(f.filename, f.sha256) for f in found] == [("demo-1.2.tar.gz", "ab" * 32)]
    assert os.path.basename(found[0].url) == "demo-1.2.tar.gz"


def test_a_file_index_that_is_missing_or_lacks_the_package(tmp_path: Path) -> None:
    """It named the package's index.json under a folder that did not exist, with no remedy."""
    with pytest.raises(CarryError, match=r"the index folder .*/nowhere does not exist: check --index-url"):
        index_files("demo", (tmp_path / "nowhere").as_uri(), fetch_url)
    (tmp_path / "index").mkdir()
    with pytest.raises(CarryError, match=r"the index .*/index has no demo/index.json: add it"):
        index_files("demo", (tmp_path / "index").as_uri(), fetch_url)


def test_an_index_url_that_is_not_a_url() -> None:
    """It said "not a PEP 691 JSON index page"."""
    with pytest.raises(CarryError, match=r"--index-url 'not a url' is not an index URL: give an https://"):
        index_url("not a url")
    assert index_url("file:///srv/index/") == "file:///srv/index"


def test_refused_while_a_package_the_tests_import_differs_from_patches(demo: DemoProject) -> None:
    """Both forms, before anything is pinned or replayed: every step that runs tests imports tiny."""
    rebasing = Rebasing(demo, OLD_CORE)
    demo.commit_change(
        "tiny/__init__.py", "X = 3\n", "work not exported", repo=demo.root / "upstream" / "tiny"
    )
    before = fingerprint(demo)
    differs = (
        r"the tests of demo 1.1 import tiny's carry/0.3, which differs from patches/tiny/0.3: "
        r"run `carry apply tiny`"
    )
    with pytest.raises(CarryError, match=differs + r".*`carry rebase 1.2 demo --upstream 1.1` again"):
        rebasing.run()
    with pytest.raises(CarryError, match=differs + r".*`carry rebase --check 1.2 demo --upstream 1.1` again"):
        rebasing.run(check=True)
    assert fingerprint(demo) == before
    assert rebasing.index.urls == []


def test_failure_after_the_pin_undoes_everything(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, OLD_CORE)
    del demo.pip.files["demo==1.2"]  # the download fails after the pin was written
    before = fingerprint(demo)
    with pytest.raises(CarryError, match=r"pip found no demo-1.2-py3-none-any.whl on its index"):
        rebasing.run()
    assert fingerprint(demo) == before
    with pytest.raises(CarryError, match=r"no carry rebase is in progress"):
        rebasing.abort()


def test_refused_when_the_old_line_is_not_ready(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, OLD_CORE)
    demo.commit_change(CORE, core(("return 41", "return 0")), message("Not exported", "tests/test_answer.py"))
    before = fingerprint(demo)
    with pytest.raises(CarryError, match=r"carry/1.1 in upstream/demo differs from patches/demo/1.1"):
        rebasing.run()
    assert fingerprint(demo) == before


def sglang_release(version: str, files: list[str]) -> Release:
    return Release("sglang", version, f"v{version}", tuple(PinnedFile(name, "0" * 64) for name in files))


def index_file(name: str) -> IndexFile:
    return IndexFile(name, f"https://files.example/{name}", hashlib.sha256(name.encode()).hexdigest(), False)


def test_the_new_pin_has_the_kinds_of_file_the_old_one_pins() -> None:
    kinds = ["cp311-cp311-manylinux_2_34_x86_64", "cp311-cp311-manylinux_2_34_aarch64"]
    old = sglang_release("0.5.20", [f"sglang-0.5.20-{kind}.whl" for kind in kinds])
    offered = [
        index_file(f"sglang-0.5.23-{kind}.whl")
        for kind in (
            "cp310-cp310-manylinux_2_34_x86_64",
            "cp311-cp311-manylinux_2_39_x86_64",
            "cp311-cp311-manylinux_2_28_x86_64",
            "cp311-cp311-manylinux_2_34_aarch64",
            "cp313-cp313-manylinux_2_34_aarch64",
        )
    ] + [
        index_file("sglang-0.5.23.tar.gz"),
        index_file("sglang-0.5.22-cp311-cp311-manylinux_2_34_x86_64.whl"),
    ]
    new = release_from_index(old, "0.5.23", offered, "https://index.example")
    # A changed glibc floor is followed (the lowest that fits); the same tags are taken as they are.
    assert [f.filename for f in new.files] == [
        "sglang-0.5.23-cp311-cp311-manylinux_2_28_x86_64.whl",
        "sglang-0.5.23-cp311-cp311-manylinux_2_34_aarch64.whl",
    ]
    assert new.files[1].sha256 == offered[3].sha256 and new.files[1].url is None
    assert new.git_tag == "v0.5.23"
    with pytest.raises(
        CarryError, match=r"sglang 0.5.22 on https://index.example has no file of the kind 0.5.20"
    ):
        release_from_index(old, "0.5.22", offered, "https://index.example")
    sdist = Release("kvcached", "0.1.6", "v0.1.6", (PinnedFile("kvcached-0.1.6.tar.gz", "0" * 64, "u"),))
    kv = release_from_index(sdist, "0.1.7", [index_file("kvcached-0.1.7.tar.gz")], "https://index.example")
    assert kv.files[0].url == "https://files.example/kvcached-0.1.7.tar.gz"
    assert render_release(kv).startswith('\n[[release]]\nversion = "0.1.7"\ngit_tag = "v0.1.7"\n')


def test_check_after_the_rebase_and_beside_work_in_progress(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    # What the acceptance runs once the new line is committed: --check rebuilds the old line from
    # patches/ in its scratch copy, so the new line, and the checkout's state, do not matter.
    rebasing = Rebasing(demo, core(("def f0():", "def f0() -> int:")))
    assert rebasing.run() == 0
    git(demo.checkout, "checkout", "-q", "--detach", "upstream/1.1")
    (demo.checkout / "scratch.txt").write_text("work in progress\n")
    before = fingerprint(demo)
    capsys.readouterr()
    assert rebasing.run(check=True) == 0
    out = capsys.readouterr().out
    assert "apply: demo 1.1: 3 patch(es) from patches/demo/1.1 on carry/1.1" in out
    assert rebasing.outcomes()[0] == ("0001-Fix-the-answer.patch", "3-way")
    assert fingerprint(demo) == before


def test_check_after_a_rebase_with_a_conflict_takes_the_recorded_port(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    # Once the new line is committed, a patch that conflicted is checked in the form the line
    # records; without that line the same check names the conflict.
    rebasing = Rebasing(demo, core(("return 41", "return 40")))
    before = fingerprint(demo)
    assert rebasing.run(check=True) == 1
    assert isinstance(rebasing.result, RebaseResult)
    assert "0001-Fix-the-answer.patch conflicts (python/demo/core.py)" in str(rebasing.result.problem())
    assert fingerprint(demo) == before
    with pytest.raises(CarryError):
        rebasing.run()
    (demo.checkout / CORE).write_text(core(("return 41", "return 42")))
    git(demo.checkout, "add", CORE)
    assert rebasing.resume() == 0
    before = fingerprint(demo)
    capsys.readouterr()
    assert rebasing.run(check=True) == 0
    out = capsys.readouterr().out
    assert "patches/demo/1.2 exists: a patch that conflicts is tried in the form that line records" in out
    assert rebasing.outcomes()[0] == ("0001-Fix-the-answer.patch", "ported")
    assert fingerprint(demo) == before


def test_check_latest(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    rebasing = Rebasing(demo, OLD_CORE)
    capsys.readouterr()
    assert rebasing.run(check=True, new="latest") == 0
    out = capsys.readouterr().out
    assert "the newest demo on https://pypi.org/simple is 1.2" in out and "verify green" in out
    rebasing.index.wheels[:] = [make_wheel(demo.artifacts, "demo", "1.1", OLD_FILES)]
    assert rebasing.run(check=True, new="latest") == 0
    assert "demo 1.1 is the newest release already: nothing to check" in capsys.readouterr().out


def test_cli_lines(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    demo.fetch()
    capsys.readouterr()
    assert demo.carry("rebase") == 1
    assert capsys.readouterr().err == (
        "carry rebase: error: name the release to rebase onto: `carry rebase NEW_VERSION [PACKAGE]`\n"
    )
    assert demo.carry("rebase", "--continue") == 1
    assert capsys.readouterr().err.startswith("carry rebase: error: no carry rebase is in progress")
    assert demo.carry("rebase", "--abort", "1.2") == 1
    assert "--continue and --abort take nothing else" in capsys.readouterr().err
    assert demo.carry("rebase", "1.x", "demo") == 1
    assert capsys.readouterr().err.startswith("carry rebase: error: '1.x' is not a PEP 440 version")


@pytest.mark.parametrize(
    ("condition", "admits"),
    [
        ("rebased onto sglang >= 0.5.22", True),
        (">=0.5.23", True),
        ("sglang >= 0.5.22, < 0.5.23", False),
        ("an sglang release catches it (none up to 0.5.23 does)", False),
        ("sglang 0.5.23 ships the fix", True),
        ("sglang 0.5.2 ships the fix", False),
        ("never (kept as a regression test)", False),
    ],
)
def test_drop_when_conditions_that_admit_the_new_release(condition: str, admits: bool) -> None:
    entry = Entry("0001-x.patch", "x", {"Drop-When": [condition]}, True, "0" * 64)
    assert drop_when_matches(entry, "sglang", "0.5.23") == ([condition] if admits else [])


def test_conflict_then_continue_after_a_plain_git_commit(demo: DemoProject) -> None:
    rebasing = Rebasing(demo, core(("return 41", "return 40")))
    with pytest.raises(CarryError, match=r"conflicts with demo 1.2"):
        rebasing.run()
    (demo.checkout / CORE).write_text(core(("return 41", "return 42")))
    git(demo.checkout, "add", CORE)
    final = git(demo.checkout, "rev-parse", "--git-path", "rebase-apply/final-commit").stdout.strip()
    git(demo.checkout, "commit", "-q", "-F", final)  # inside the stopped git am
    assert rebasing.resume() == 0
    assert rebasing.new_entries() == [("Pending", True), ("Pending", True), ("Applied-Upstream", False)]
    assert git(demo.checkout, "rev-parse", "--git-path", "rebase-apply").stdout.strip()
    assert not (demo.checkout / ".git" / "rebase-apply").exists()


def test_a_dropped_entrys_message_has_git_replace_its_status_trailer(tmp_path: Path) -> None:
    message = (
        "Fix nine\n\nWhy it was needed.\n\n"
        "Upstream-Status: Submitted https://example.com/pr/9\n  (a continuation line)\n"
        "Bug: https://example.com/issue/9\nTest: tests/test_nine.py\n"
    )
    dropped = with_applied_upstream_status(Git(tmp_path), message, "Applied upstream in demo 1.2.")
    assert dropped == (
        "Fix nine\n\nWhy it was needed.\n\nApplied upstream in demo 1.2.\n\n"
        "Upstream-Status: Applied-Upstream\nBug: https://example.com/issue/9\nTest: tests/test_nine.py\n"
    )


def test_the_report_counts_a_ported_entry_as_carried() -> None:
    """An entry the recorded port carries (--check) is on the new line with its diff: with its
    tests passing on the pristine tree it was kept (--keep), like one that applied."""
    state = State("demo", "1.1", "1.2", True, sys.executable, "carry rebase --check 1.2", "demo.toml")
    state.results = [
        PatchResult("0001-a.patch", "A", Outcome.PORTED, TestOutcome.PASS),
        PatchResult("0002-b.patch", "B", Outcome.CONFLICT, TestOutcome.PASS),
    ]
    report = render_report(state, [], "", "", verified=False)
    assert "- `0001-a.patch`: its tests pass on the pristine 1.2 tree, but it was kept (--keep)." in report
    assert "`0002-b.patch`: its tests pass" not in report
    assert [o for o in Outcome if o.carried] == [
        Outcome.CLEAN,
        Outcome.THREE_WAY,
        Outcome.RESOLVED,
        Outcome.PORTED,
    ]
    assert [o for o in Outcome if o.dropped] == [Outcome.EMPTY, Outcome.FIXED_UPSTREAM]


@pytest.mark.parametrize(
    ("code", "says"),
    [(404, "does not exist (HTTP 404): check the package name and the index"), (503, "answered HTTP 503")],
)
def test_an_index_that_answers_an_http_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, code: int, says: str
) -> None:
    """A 404 said "check the network", where the name or the index is what is wrong."""
    url = "https://pypi.org/simple/nosuchpackage/"

    def answering(request: urllib.request.Request, timeout: float) -> None:
        raise urllib.error.HTTPError(url, code, "an error", Message(), None)

    monkeypatch.setattr(urllib.request, "urlopen", answering)
    with pytest.raises(CarryError, match=re.escape(f"{url} {says}")):
        fetch_url(url)
