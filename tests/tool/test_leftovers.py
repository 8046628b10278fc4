"""What a command killed part-way leaves: status reports it (and fails) unless a command is at
work; the next writing command removes it; an interrupted rebase shows in status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_carry.git import Git
from sglang_carry.patching import export
from sglang_carry.rebase import STATE_FILE

from .conftest import DemoProject, patch_message
from .test_checkout_lock import release, start_holder

CORE = "python/demo/core.py"


def carried(demo: DemoProject) -> None:
    demo.fetch()
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    assert export(demo.project, demo.target()).exit_code == 0


def leave_a_killed_build(demo: DemoProject) -> Path:
    partial = demo.root / "build" / "tmpk1ll3d.partial"
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_bytes(b"\0" * 2_000_000)
    incoming = demo.project.downloads_dir / ".incoming-x1"
    incoming.mkdir(parents=True)
    (incoming / "demo-1.0-py3-none-any.whl").write_bytes(b"half")
    return partial


def test_status_reports_leftovers_and_a_writing_command_removes_them(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    carried(demo)
    partial = leave_a_killed_build(demo)
    assert demo.carry("status", "demo") == 1
    out = capsys.readouterr().out
    assert "leftover  build/tmpk1ll3d.partial (2.0 MB), from a carry command killed part-way" in out
    assert "leftover  upstream/.downloads/.incoming-x1" in out
    assert demo.carry("apply", "demo") == 0
    err = capsys.readouterr().err
    assert (
        "carry apply: removed build/tmpk1ll3d.partial (2.0 MB), left by a carry command killed part-way"
        in err
    )
    assert not partial.exists() and not (demo.project.downloads_dir / ".incoming-x1").exists()
    assert demo.carry("status", "demo") == 0


def test_a_working_commands_files_are_not_leftovers(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    carried(demo)
    partial = leave_a_killed_build(demo)
    holder = start_holder(demo)
    try:
        assert demo.carry("status", "demo") == 0
        out = capsys.readouterr().out
        assert f"checkout  `carry apply` (pid {holder.pid}) is working in this checkout" in out
        assert "leftover" not in out
        assert partial.exists()
    finally:
        release(holder)


def test_status_shows_an_interrupted_rebase(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGKILLed `carry rebase` left its state (and maybe a changed pin file): status said ok."""
    carried(demo)
    state = Git(demo.checkout).state_file(STATE_FILE)
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text("{}")
    assert demo.carry("status", "demo") == 1
    out = capsys.readouterr().out
    assert "rebase    a `carry rebase` of demo stopped part-way" in out and "`carry rebase --abort`" in out
    assert demo.carry("status", "demo", "--json") == 1
    report = json.loads(capsys.readouterr().out)
    assert report["checkout"]["rebases"] == [str(state)]


def test_a_build_killed_with_sigkill_leaves_what_the_next_command_removes(demo: DemoProject) -> None:
    """A real build, SIGKILLed as it writes its wheel: the next writing command cleans up."""
    carried(demo)
    scripts = Path(__file__).resolve().parents[2] / "scripts"
    killed = subprocess.run(
        [sys.executable, "-c", KILL_DURING_BUILD, str(demo.root)],
        env={**os.environ, "PYTHONPATH": str(scripts)},
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert killed.returncode == -9, killed.stderr
    assert list((demo.root / "build").glob("tmp*"))
    assert demo.carry("build", "demo") == 0
    assert not list((demo.root / "build").glob("tmp*.partial"))


# Builds the demo wheel and kills itself the moment the wheel's partial file is being written.
KILL_DURING_BUILD = """
import os, signal, sys
from pathlib import Path
from sglang_carry import files
from sglang_carry.project import Project
from sglang_carry.build import build
real_place = files.place
def place_then_die(source, destination, mode=0o644):
    os.kill(os.getpid(), signal.SIGKILL)
import sglang_carry.build as wheel
wheel.place = place_then_die
project = Project(Path(sys.argv[1]))
from sglang_carry.project import select_targets
build(project, select_targets(project, ["demo"], None)[0])
"""
