"""`carry`: parse the command line and dispatch; every command returns an exit code."""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TextIO

from . import __version__
from .build import build_all
from .checkout_lock import Holder, writing
from .cli_render import ConsoleReporter, as_json, problem, text_lines
from .errors import CarryError
from .fetch import fetch
from .files import describe_os_error, naming
from .patching import apply, export
from .progress import SILENT, Reporter
from .project import Project, Target, select_targets
from .rebase import Request, rebase, rebase_abort, rebase_continue
from .registry import INDEX_ENV
from .results import CommandResult
from .simple_index import write_index
from .status import status
from .verify import verify

Results = list[CommandResult]
Command = Callable[[Project, list[Target], argparse.Namespace, Reporter], Results]


def _per_target(step: Callable[[Project, Target, argparse.Namespace], CommandResult]) -> Command:
    def run(project: Project, targets: list[Target], args: argparse.Namespace, _: Reporter) -> Results:
        return [step(project, target, args) for target in targets]

    return run


COMMANDS: dict[str, tuple[str, Command]] = {
    "fetch": (
        "download the pinned upstreams (hash-checked) and lay down pristine checkouts",
        lambda p, t, _, report: [fetch(p, t, report=report)],
    ),
    "apply": (
        "git am the series onto a fresh carry/<version> branch",
        _per_target(lambda p, t, _: apply(p, t)),
    ),
    "export": (
        "rewrite patches/ from the carry/<version> branch",
        _per_target(lambda p, t, a: export(p, t, a.force)),
    ),
    "build": (
        "build the patched wheel / sdist into dist/",
        lambda p, t, a, report: [build_all(p, t, all_platforms=a.all_platforms, report=report)],
    ),
    "verify": (
        "run each patch's tests without it (must fail) and with it (must pass)",
        lambda p, t, a, report: [verify(p, t, a.python, report=report)],
    ),
    "status": (
        "show pins, downloads, checkouts, branches and series; exit 1 if a line needs work",
        lambda p, t, _, report: [status(p, t, report=report)],
    ),
}
# Without --upstream, status looks at every pinned line; the others at each package's newest
# line that has a series.
EVERY_LINE_COMMANDS = frozenset({"status"})
# Commands that only read the checkout; every other one holds its lock (checkout_lock.py).
READ_ONLY_COMMANDS = frozenset({"status"})
NO_WAIT_HELP = "refuse, instead of waiting, when another carry command is working in this checkout"
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
        if name not in READ_ONLY_COMMANDS:
            sub.add_argument("--no-wait", action="store_true", help=NO_WAIT_HELP)
        if name == "export":
            sub.add_argument(
                "--force",
                action="store_true",
                help="write the branch even where patches/ was edited by hand or would lose patches",
            )
        _add_json(sub)
        if name == "build":
            sub.add_argument(
                "--all-platforms",
                action="store_true",
                help="build from every pinned file of the line (each Python and platform), downloading "
                "the pinned ones not here yet",
            )
        if name == "verify":
            sub.add_argument(
                "--python",
                default=None,
                help="interpreter with the test environment (default: the line's own, see ci/test-envs.toml)",
            )
    _add_rebase_parser(commands)
    summary = "write a PEP 503 simple index of dist/ into DIR, for pip install --extra-index-url"
    sub = commands.add_parser("index", help=summary, description=summary)
    sub.add_argument("folder", metavar="DIR", type=Path, help="the index folder (written as a whole)")
    sub.add_argument("--no-wait", action="store_true", help=NO_WAIT_HELP)
    _add_json(sub)
    return parser


def _add_json(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--json",
        action="store_true",
        help="print the result as JSON on stdout (progress goes to stderr; see ci/schemas/)",
    )


