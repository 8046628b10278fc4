"""Create or refresh the CPU test environment (.venv-test) from the committed lock.

Kept outside the tool's package because it runs before anything is installed. The venv is
rebuilt only when its inputs change (the lock, the torchvision shim, pyproject.toml, this file),
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
LOCK = ROOT / "ci" / "requirements-test.lock"
SHIM = ROOT / "ci" / "cpu-shims" / "torchvision_cpu_shim.py"
STAMP = ".carry-test-env"


def inputs_digest() -> str:
    digest = hashlib.sha256()
    files = [LOCK, ROOT / "pyproject.toml", SHIM, Path(__file__)]
    for path in files:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def run(*args: str) -> None:
    subprocess.run(args, check=True)


def site_packages(env: Path) -> Path:
    python = env / "bin" / "python"
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def main() -> int:
    env = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / ".venv-test"
    wanted = inputs_digest()
    stamp = env / STAMP
    if stamp.exists() and stamp.read_text().strip() == wanted:
        print(f"test-env: {env.name} is up to date")
        return 0
    started = time.monotonic()
    source = LOCK.relative_to(ROOT)
    print(f"test-env: building {env.name} from {source} (a few minutes on first run)", flush=True)
    shutil.rmtree(env, ignore_errors=True)
    venv.EnvBuilder(with_pip=True).create(env)
    pip = [str(env / "bin" / "python"), "-m", "pip", "install", "--quiet", "--no-input"]
    run(*pip, "--no-deps", "--requirement", str(LOCK))
    run(*pip, "--no-deps", "--no-build-isolation", "--editable", str(ROOT))
    # torchvision exists on PyPI only as a CUDA build; the shim lets it import beside the CPU
    # torch (see the README's test environment section and the shim's docstring).
    site = site_packages(env)
    shutil.copyfile(SHIM, site / SHIM.name)
    (site / "torchvision_cpu_shim.pth").write_text("import torchvision_cpu_shim\n")
    stamp.write_text(wanted + "\n")
    print(f"test-env: ready in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
