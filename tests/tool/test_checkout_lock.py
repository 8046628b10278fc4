"""One lock per checkout: a second writing command waits (saying for whom) or refuses with
--no-wait; a holder killed with SIGKILL holds nothing; status, which only reads, never waits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sglang_carry.checkout_lock import lock_path

from .conftest import DemoProject

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
# Holds the demo checkout's lock as `carry apply` would, says so, and waits for a line on stdin.
HOLDER = """
import sys
from pathlib import Path
from sglang_carry.checkout_lock import hold
from sglang_carry.project import Project
with hold(Project(Path(sys.argv[1])), "apply", wait=False):
    print("holding", flush=True)
    sys.stdin.readline()
"""


def start_holder(demo: DemoProject) -> subprocess.Popen[str]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(demo.root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(SCRIPTS)},
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def release(holder: subprocess.Popen[str]) -> None:
    assert holder.stdin is not None
    holder.stdin.write("done\n")
    holder.stdin.flush()
    holder.wait(timeout=30)


def test_a_second_command_refuses_with_no_wait(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    demo.fetch()
    holder = start_holder(demo)
    try:
        assert demo.carry("apply", "demo", "--no-wait") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1
        assert err[0].startswith(
            f"carry apply: error: `carry apply` (pid {holder.pid}) is working in this checkout"
        )
        assert str(lock_path(demo.project)) in err[0] and "drop --no-wait" in err[0]
        assert demo.carry("status", "demo") in (0, 1)  # reads only: never waits
    finally:
        release(holder)


def test_a_second_command_waits_saying_for_whom(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    demo.fetch()
    holder = start_holder(demo)
    releaser = threading.Timer(1.0, release, [holder])
    releaser.start()
    try:
        started = time.monotonic()
        assert demo.carry("apply", "demo") == 0
        assert time.monotonic() - started >= 0.9
        err = capsys.readouterr().err
        assert f"carry apply: `carry apply` (pid {holder.pid}) is working in this checkout; waiting" in err
    finally:
        releaser.join(timeout=30)


def test_a_killed_holder_holds_nothing(demo: DemoProject) -> None:
    demo.fetch()
    holder = start_holder(demo)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert lock_path(demo.project).exists()  # the file stays; the kernel dropped the lock
    assert demo.carry("apply", "demo", "--no-wait") == 0
