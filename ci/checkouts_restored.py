"""Run a command, then put every upstream checkout back on the branch it was found on.

    python ci/checkouts_restored.py COMMAND [ARG ...]

./scripts/test lays the default line down first (`carry fetch`, `carry apply`), and `carry apply`
checks that line's branch out: a developer who ran the tests with another line checked out (in
the middle of porting 0.5.20, say) found the checkout switched. The tests themselves do not need
it switched (sglang_carry/trees.py). Exits with the command's status, or 1 when a checkout could
not be put back (each named on one line: it held uncommitted work, which is never touched).
"""

# ruff: noqa: E402  (the tool is imported from this checkout, after sys.path names it)
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))  # this checkout's tool, whichever venv runs the script

from sglang_carry.project import Project
from sglang_carry.trees import run_with_checkouts_restored


def main(argv: Sequence[str] | None = None) -> int:
    command = list(sys.argv[1:] if argv is None else argv)
    if not command:
        print(
            "checkouts-restored: error: no command given: ci/checkouts_restored.py COMMAND [ARG ...]",
            file=sys.stderr,
        )
        return 2
    code, not_restored = run_with_checkouts_restored(Project(ROOT), command)
    for problem in not_restored:
        print(f"checkouts-restored: error: {problem}", file=sys.stderr)
    return code or (1 if not_restored else 0)


if __name__ == "__main__":
    sys.exit(main())
