"""A real sglang server: its command line, its environment on CPU, its process (in a group of
its own, stopped by signalling that group) and its peak memory."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from .scenarios import HICACHE_FLAGS

E2E = Path(__file__).resolve().parents[1]
ROOT = E2E.parents[1]
# Put on every server's PYTHONPATH: the hook last (its sitecustomize injects and counts), and on
# CPU the stand-ins for the kernels nobody ships for CPU.
HOOK = E2E / "hook"
CPU_STANDINS = E2E / "cpu"
HOST = "127.0.0.1"
# CPU servers: sglang's CPU engine, its native attention (the x86 default needs AMX kernels).
CPU_FLAGS = ["--device", "cpu", "--attention-backend", "torch_native"]


# uvicorn's line when the server's HTTP port was taken between free_port() and the server binding
# it (sglang's own processes pick their ports meanwhile); the server then never serves.
PORT_TAKEN = "error while attempting to bind on address"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def server_command(
    python: str, model_dir: Path, port: int, extra: Sequence[str] = (), scenario_flags: Sequence[str] = ()
) -> list[str]:
    """The server's command line: what every run shares, the scenario's pool and scheduling flags
    (default: HICACHE's), then the run's own."""
    return [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_dir),
        "--host",
        HOST,
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--mem-fraction-static",
        "0.3",
        "--cuda-graph-backend-decode",
        "disabled",
        "--cuda-graph-backend-prefill",
        "disabled",
        "--enable-cache-report",
        "--random-seed",
        "0",
        "--log-level",
        "info",
        *(scenario_flags or HICACHE_FLAGS),
        *extra,
    ]


@dataclass
class Server:
    """A server in its own process group; stopped by signalling that group (its PID)."""

    process: subprocess.Popen[bytes]
    log: Path
    base_url: str

    @classmethod
    def start(cls, command: Sequence[str], env: dict[str, str], log: Path, port: int) -> Server:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            process = subprocess.Popen(
                list(command), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        server = cls(process, log, f"http://{HOST}:{port}")
        _RUNNING[process.pid] = server
        return server

    def alive(self) -> bool:
        return self.process.poll() is None

    def wait_healthy(self, timeout_s: float, poll_s: float = 1.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive() or self.port_taken():
                return False
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return True
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll_s)
        return False

    def port_taken(self) -> bool:
        return PORT_TAKEN in self.log.read_text(errors="replace")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.process.poll() is None:
            with _no_such_process():
                os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=grace_s)
        self.kill()
        self.process.wait(timeout=grace_s)
        _RUNNING.pop(self.process.pid, None)

    def kill(self) -> None:
        # The scheduler and detokenizer processes are in the same group: none may outlive it.
        with _no_such_process():
            os.killpg(self.process.pid, signal.SIGKILL)


class Terminated(BaseException):
    """SIGTERM, raised where the driver was, so that every ``finally`` on the way out runs."""


def interrupted_exit(stop: BaseException) -> tuple[str, int]:
    """The signal that stopped a driver and the status a shell gives a command that signal ended."""
    return ("SIGTERM", 143) if isinstance(stop, Terminated) else ("SIGINT", 130)


# The servers started and not stopped yet, by the PID of their process group.
_RUNNING: dict[int, Server] = {}


@contextlib.contextmanager
def servers_killed_on_interrupt() -> Iterator[None]:
    """Ctrl-C (SIGINT) or SIGTERM (a CI job cancelled or timed out) kills every server still
    running, then unwinds the driver (KeyboardInterrupt, Terminated) so each run's ``finally``
    runs. A server is in a session of its own, out of reach of the terminal's Ctrl-C, and Python's
    default for SIGTERM ends the driver without any ``finally``: the server, its scheduler and its
    detokenizer would live on, holding both cores and their ports under the next job. Killed
    first, a server fails its requests in flight at once, instead of holding the way out for their
    timeout."""

    def interrupt(signum: int, frame: object) -> None:
        for server in list(_RUNNING.values()):
            server.kill()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Terminated(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class _no_such_process:
    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError)


class PeakMemory:
    """The largest resident size of a process and its descendants, sampled every second."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_bytes = pid, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        try:
            import psutil  # type: ignore[import-untyped, unused-ignore]
        except ImportError:
            return
        while not self._stop.wait(1.0):
            try:
                root = psutil.Process(self.pid)
                tree = [root, *root.children(recursive=True)]
                total = 0
                for process in tree:
                    with contextlib.suppress(psutil.Error):
                        total += process.memory_info().rss
                self.peak_bytes = max(self.peak_bytes, total)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_bytes // (1 << 20)


def cpu_env(base: dict[str, str], out: Path) -> dict[str, str]:
    env = dict(base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env["CARRY_E2E_CPU"] = "1"
    # A CUDA build of torch beside an NCCL wheel makes the CPU platform try pynccl; point it nowhere.
    env["SGLANG_NCCL_SO_PATH"] = str(out / "no-libnccl.so")
    # No JIT cache shared with another tree or run.
    env["TORCH_EXTENSIONS_DIR"] = str(out / "torch-extensions")
    return env
