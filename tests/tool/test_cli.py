from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_carry.cli import main
from sglang_carry.patching import export

from .conftest import DemoProject, git, patch_message
from .test_verify import write_tests

CORE = "python/demo/core.py"
SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def test_unknown_version_is_one_line_and_non_zero(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--root", str(demo.root), "apply", "demo", "--upstream", "2.0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("carry apply: error: demo 2.0 is not pinned")


def test_status_before_fetch(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(demo.root), "status"]) == 0  # steps not taken yet are not problems
    out = capsys.readouterr().out
    assert "demo 1.0" in out and "not fetched (`carry fetch demo --upstream 1.0` fetches it)" in out
    # The fetch that reaches this line: plain `carry fetch` takes each package's newest line only.
    assert "checkout  missing (run `carry fetch demo --upstream 1.0`)" in out


def test_build_before_fetch_says_what_to_do(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    demo.series_dir.mkdir(parents=True)
    (demo.series_dir / "carries-nothing").write_text("upstream has every fix\n")
    assert main(["--root", str(demo.root), "build", "demo"]) == 1
    assert "run `carry fetch` first" in capsys.readouterr().err


def carried(demo: DemoProject) -> None:
    demo.fetch()
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    assert export(demo.project, demo.target()).exit_code == 0


def test_status_exit_codes(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    carried(demo)
    assert demo.carry("status", "demo") == 0
    # DIFFERS: a commit on the branch that patches/ does not have.
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Not exported"))
    assert demo.carry("status", "demo") == 1
    assert "DIFFERS from patches/" in capsys.readouterr().out
    git(demo.checkout, "reset", "-q", "--hard", "HEAD~1")
    assert demo.carry("status", "demo") == 0
    # BROKEN: a patch file the series does not list.
    stray = demo.series_dir / "0099-x.patch"
    stray.write_text("stray\n")
    assert demo.carry("status", "demo") == 1
    assert "series    BROKEN: patches/demo/1.0/0099-x.patch is not listed" in capsys.readouterr().out
    stray.unlink()
    # A download that fails its hash.
    cached = demo.project.downloads_dir / demo.wheel.name
    cached.write_bytes(cached.read_bytes()[:50])
    assert demo.carry("status", "demo") == 1
    assert "WRONG sha256" in capsys.readouterr().out


def test_status_shows_a_revision_changed_by_hand(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    carried(demo)
    revision = demo.series_dir / "revision"
    revision.write_text(revision.read_text().replace("revision = 1", "revision = 7"))
    assert demo.carry("status", "demo") == 1
    out = capsys.readouterr().out
    assert "1 entry, revision CHANGED by hand to 7 (recorded: 1;" in out
    assert "git checkout -- patches/demo/1.0/revision` restores it" in out


def test_status_json(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    carried(demo)
    capsys.readouterr()
    assert demo.carry("status", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    demo_line = next(line for line in report["lines"] if line["name"] == "demo")
    assert demo_line["pin"]["download"] == "ok"
    assert demo_line["series"]["state"] == "recorded"
    assert demo_line["series"]["entries"] == [
        {"file": "0001-Fix-the-answer.patch", "upstream_status": "Pending"}
    ]
    assert demo_line["checkout"]["branch"] == "matches"
    tiny_line = next(line for line in report["lines"] if line["name"] == "tiny")
    assert tiny_line["pin"]["download"] == "missing" and tiny_line["checkout"]["state"] == "missing"


def test_closed_stdout_is_one_line(demo: DemoProject) -> None:
    carried(demo)
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    process = subprocess.Popen(
        [sys.executable, "-m", "sglang_carry", "--root", str(demo.root), "status"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(scripts)},
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # `carry status | head -0`: the reader is gone before carry writes
    err = process.stderr.read().decode()
    assert process.wait() == 141
    assert err.count("\n") == 1
    assert err.startswith("carry status: error: stdout was closed before the output ended")


def test_unexpected_os_error_is_one_line_with_the_path(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    demo.fetch()
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    (demo.root / "patches" / "demo").write_text("a file where a folder belongs\n")
    assert demo.carry("export", "demo") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"carry export: error: {demo.root / 'patches' / 'demo'}")


def test_a_series_entry_outside_its_folder_is_refused(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    carried(demo)
    series = demo.series_dir / "series"
    series.write_text(series.read_text() + "../../elsewhere.patch\n")
    assert demo.carry("status", "demo") == 1
    assert "lists '../../elsewhere.patch', which is not a file in its folder" in capsys.readouterr().out


def test_a_series_file_that_is_not_utf8(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    carried(demo)
    series = demo.series_dir / "series"
    series.write_bytes(series.read_bytes() + b"\xff\n")
    assert demo.carry("status", "demo") == 1
    assert f"{series} is not UTF-8 (byte" in capsys.readouterr().out


def test_an_output_that_cannot_show_a_character_gets_an_escape(demo: DemoProject) -> None:
    """PYTHONIOENCODING=latin-1: status's ellipsis after a short hash comes out escaped, and the
    command neither stops nor prints a traceback."""
    carried(demo)
    run = subprocess.run(
        [sys.executable, "-m", "sglang_carry", "--root", str(demo.root), "status", "demo"],
        capture_output=True,
        env={**os.environ, "PYTHONIOENCODING": "latin-1", "PYTHONPATH": str(SCRIPTS)},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr.decode("latin-1")
    assert b"Traceback" not in run.stderr
    assert b"\\u2026 fetched, sha256 ok" in run.stdout


def test_a_root_that_is_not_a_checkout(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """It said "no pins in .../upstream"."""
    assert main(["--root", str(tmp_path / "nonexistent"), "status"]) == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "nonexistent is not inside a sglang-carry checkout (no upstream/ and patches/)" in line
    assert "name its folder with --root" in line


def test_status_runs_where_build_cannot_be_written(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    """status only reads: a build/ it cannot write (here a file in its place) does not stop it."""
    carried(demo)
    shutil.rmtree(demo.root / "build", ignore_errors=True)
    (demo.root / "build").write_text("not a folder\n")
    assert demo.carry("status", "demo") == 0
    assert "carry/1.0 matches patches/" in capsys.readouterr().out


def test_a_full_device_behind_stdout_is_named(demo: DemoProject) -> None:
    """`carry status > /dev/full` said "a file: No space left on device"."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    carried(demo)
    with open("/dev/full", "w") as full:
        run = subprocess.run(
            [sys.executable, "-m", "sglang_carry", "--root", str(demo.root), "status", "demo"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(SCRIPTS)},
            timeout=120,
        )
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "carry status: error: stdout: No space left on device: free some disk space"
    ]


def test_every_command_prints_its_result_as_json(
    demo: DemoProject, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def as_json(*args: str, code: int = 0) -> Any:
        capsys.readouterr()
        assert demo.carry(*args, "--json") == code
        out, err = capsys.readouterr()
        return json.loads(out), err

    write_tests(demo)
    demo.lay_down("tiny")  # the tests of demo import it (verify, below)
    demo.fetch()  # offline, with the fake pip; the CLI's fetch below finds it cached
    fetched, err = as_json("fetch", "demo")
    assert fetched["checkouts"] == [
        {
            "package": "demo",
            "line": "1.0",
            "tag": "upstream/1.0",
            "state": "present",
            "seconds": 0.0,
            "laid_from": None,
        }
    ]
    assert "fetch: demo-1.0-py3-none-any.whl: cached, sha256 ok" in err  # progress on stderr
    demo.commit_change(
        CORE, "def answer():\n    return 42\n", patch_message("Fix", tests="tests/test_answer.py")
    )
    exported, _ = as_json("export", "demo")
    assert (exported["state"], exported["patches"], exported["revision"]) == ("wrote", 1, 1)
    applied, _ = as_json("apply", "demo")
    assert applied["state"] == "already-carries"
    built, _ = as_json("build", "demo")
    [artifact] = built["artifacts"]
    assert (
        artifact["for_this_interpreter"]
        and Path(artifact["path"]).name == "demo-1.0+carry.1-py3-none-any.whl"
    )
    verified, _ = as_json("verify", "demo", "--python", sys.executable)
    [row] = verified["rows"]
    assert (row["verdict"]["without"], row["verdict"]["with_patch"], row["verdict"]["ok"]) == (
        "fail",
        "pass",
        True,
    )
    indexed, _ = as_json("index", str(tmp_path / "simple"))
    assert indexed["projects"] == ["demo"]
    state, _ = as_json("status", "demo")
    assert state["ok"] is True
    failed, err = as_json("rebase", "--continue", code=1)
    assert failed == {
        "ok": False,
        "error": "no carry rebase is in progress: start one with `carry rebase NEW_VERSION`",
    }
    assert err.startswith("carry rebase: error: no carry rebase is in progress")
