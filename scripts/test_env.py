"""Create or refresh the test environments named in ci/test-envs.toml, each from its committed lock.

    python3 scripts/test_env.py [NAME ...]     (default: the default environment, .venv-test)

Kept outside the tool's package because it runs before anything is installed. A venv is rebuilt
only when its inputs change (its lock, its shims, pyproject.toml, ci/test-envs.toml, this file),
which a stamp file inside the venv records.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The table's reader is the tool's own, which needs nothing beyond the standard library.
sys.path.insert(0, str(ROOT / "scripts"))
from sglang_carry.env_table import ENV_TABLE, TestEnv, read_env_table  # noqa: E402
from sglang_carry.errors import CarryError  # noqa: E402

TABLE = ROOT / ENV_TABLE
STAMP = ".carry-test-env"


def load_envs() -> tuple[str, dict[str, TestEnv]]:
    try:
        return read_env_table(ROOT)
    except CarryError as exc:
        raise SystemExit(f"test-env: error: {exc}") from None


def inputs_digest(env: TestEnv) -> str:
    digest = hashlib.sha256(env.name.encode() + b"\0")
    for path in [env.lock, ROOT / "pyproject.toml", TABLE, *env.shims, Path(__file__)]:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run(*args: str) -> None:
    subprocess.run(args, check=True)


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def build(env: TestEnv) -> None:
    if env.venv.is_symlink():
        # Someone else's environment, lent to this checkout: never rebuilt (or deleted) from here.
        print(f"test-env: {env.venv.name} ({env.name}) is a link to {env.venv.resolve()}: left as it is")
        return
    wanted = inputs_digest(env)
    stamp = env.venv / STAMP
    if stamp.exists() and stamp.read_text().strip() == wanted:
        print(f"test-env: {env.venv.name} ({env.name}) is up to date")
        return
    started = time.monotonic()
    source = env.lock.relative_to(ROOT)
    print(f"test-env: building {env.venv.name} ({env.name}) from {source} (minutes on first run)", flush=True)
    shutil.rmtree(env.venv, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(env.venv)
    python = env.venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "--quiet", "--no-input"]
    run(*pip, "--no-deps", "--requirement", str(env.lock))
    run(*pip, "--no-deps", "--no-build-isolation", "--editable", str(ROOT))
    # A shim is a module that a .pth file loads at startup: the torch 2.13.0 environment's lets
    # PyPI's CUDA torchvision import beside the CPU torch (see the README's test environment
    # section and the shim's docstring).
    site = site_packages(python)
    for shim in env.shims:
        shutil.copyfile(shim, site / shim.name)
        (site / f"{shim.stem}.pth").write_text(f"import {shim.stem}\n")
    stamp.write_text(wanted + "\n")
    print(f"test-env: {env.venv.name} ready in {time.monotonic() - started:.0f} s", flush=True)


def main(argv: list[str]) -> int:
    default, envs = load_envs()
    names = argv or [default]
    unknown = [name for name in names if name not in envs]
    if unknown:
        known = ", ".join(sorted(envs))
        print(f"test-env: error: unknown environment {', '.join(unknown)} (known: {known})", file=sys.stderr)
        return 2
    for name in names:
        try:
            build(envs[name])
        except KeyboardInterrupt:
            # The stamp is written last: an unfinished environment is rebuilt on the next run.
            print(
                f"test-env: interrupted while building {envs[name].venv.name}; the next run builds it again",
                file=sys.stderr,
            )
            return 130
        except subprocess.CalledProcessError as exc:
            print(
                f"test-env: error: building {envs[name].venv.name} ({name}) failed: pip exited "
                f"{exc.returncode} (its output is above); fix that, then run this again",
                file=sys.stderr,
            )
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
