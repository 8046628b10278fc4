"""Prepare, here (with PyPI), what the bare GPU machine needs: build/gpu-bare/ within 64 MiB.

    .venv/bin/python ci/gpu-bare/prepare.py [--upstream 0.5.20] [--budget-mib 64]

- the patched sglang wheel for cp312 (patched_wheel.py: the tool's build on the pinned cp312 wheel);
- the wheels of ci/gpu-bare/requirements.txt for cp312 / manylinux x86_64, taken in the file's
  order while they fit in the budget (the patched wheel counts first); the ones that do not fit
  are listed in manifest.json and must already be on the machine;
- manifest.json: every carried file with its size and sha256, and what was left out.

The rest of what ci/gpu-bare/run uses (tests/, ci/) is the repository itself, carried along as
tracked files. Exit 1 if even the patched wheel does not fit.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import NormalizedName, canonicalize_name, parse_wheel_filename
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))

from sglang_carry.fetch import sha256_of  # noqa: E402

PLATFORMS = (
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
)


def requirements(path: Path) -> list[str]:
    return [
        line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")
    ]


def download(requirement: str, dest: Path) -> Path:
    """One cp312 wheel (no dependencies: the list is the closure)."""
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "--python-version",
                "3.12",
                "--implementation",
                "cp",
                "--abi",
                "cp312",
                *platforms,
                "--platform",
                "any",
                "--dest",
                tmp,
                requirement,
            ],
            check=True,
        )
        [wheel] = Path(tmp).glob("*.whl")
        return Path(shutil.move(str(wheel), dest / wheel.name))


def _pinned(requirement: str) -> tuple[NormalizedName, Version]:
    """``name==version`` as packaging compares wheel names: canonical name, parsed version."""
    parsed = Requirement(requirement)
    [specifier] = parsed.specifier
    return canonicalize_name(parsed.name), Version(specifier.version)


def pack(
    sglang_wheel: Path, wanted: list[str], out: Path, budget: int, fetch: object = download
) -> dict[str, object]:
    """Copy the patched wheel, then each requirement's wheel while the total stays within budget."""
    wheels = out / "wheels"
    cache = out / "cache"
    for folder in (wheels, cache):
        folder.mkdir(parents=True, exist_ok=True)
    for old in wheels.glob("*.whl"):
        old.unlink()
    carried = [shutil.copy2(sglang_wheel, wheels / sglang_wheel.name)]
    used = sglang_wheel.stat().st_size
    if used > budget:
        raise SystemExit(f"prepare: error: {sglang_wheel.name} alone is {used} bytes, over the budget")
    left_out = []
    for requirement in wanted:
        wanted_name, wanted_version = _pinned(requirement)
        cached = [
            w
            for w in cache.glob("*.whl")
            if parse_wheel_filename(w.name)[:2] == (wanted_name, wanted_version)
        ]
        wheel = cached[0] if cached else fetch(requirement, cache)  # type: ignore[operator]
        size = wheel.stat().st_size
        if used + size > budget:
            left_out.append({"requirement": requirement, "bytes": size})
            continue
        carried.append(shutil.copy2(wheel, wheels / wheel.name))
        used += size
    manifest = {
        "budget_bytes": budget,
        "carried_bytes": used,
        "sglang_wheel": sglang_wheel.name,
        "carried": [
            {"file": Path(p).name, "bytes": Path(p).stat().st_size, "sha256": sha256_of(Path(p))}
            for p in carried
        ],
        "left_out": left_out,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", default="0.5.20")
    parser.add_argument("--budget-mib", type=float, default=64.0)
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-bare")
    args = parser.parse_args(argv)
    built = subprocess.run(
        [
            sys.executable,
            str(HERE / "patched_wheel.py"),
            "--upstream",
            args.upstream,
            "--python-tag",
            "cp312",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    sglang_wheel = Path(built.stdout.strip().splitlines()[-1])
    budget = int(args.budget_mib * 1024 * 1024)
    manifest = pack(sglang_wheel, requirements(HERE / "requirements.txt"), args.out, budget)
    mib = manifest["carried_bytes"] / 2**20  # type: ignore[operator]
    print(f"prepare: {len(manifest['carried'])} wheels, {mib:.1f} MiB of {args.budget_mib} MiB")  # type: ignore[arg-type]
    for item in manifest["left_out"]:  # type: ignore[attr-defined]
        size = item["bytes"] / 2**20
        print(f"prepare: left out (must be on the machine): {item['requirement']} ({size:.1f} MiB)")
    print(f"prepare: carry {args.out}/wheels and manifest.json to the machine")
    return 0


if __name__ == "__main__":
    sys.exit(main())
