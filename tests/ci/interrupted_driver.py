"""A driver that serves real servers (ci/e2e/run_e2e.py, ci/bench/server.py) stopped by a signal
while its server hangs on a request: what a cancelled CI job (SIGTERM) or Ctrl-C must leave."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ci" / "e2e"))
from e2e_harness.server import free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE_SERVER = Path(__file__).with_name("fake_sglang_server.py")

# The driver's body, where it would start its servers: one run whose server (the fake, its child's
# PID written to a file) never answers one request. Request and run timeouts far beyond the test's
# bound: only the interrupt ends it.
ONE_RUN_THAT_HANGS = """
import os, sys
from pathlib import Path
sys.path.insert(0, {e2e!r})
from e2e_harness.plan import RunSpec
from e2e_harness.runner import run_once

def one_run_that_hangs(*args, **kwargs):
    command = [sys.executable, {fake!r}, "{port}", "hang", "--child-pid-file", {pid_file!r}]
    spec = RunSpec("patched", "patched")
    run_once("dense", spec, command, Path({out!r}), dict(os.environ), [], None, {port}, 60, 600, 600)
    return []
"""


def driver_script(main: str, out: Path, port: int) -> str:
    """``main`` (which calls one_run_that_hangs where the driver starts its servers) after the
    hanging run's definition."""
    hanging = ONE_RUN_THAT_HANGS.format(
        e2e=str(ROOT / "ci" / "e2e"),
        fake=str(FAKE_SERVER),
        port=port,
        pid_file=str(child_pid_file(out)),
        out=str(out),
    )
    return hanging + main


def child_pid_file(out: Path) -> Path:
    return out / "child.pid"


# Each signal a driver is stopped by, with the status a shell gives a command it ended.
INTERRUPTS = pytest.mark.parametrize(
    ("signum", "code", "name"), [(signal.SIGTERM, 143, "SIGTERM"), (signal.SIGINT, 130, "SIGINT")]
)


def assert_an_interrupt_kills_its_servers(
    main: str, out: Path, signum: int, code: int, error_line: str
) -> None:
    """Run the driver's ``main`` (see driver_script); once its server hangs, send ``signum``: the
    driver must exit ``code`` at once with ``error_line`` alone on stderr, the server and its child
    gone."""
    port = free_port()
    script = driver_script(main, out, port)
    driver = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    server_pids: list[int] = []
    try:
        for _ in range(300):
            if child_pid_file(out).exists() and (out / "dense-patched.log").exists():
                break
            time.sleep(0.1)
        else:
            driver.kill()
            pytest.fail(f"the fake server never started: {driver.communicate(timeout=10)[1]}")
        server_pids = [int(child_pid_file(out).read_text()), server_pid(port)]
        time.sleep(2.0)  # the run's traffic is sent; one request hangs
        driver.send_signal(signum)
        _, stderr = driver.communicate(timeout=30)
        assert driver.returncode == code, stderr
        assert stderr.splitlines() == [error_line]
        for pid in server_pids:
            assert gone(pid), f"process {pid} outlived the driver"
    finally:
        driver.kill()
        driver.wait(timeout=10)
        for pid in server_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def server_pid(port: int) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if str(FAKE_SERVER).encode() in argv and str(port).encode() in argv:
                    return int(entry.name)
    raise AssertionError(f"no fake server on port {port}")


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
        time.sleep(0.1)
    return False
