"""The nightly: every maintained line built, proven on CPU and (where CUDA is present) on GPU,
and a canary that tries the series on the newest sglang release.

    ci/nightly [--no-gpu] [--out DIR] [--lines 0.5.20,...] [--no-canary]

Maintained lines are the lines the carry library's status reports with a series (or carrying
nothing on purpose), read in-process (`Library`, the same record as `carry status --json`). For
each, in order: build (through the library, with the checkout's lock held: fetch, apply, and build
from every pinned file of the line, as `carry build --all-platforms`; each artifact's sha256 comes
from the build's result, and the one for this interpreter is the one the e2e installs), verify
(`carry verify`), cpu-tests (`carry apply` of that line, then pytest on tests/upstream/NAME
against its tree), and for sglang e2e-cpu (ci/e2e/run_e2e.py --device cpu: a real server on CPU,
one rank and two) and, where a CUDA device is present, gpu-tests (tests/gpu with
CARRY_REQUIRE_GPU=1), e2e (ci/e2e/run_e2e.py) and bench (ci/bench/server.py --device cuda: the
series' cost to a real server, judged by the wall clock, which a GPU runner is quiet enough for).
A "project" row runs ruff, zizmor, actionlint,
mypy and the tool's tests once (CARRY_TEST_LINES=0 CARRY_TEST_E2E=0 ./scripts/test). Then the
canary asks the index `carry rebase` reads (PyPI, or $CARRY_INDEX_URL) for the newest sglang
release and, when it is newer than the newest sglang line, runs `carry rebase --check NEWEST
sglang`, which names the first patch that stops applying.
Each line's CPU tests run in its own test environment (ci/test-envs.toml), built first where it is
missing.

Everything lands in one folder (default build/nightly/<UTC timestamp>/): summary.md and
summary.json (line x step -> pass/fail/skipped with the reason, durations, every artifact's
sha256; ci/schemas/nightly-summary.schema.json), logs/
(one log per step), wheels/ (the built wheels and sdists), simple/ (them as a PEP 503 index),
gpu/, e2e/, e2e-cpu/ and bench/ results.
Exit 0 when nothing failed (skips are not failures), 1 otherwise.

Every command goes through an injectable Runner, the registry through an injectable fetcher and the
library through an injectable Tool, so tests/ci/test_nightly.py runs the whole flow offline with
fakes.
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from packaging.version import Version  # noqa: E402

from sglang_carry.build import BuildResult, build_all  # noqa: E402
from sglang_carry.checkout_lock import writing  # noqa: E402
from sglang_carry.errors import CarryError  # noqa: E402
from sglang_carry.fetch import fetch as fetch_pinned  # noqa: E402
from sglang_carry.patching import apply  # noqa: E402
from sglang_carry.progress import Recorder, Reporter  # noqa: E402
from sglang_carry.project import Project, select_targets  # noqa: E402
from sglang_carry.registry import Fetcher, fetch_url, index_files, index_url, newest_version  # noqa: E402
from sglang_carry.runner import Completed, Runner, run_subprocess  # noqa: E402
from sglang_carry.simple_index import write_index  # noqa: E402
from sglang_carry.status import MAINTAINED, SeriesState, status  # noqa: E402
from sglang_carry.tables import markdown_table  # noqa: E402
from sglang_carry.testenv import test_envs  # noqa: E402

STEPS = ("build", "verify", "cpu-tests", "e2e-cpu", "gpu-tests", "e2e", "bench")
# The bench's cases on a GPU: the judged ones (its natural-miss recovery has no target).
BENCH_CASES = "tp1,tp2,tp2-plain,tp2-control"
# The seeds of the multi-rank simulation (tests/upstream/sglang/test_simulation.py) each night;
# ./scripts/test runs its default, 0-199.
NIGHTLY_SIMULATION_SEEDS = "0-1999"
NIGHTLY_SIMULATION_ENV = {"CARRY_SIM_SEEDS": NIGHTLY_SIMULATION_SEEDS}


class StepStatus(enum.StrEnum):
    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"


PASS, FAIL, SKIPPED = StepStatus.PASS, StepStatus.FAIL, StepStatus.SKIPPED


@dataclass
class StepResult:
    status: StepStatus
    reason: str = ""
    seconds: float = 0.0
    log: str = ""  # path relative to the output folder
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Line:
    name: str
    version: str
    test_env: str | None = None

    @property
    def key(self) -> str:
        return f"{self.name} {self.version}"


@dataclass
class Options:
    out: Path
    no_gpu: bool = False
    no_canary: bool = False
    only_versions: tuple[str, ...] = ()
    # The interpreter for tests/gpu and the e2e test; "{version}" is replaced by the line's.
    gpu_python: str = ".venv-gpu/bin/python"
    canary_only: bool = False


def newest_release(project: str, fetch: Fetcher) -> str | None:
    """The newest final release on the index `carry rebase` reads ($CARRY_INDEX_URL, else PyPI):
    no pre-releases, nothing yanked."""
    newest = newest_version(project, index_files(project, index_url(None), fetch))
    return None if newest is None else str(newest)


class Tool(Protocol):
    """What the nightly asks the carry library, in-process (tests give a fake)."""

    def status_record(self) -> dict[str, Any]:
        """Every pinned line's state, as ci/schemas/status.schema.json writes it down."""

    def build(self, name: str, version: str, report: Reporter) -> BuildResult:
        """The line fetched, applied and built from every file it pins (`--all-platforms`)."""