def _add_rebase_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    summary = "move a line's series onto a new upstream release (pin, replay, drop what upstream fixed)"
    sub = commands.add_parser("rebase", help=summary, description=summary)
    sub.add_argument("new", nargs="?", metavar="NEW_VERSION", help="the upstream release to rebase onto")
    sub.add_argument(
        "package", nargs="?", metavar="PACKAGE", help="upstream to rebase (default: sglang, or the only one)"
    )
    sub.add_argument(
        "--upstream",
        metavar="OLD",
        default=None,
        help="the line to rebase (default: the newest pinned line that has a series)",
    )
    sub.add_argument(
        "--keep", action="store_true", help="keep entries whose tests pass on the new pristine tree as diffs"
    )
    sub.add_argument(
        "--check",
        action="store_true",
        help="replay and test in a scratch copy, change nothing; exit 0 if each patch carries or is upstream",
    )
    sub.add_argument(
        "--continue", dest="resume", action="store_true", help="go on after resolving a conflict"
    )
    sub.add_argument("--abort", action="store_true", help="undo the rebase in progress entirely")
    sub.add_argument("--no-wait", action="store_true", help=NO_WAIT_HELP)
    _add_json(sub)
    sub.add_argument(
        "--python",
        default=None,
        help="interpreter with the test environment (default: each line's own, see ci/test-envs.toml)",
    )
    sub.add_argument(
        "--index-url",
        default=None,
        help=f"PEP 691 package index to pin from (default: ${INDEX_ENV} or https://pypi.org/simple)",
    )


def _rebase(project: Project, args: argparse.Namespace) -> CommandResult:
    report = _reporter(args)
    if args.resume or args.abort:
        if (args.resume and args.abort) or args.new or args.check:
            raise CarryError(
                "--continue and --abort take nothing else: `carry rebase --continue` or `--abort`"
            )
        return rebase_continue(project, report=report) if args.resume else rebase_abort(project)
    if not args.new:
        raise CarryError("name the release to rebase onto: `carry rebase NEW_VERSION [PACKAGE]`")
    request = Request(args.new, args.package, args.upstream, args.keep, args.python, args.index_url)
    return rebase(project, request, check=args.check, report=report)


def _reporter(args: argparse.Namespace) -> Reporter:
    if not args.json:
        return ConsoleReporter()
    # With --json, stdout is the result alone; status's per-line text is its result, not progress.
    return SILENT if args.command == "status" else ConsoleReporter(sys.stderr)


def _dispatch(project: Project, args: argparse.Namespace) -> Results:
    if args.command == "rebase":
        return [_rebase(project, args)]
    if args.command == "index":
        return [write_index(project.dist_dir, args.folder.resolve())]
    every_line = args.command in EVERY_LINE_COMMANDS
    targets = select_targets(project, args.packages, args.upstream, every_line)
    return COMMANDS[args.command][1](project, targets, args, _reporter(args))


def _render(project: Project, args: argparse.Namespace, results: Results) -> int:
    if args.json:
        print(as_json(results))
    else:
        for result in results:
            for line in text_lines(result, project.root):
                print(line)
    for result in results:
        wrong = problem(result)
        if wrong:
            print(f"carry {args.command}: error: {wrong}", file=sys.stderr)
    return max((result.exit_code for result in results), default=0)


def _checkout_lock(project: Project, args: argparse.Namespace) -> AbstractContextManager[None]:
    if args.command in READ_ONLY_COMMANDS:
        return nullcontext()

    def say_waiting(holder: Holder) -> None:
        print(
            f"carry {args.command}: {holder.describe()} is working in this checkout; waiting for it "
            "to finish (Ctrl-C stops; --no-wait refuses instead)",
            file=sys.stderr,
            flush=True,
        )

    return writing(project, args.command, not args.no_wait, say_waiting, ConsoleReporter())


class _NamedStdout:
    """sys.stdout whose write errors name it: a full device behind `> file` said "a file"."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        with naming(Path("stdout")):
            return self._stream.write(text)

    def flush(self) -> None:
        with naming(Path("stdout")):
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def main(argv: Sequence[str] | None = None) -> int:
    # A terminal or pipe that cannot show a character (PYTHONIOENCODING=latin-1) gets an escape,
    # not a UnicodeEncodeError in the middle of the output.
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    stdout = sys.stdout
    sys.stdout = _NamedStdout(stdout)
    try:
        return _main(argv)
    finally:
        sys.stdout = stdout


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        project = Project.find(args.root.resolve() if args.root else Path.cwd())
        with _checkout_lock(project, args):
            code = _render(project, args, _dispatch(project, args))
        # Flushed here, not at exit, so a closed pipe is reported below and not as a traceback.
        sys.stdout.flush()
        return code
    except CarryError as exc:
        if args.json:
            # A script reading stdout gets a document whatever happens; the line stays on stderr.
            print(json.dumps({"ok": False, "error": str(exc)}, ensure_ascii=False))
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
