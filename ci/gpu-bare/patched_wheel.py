"""Build the patched sglang wheel for another Python than the one running `carry`.

    .venv/bin/python ci/gpu-bare/patched_wheel.py --upstream 0.5.20 --python-tag cp312

`carry build` patches the pinned wheel that fits the running interpreter (pins.select_file).
The bare GPU machine runs Python 3.12 while `carry` runs on 3.11 here, so this fetches the pinned
wheel with the asked tag (hash-checked like `carry fetch`) and runs the tool's own build on it:
same series, same checks, same provenance record, only the pinned file chosen differs. The series
changes only Python files, so the compiled parts of the cp312 wheel are the official ones.
Prints the wheel's path last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from sglang_carry import fetch  # noqa: E402
from sglang_carry.build import build  # noqa: E402
from sglang_carry.errors import CarryError  # noqa: E402
from sglang_carry.kinds import WHEEL  # noqa: E402
from sglang_carry.kinds.wheel import tags_of  # noqa: E402
from sglang_carry.pins import PinnedFile, Release  # noqa: E402
from sglang_carry.project import Project, select_targets  # noqa: E402
from sglang_carry.runner import run_subprocess  # noqa: E402


def pinned_wheel(release: Release, python_tag: str, platform: str) -> PinnedFile:
    for pinned in release.files:
        if pinned.kind is WHEEL and any(
            t.interpreter == python_tag and t.platform == platform for t in tags_of(pinned.filename)
        ):
            return pinned
    raise CarryError(f"no pinned {release.name} {release.version} wheel for {python_tag} {platform}")


def build_for(root: Path, version: str, python_tag: str, platform: str) -> Path:
    project = Project.find(root)
    [target] = select_targets(project, ["sglang"], version)
    pinned = pinned_wheel(target.release, python_tag, platform)
    fetch.download(project, target, pinned, run_subprocess)
    return build(project, target, run_subprocess, pinned)  # the pinned file: the only difference


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--python-tag", default="cp312")
    parser.add_argument("--platform", default="manylinux_2_34_x86_64")
    args = parser.parse_args(argv)
    try:
        print(build_for(ROOT, args.upstream, args.python_tag, args.platform))
    except CarryError as error:
        print(f"patched_wheel: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