class Library:
    """The carry library on this checkout: what `carry status` and `./scripts/build` do, with the
    checkout's lock held as any writing carry command holds it."""

    def __init__(self, root: Path) -> None:
        self.project = Project(root)

    def status_record(self) -> dict[str, Any]:
        return status(self.project, select_targets(self.project, [], None, every_line=True)).record()

    def build(self, name: str, version: str, report: Reporter) -> BuildResult:
        with writing(self.project, "build (the nightly)", wait=True, report=report):
            targets = select_targets(self.project, [name], version)
            fetch_pinned(self.project, targets, report=report)
            for target in targets:
                for line in apply(self.project, target).describe():
                    report.step(line)
            return build_all(self.project, targets, all_platforms=True, report=report)


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


class Nightly:
    def __init__(
        self,
        root: Path,
        options: Options,
        runner: Runner = run_subprocess,
        fetch: Fetcher = fetch_url,
        clock: Callable[[], float] = time.monotonic,
        tool: Tool | None = None,
    ) -> None:
        self.root = root
        self.tool = tool or Library(root)
        self.options = options
        self.run_command = runner
        self.fetch = fetch
        self.clock = clock
        self.out = options.out
        self.results: dict[str, dict[str, StepResult]] = {}
        self.wheels: dict[str, dict[str, str]] = {}
        # Every artifact of every line (--all-platforms), as published in wheels/ and simple/.
        self.artifacts: list[dict[str, str]] = []
        self.canary: dict[str, Any] = {}
        self.cuda: str | None = None  # why there is no usable CUDA device, or None
        self.lines: list[Line] = []

    # ---- running one step -------------------------------------------------------------------
    def _step(
        self,
        row: str,
        step: str,
        args: Sequence[str],
        env: Mapping[str, str] | None = None,
    ) -> tuple[StepResult, Completed]:
        log = Path("logs") / f"{row.replace(' ', '-')}-{step}.log"
        started = self.clock()
        done = self.run_command(list(args), cwd=self.root, env=env)
        seconds = self.clock() - started
        (self.out / log).write_text(
            f"$ {' '.join(args)}\n(exit {done.returncode}, {seconds:.1f} s)\n\n"
            f"--- stdout ---\n{done.stdout}\n--- stderr ---\n{done.stderr}"
        )
        if done.returncode == 0:
            result = StepResult(PASS, seconds=seconds, log=str(log))
        else:
            why = last_line(done.stderr) or last_line(done.stdout) or "no output"
            result = StepResult(FAIL, f"exit {done.returncode}: {why}", seconds, str(log))
        self.results.setdefault(row, {})[step] = result
        return result, done

    def _build(self, row: str, line: Line) -> None:
        """The build step, through the library: its progress is the step's log, its result the
        artifacts; a refusal (or any failure) fails the step with its one line."""
        log = Path("logs") / f"{row.replace(' ', '-')}-build.log"
        report = Recorder()
        started = self.clock()
        try:
            built: BuildResult | None = self.tool.build(line.name, line.version, report)
            why = ""
        except CarryError as error:
            built, why = None, str(error)
        except Exception as error:  # the build is I/O: report it, do not crash the summary
            built, why = None, f"{type(error).__name__}: {error}"
        seconds = self.clock() - started
        (self.out / log).write_text("\n".join([*report.steps, *report.warnings, why]).strip() + "\n")
        result = StepResult(PASS if built else FAIL, why, seconds, str(log))
        self.results.setdefault(row, {})["build"] = result
        if built is not None:
            self.keep_artifacts(row, line, result, built)

    def _skip(self, row: str, step: str, reason: str) -> None:
        self.results.setdefault(row, {})[step] = StepResult(SKIPPED, reason)

    # ---- the flow ---------------------------------------------------------------------------
    def maintained_lines(self) -> list[Line]:
        lines = []
        for record in self.tool.status_record()["lines"]:
            try:
                state = SeriesState(record["series"]["state"])
            except (KeyError, TypeError, ValueError) as error:
                raise SystemExit(
                    f"nightly: error: the status of a line cannot be read ({error!r}); see "
                    "ci/schemas/status.schema.json"
                ) from None
            if state in MAINTAINED:
                lines.append(Line(record["name"], record["version"], record.get("test_env")))
        return lines

    def detect_cuda(self) -> str | None:
        if self.options.no_gpu:
            return "--no-gpu"
        try:
            done = self.run_command(["nvidia-smi", "-L"], cwd=self.root)
        except FileNotFoundError:
            return "no CUDA device: nvidia-smi is not installed"
        if done.returncode != 0 or "GPU" not in done.stdout:
            return f"no CUDA device: nvidia-smi -L exit {done.returncode}"
        return None

    def test_python(self, line: Line) -> str:
        """The CPU test environment of a line (ci/test-envs.toml, as `carry verify` picks it),
        built here when it is missing (minutes, once; the workflow caches it) rather than testing
        the line against another release's pins. A CarryError when the line names no such
        environment."""
        default, envs = test_envs(Project(self.root))
        name = line.test_env or default
        if name not in envs:
            raise CarryError(f"{line.key} names test_env '{name}', which ci/test-envs.toml does not define")
        env = envs[name]
        if not env.python.exists():
            self.run_command(["python3", str(self.root / "scripts" / "test_env.py"), name], cwd=self.root)
        return str(env.python)

    def run(self) -> int:
        for folder in ("logs", "wheels", "gpu", "e2e", "e2e-cpu", "bench"):
            (self.out / folder).mkdir(parents=True, exist_ok=True)
        started = self.clock()
        carry = str(self.root / "scripts" / "carry")
        # The canary looks at every maintained line; --lines picks the ones run here.
        self.lines = self.maintained_lines()
        chosen = self.options.only_versions
        run_here = [line for line in self.lines if not chosen or line.version in chosen]
        if self.options.canary_only:
            self.cuda = "--canary-only"
        else:
            self.cuda = self.detect_cuda()
            # The upstream tests and the end-to-end test run per line (cpu-tests, e2e-cpu), not
            # once more here.
            self._step(
                "project",
                "cpu-tests",
                [str(self.root / "scripts" / "test"), "-q"],
                env={"CARRY_TEST_LINES": "0", "CARRY_TEST_E2E": "0"},
            )
            for line in run_here:
                self.run_line(line, carry)
            self.write_simple_index()
        if self.options.no_canary:
            self.canary = {"status": SKIPPED, "reason": "--no-canary"}
        else:
            self.run_canary(carry)
        self.write_summary(self.clock() - started)
        if self.canary.get("status") == FAIL and os.environ.get("GITHUB_ACTIONS") == "true":
            print(f"::error title=canary::{self.canary['reason']}")  # an annotation on the run
        failed = any(r.status == FAIL for steps in self.results.values() for r in steps.values())
        return 1 if failed or self.canary.get("status") == FAIL else 0

    def write_simple_index(self) -> None:
        """Tonight's wheels as a PEP 503 index (simple/ beside wheels/, published with them), so a
        team can `pip install --extra-index-url` the artifact."""
        if self.wheels:
            write_index(self.out / "wheels", self.out / "simple")

    def run_line(self, line: Line, carry: str) -> None:
        row, versioned = line.key, [line.name, "--upstream", line.version]
        # Every pinned file of the line (each Python and platform), as a team installs them.
        self._build(row, line)
        self.run_verify(row, line, [carry, "verify", *versioned])
        applied, _ = self._step(row, "apply", [carry, "apply", *versioned])
        self.results[row]["cpu-tests"] = self.results[row].pop("apply")
        if applied.status == PASS:
            self.run_cpu_tests(row, line)
        if line.name != "sglang":
            self._skip(row, "e2e-cpu", f"no end-to-end test for {line.name}")
            self._skip(row, "gpu-tests", f"no GPU tests for {line.name}")
            self._skip(row, "e2e", f"no end-to-end test for {line.name}")
            self._skip(row, "bench", f"no benchmark for {line.name}")
            return
        self.run_cpu_e2e(row, line)
        if self.cuda is not None:
            self._skip(row, "gpu-tests", self.cuda)
            self._skip(row, "e2e", self.cuda)
            self._skip(row, "bench", self.cuda)
            return
        python = self.options.gpu_python.replace("{version}", line.version)
        gpu_json = self.out / "gpu" / f"{line.version}.json"
        self._step(
            row,
            "gpu-tests",
            [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
            env={"CARRY_REQUIRE_GPU": "1", "CARRY_GPU_RESULTS": str(gpu_json)},
        )
        if row not in self.wheels:
            self._skip(row, "e2e", "no wheel was built")
            self._skip(row, "bench", "no wheel was built")
            return
        wheel = str(self.out / "wheels" / self.wheels[row]["file"])
        e2e = str(self.root / "ci" / "e2e" / "run_e2e.py")
        self._step(row, "e2e", [python, e2e, "--wheel", wheel, "--out", str(self.out / "e2e" / line.version)])
        bench = [python, str(self.root / "ci" / "bench" / "server.py"), "--device", "cuda", "--wheel", wheel]
        bench += ["--python", python, "--cases", BENCH_CASES, "--out", str(self.out / "bench" / line.version)]
        self._step(row, "bench", bench)

    def keep_artifacts(self, row: str, line: Line, build: StepResult, built: BuildResult) -> None:
        """The build's artifacts copied into wheels/; the one for this interpreter is the line's
        wheel, the one the e2e step installs."""
        here = built.here(line.name)
        if here is None:
            build.status, build.reason = FAIL, "the build made no artifact for this interpreter"
            return
        for artifact in built.artifacts:
            shutil.copy2(artifact.path, self.out / "wheels" / artifact.path.name)
            self.artifacts.append({"line": row, "file": artifact.path.name, "sha256": artifact.sha256})
        self.wheels[row] = {"file": here.path.name, "sha256": here.sha256}
        build.details = {**self.wheels[row], "artifacts": len(built.artifacts)}

    def _test_python_of_step(self, row: str, line: Line, step: str) -> str | None:
        """The line's test environment's interpreter (built if missing), or None with the step
        failed where the line names no such environment."""
        try:
            return self.test_python(line)
        except CarryError as error:
            self.results[row][step] = StepResult(FAIL, str(error))
            return None

    def _step_in_test_env(
        self, row: str, line: Line, step: str, args: Sequence[str], env: Mapping[str, str] | None = None
    ) -> None:
        """A step run by the line's own test environment's interpreter (built if missing)."""
        python = self._test_python_of_step(row, line, step)
        if python is not None:
            self._step(row, step, [python, *args], env=env)

    def run_verify(self, row: str, line: Line, verify: Sequence[str]) -> None:
        """`carry verify` in the line's test environment, built first where it is missing (verify
        refuses a line whose environment is not built: a night running one line on a fresh runner,
        as the workflow's jobs do, failed there)."""
        python = self._test_python_of_step(row, line, "verify")
        if python is not None:
            self._step(row, "verify", [*verify, "--python", python])

    def run_cpu_tests(self, row: str, line: Line) -> None:
        """The line's upstream tests, the multi-rank simulation over NIGHTLY_SIMULATION_SEEDS."""
        pytest = ["-m", "pytest", "-q", "-p", "no:cacheprovider", f"tests/upstream/{line.name}"]
        self._step_in_test_env(row, line, "cpu-tests", pytest, env=NIGHTLY_SIMULATION_ENV)

    def run_cpu_e2e(self, row: str, line: Line) -> None:
        """A real server on CPU, one rank and two (ci/e2e/run_e2e.py --device cpu), every run the line
        has (`--runs all`: also those ./scripts/test's default run leaves to the nightly)."""
        e2e = [str(self.root / "ci" / "e2e" / "run_e2e.py"), "--device", "cpu", "--upstream", line.version]
        e2e += ["--runs", "all"]
        self._step_in_test_env(
            row, line, "e2e-cpu", [*e2e, "--out", str(self.out / "e2e-cpu" / line.version)]
        )

    def run_canary(self, carry: str) -> None:
        versions = [Version(line.version) for line in self.lines if line.name == "sglang"]
        newest_line = str(max(versions)) if versions else None
        try:
            newest = newest_release("sglang", self.fetch)
        except Exception as error:  # the registry is I/O: report it, do not crash the summary
            self.canary = {"status": FAIL, "reason": f"the package index query failed: {error}"}
            return
        self.canary = {"newest_release": newest, "newest_line": newest_line}
        if newest is None or newest_line is None:
            self.canary.update(status=SKIPPED, reason="no sglang release or no maintained sglang line")
            return
        if Version(newest) <= Version(newest_line):
            self.canary.update(
                status=SKIPPED, reason=f"sglang {newest} is not newer than the line {newest_line}"
            )
            return
        probe = self.run_command([carry, "rebase", "--help"], cwd=self.root)
        if probe.returncode != 0:
            self.canary.update(status=SKIPPED, reason="this carry has no `rebase` command")
            return
        result, done = self._step(
            "canary",
            "rebase-check",
            [carry, "rebase", "--check", newest, "sglang", "--upstream", newest_line],
        )
        del self.results["canary"]
        self.canary.update(status=result.status, seconds=result.seconds, log=result.log)
        if result.status == FAIL:
            self.canary["reason"] = (
                f"the series of {newest_line} does not carry onto sglang {newest}: "
                f"{last_line(done.stderr) or last_line(done.stdout)}"
            )
        else:
            self.canary["reason"] = f"the series of {newest_line} carries onto sglang {newest}"

    # ---- the summary ------------------------------------------------------------------------
    def write_summary(self, seconds: float) -> None:
        summary = {
            "seconds": round(seconds, 1),
            "gpu": self.cuda or "present",
            "lines": {row: {s: asdict(r) for s, r in steps.items()} for row, steps in self.results.items()},
            "wheels": self.wheels,
            "artifacts": self.artifacts,
            "canary": self.canary,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (self.out / "summary.md").write_text(self.markdown(seconds))

    def markdown(self, seconds: float) -> str:
        def cell(result: StepResult | None) -> str:
            if result is None:
                return ""
            text = str(result.status)
            if result.status != SKIPPED:
                text += f" ({result.seconds:.0f} s)"
            if result.reason:
                text += f": {result.reason}"
            return text

        out = [
            f"# Nightly ({seconds:.0f} s; GPU: {self.cuda or 'present'})",
            "",
            *markdown_table(
                ("line", *STEPS),
                [(row, *(cell(steps.get(step)) for step in STEPS)) for row, steps in self.results.items()],
            ),
            "",
            *markdown_table(
                ("artifact", "sha256"), [(a["file"], f"`{a['sha256']}`") for a in self.artifacts]
            ),
        ]
        if (self.out / "simple" / "index.html").exists():
            out += [
                "",
                "The wheels as a PEP 503 index: `simple/` (`pip install --no-deps --extra-index-url file://<it>`).",
            ]
        canary = self.canary
        out += ["", f"**Canary: {canary.get('status', '?').upper()}** — {canary.get('reason', '')}", ""]
        return "\n".join(out)


def main(
    argv: Sequence[str] | None = None,
    runner: Runner = run_subprocess,
    fetch: Fetcher = fetch_url,
    tool: Tool | None = None,
) -> int:
    parser = argparse.ArgumentParser(prog="ci/nightly", description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-gpu", action="store_true", help="skip the GPU tests and the e2e test")
    parser.add_argument("--no-canary", action="store_true", help="do not look for a newer sglang")
    parser.add_argument("--out", type=Path, help="output folder (default build/nightly/<UTC timestamp>)")
    parser.add_argument("--lines", default="", help="only these versions, comma-separated")
    parser.add_argument("--canary-only", action="store_true", help="only the canary (no line is run)")
    parser.add_argument(
        "--list-lines", action="store_true", help="print the maintained lines as a JSON list and exit"
    )
    parser.add_argument(
        "--gpu-python",
        default=os.environ.get("CARRY_GPU_PYTHON", str(ROOT / ".venv-gpu" / "bin" / "python")),
        help="interpreter with CUDA torch and the line's sglang requirements (tests/gpu, e2e);"
        " {version} is replaced by the line's version",
    )
    args = parser.parse_args(argv)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    options = Options(
        out=(args.out or ROOT / "build" / "nightly" / stamp).resolve(),
        no_gpu=args.no_gpu,
        no_canary=args.no_canary,
        only_versions=tuple(v for v in args.lines.split(",") if v),
        gpu_python=args.gpu_python,
        canary_only=args.canary_only,
    )
    nightly = Nightly(ROOT, options, runner, fetch, tool=tool)
    if args.list_lines:
        lines = nightly.maintained_lines()
        print(json.dumps([{"package": line.name, "version": line.version} for line in lines]))
        return 0
    code = nightly.run()
    print((options.out / "summary.md").read_text())
    print(f"nightly: summary and artifacts in {options.out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
