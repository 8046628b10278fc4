"""`carry`: parse the command line and dispatch; every command returns an exit code."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from . import __version__
from .errors import CarryError
from .fetch import fetch
from .files import describe_os_error
from .patching import apply, export
from .project import Project, Target, select_targets
from .status import status
from .verify import verify
from .wheel import build_all


def _per_target(
    step: Callable[[Project, Target, argparse.Namespace], int],
) -> Callable[[Project, list[Target], argparse.Namespace], int]:
    def run(project: Project, targets: list[Target], args: argparse.Namespace) -> int:
        worst = 0
        for target in targets:
            worst = max(worst, step(project, target, args))
        return worst

    return run


COMMANDS: dict[str, tuple[str, Callable[[Project, list[Target], argparse.Namespace], int]]] = {
    "fetch": (
        "download the pinned upstreams (hash-checked) and lay down pristine checkouts",
        lambda p, t, _: fetch(p, t),
    ),
    "apply": (
        "git am the series onto a fresh carry/<version> branch",
        _per_target(lambda p, t, _: apply(p, t)),
    ),
    "export": (
        "rewrite patches/ from the carry/<version> branch",
        _per_target(lambda p, t, a: export(p, t, a.force)),
    ),
    "build": ("build the patched wheel / sdist into dist/", lambda p, t, _: build_all(p, t)),
    "verify": (
        "run each patch's tests without it (must fail) and with it (must pass)",
        lambda p, t, a: verify(p, t, a.python),
    ),
    "status": (
        "show pins, downloads, checkouts, branches and series; exit 1 if a line needs work",
        lambda p, t, a: status(p, t, a.json),
    ),
}
# Without --upstream, status looks at every pinned line; the others at each package's newest
# line that has a series.
EVERY_LINE_COMMANDS = frozenset({"status"})
SIGPIPE_EXIT = 141


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
            help=(
                "upstream version line (default: every pinned line)"
                if name in EVERY_LINE_COMMANDS
                else "upstream version line (default: the newest pinned line that has a series)"
            ),
        )
        if name == "export":
            sub.add_argument(
                "--force",
                action="store_true",
                help="write the branch even where patches/ was edited by hand or would lose patches",
            )
        if name == "status":
            sub.add_argument("--json", action="store_true", help="print the state as JSON (for CI)")
        if name == "verify":
            sub.add_argument(
                "--python",
                default=None,
                help="interpreter with the test environment (default: the line's own, see ci/test-envs.toml)",
            )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        project = Project(args.root.resolve()) if args.root else Project.find(Path.cwd())
        every_line = args.command in EVERY_LINE_COMMANDS
        targets = select_targets(project, args.packages, args.upstream, every_line)
        code = COMMANDS[args.command][1](project, targets, args)
        # Flushed here, not at exit, so a closed pipe is reported below and not as a traceback.
        sys.stdout.flush()
        return code
    except CarryError as exc:
        print(f"carry {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:
        _silence_stdout()
        print(
            f"carry {args.command}: error: stdout was closed before the output ended (a pager or "
            "`head` quit early): run it without the pipe to see all of it",
            file=sys.stderr,
        )
        return SIGPIPE_EXIT
    except OSError as exc:
        print(f"carry {args.command}: error: {describe_os_error(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"carry {args.command}: interrupted", file=sys.stderr)
        return 130


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's own flush at exit cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


if __name__ == "__main__":
    sys.exit(main())
