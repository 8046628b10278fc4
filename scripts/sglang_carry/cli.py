"""`carry`: parse the command line and dispatch; every command returns an exit code."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__
from .errors import CarryError
from .fetch import fetch
from .patching import apply, export
from .project import Project, Target, select_targets
from .status import status
from .verify import verify
from .wheel import build_all


def _per_target(
    step: Callable[[Project, Target], int],
) -> Callable[[Project, list[Target], argparse.Namespace], int]:
    def run(project: Project, targets: list[Target], _: argparse.Namespace) -> int:
        worst = 0
        for target in targets:
            worst = max(worst, step(project, target))
        return worst

    return run


COMMANDS: dict[str, tuple[str, Callable[[Project, list[Target], argparse.Namespace], int]]] = {
    "fetch": (
        "download the pinned upstreams (hash-checked) and lay down pristine checkouts",
        lambda p, t, _: fetch(p, t),
    ),
    "apply": ("git am the series onto a fresh carry/<version> branch", _per_target(apply)),
    "export": ("rewrite patches/ from the carry/<version> branch", _per_target(export)),
    "build": ("build the patched wheel / sdist into dist/", lambda p, t, _: build_all(p, t)),
    "verify": (
        "run each patch's tests without it (must fail) and with it (must pass)",
        lambda p, t, a: verify(p, t, a.python),
    ),
    "status": ("show pins, checkouts, branches and series", lambda p, t, _: status(p, t)),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="carry", description="Carry fixes on pinned SGLang and kvcached releases."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--root", type=Path, default=None, help="project root (default: found from the current directory)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (summary, _) in COMMANDS.items():
        sub = commands.add_parser(name, help=summary, description=summary)
        sub.add_argument(
            "packages", nargs="*", metavar="PACKAGE", help="upstreams to work on (default: all pinned)"
        )
        sub.add_argument(
            "--upstream",
            metavar="VERSION",
            default=None,
            help="upstream version line (default: the newest pinned)",
        )
        if name == "verify":
            sub.add_argument(
                "--python",
                default=None,
                help="interpreter with the test environment (default: .venv-test/bin/python)",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        project = Project(args.root.resolve()) if args.root else Project.find(Path.cwd())
        targets = select_targets(project, args.packages, args.upstream)
        return COMMANDS[args.command][1](project, targets, args)
    except CarryError as exc:
        print(f"carry {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"carry {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
