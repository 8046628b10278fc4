"""ci/test-envs.toml, read in one place and with the standard library only: scripts/test_env.py
reads it before anything is installed (it builds the environments), testenv.py for the tool."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import CarryError

ENV_TABLE = Path("ci") / "test-envs.toml"


@dataclass(frozen=True)
class TestEnv:
    __test__ = False  # not a test class, whatever pytest thinks of the name

    name: str
    venv: Path
    lock: Path
    shims: tuple[Path, ...] = ()
    # What a real sglang server needs beyond the environment (the e2e's CPU servers), if any.
    e2e_server_lock: Path | None = None

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def build_command(self) -> str:
        return f"python3 scripts/test_env.py {self.name}"


def read_env_table(root: Path) -> tuple[str, dict[str, TestEnv]]:
    """The default environment's name and every environment, their paths under ``root``."""
    path = root / ENV_TABLE
    try:
        data = tomllib.loads(path.read_text())
        default, table = data["default"], data["envs"]
        envs = {
            name: TestEnv(
                name,
                root / spec["venv"],
                root / spec["lock"],
                tuple(root / shim for shim in spec.get("shims", [])),
                root / spec["e2e_server_lock"] if "e2e_server_lock" in spec else None,
            )
            for name, spec in table.items()
        }
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise CarryError(f"{path}: cannot read the test environments ({exc!r})") from exc
    if default not in envs:
        raise CarryError(f"{path}: the default environment '{default}' is not among [envs]")
    return default, envs
