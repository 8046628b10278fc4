"""ci/nightly.py end to end, offline: every command answered by a fake runner, PyPI by a fake."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from script_module import load_script

from sglang_carry.build import BuildResult, BuiltArtifact
from sglang_carry.errors import CarryError
from sglang_carry.progress import Reporter
from sglang_carry.runner import Completed

ROOT = Path(__file__).resolve().parents[2]
SUMMARY_SCHEMA = ROOT / "ci" / "schemas" / "nightly-summary.schema.json"
nightly = load_script("carry_nightly", ROOT / "ci" / "nightly.py")

CP311 = "cp311-cp311-manylinux_2_34_x86_64.whl"
STATUS = {
    "ok": True,
    "lines": [
        {"name": "kvcached", "version": "0.1.6", "series": {"state": "recorded"}},
        {"name": "sglang", "version": "0.5.20", "series": {"state": "recorded"}},
        {"name": "sglang", "version": "0.5.21", "series": {"state": "recorded"}, "test_env": "t521"},
        {"name": "sglang", "version": "0.5.22", "series": {"state": "none"}},  # pinned, not ported
    ],
}


def simple_index(*versions: str, yanked: Sequence[str] = ()) -> bytes:
    """A PEP 691 JSON page of sglang's files, as the index answers it."""

    def entry(filename: str, **more: Any) -> dict[str, Any]:
        digest = hashlib.sha256(filename.encode()).hexdigest()
        return {"filename": filename, "url": f"../../files/{filename}", "hashes": {"sha256": digest}, **more}

    files = [entry(f"sglang-{v}-cp311-cp311-manylinux_2_34_x86_64.whl") for v in versions]
    files += [entry(f"sglang-{v}.tar.gz", yanked="broken") for v in yanked]
    return json.dumps({"meta": {"api-version": "1.1"}, "name": "sglang", "files": files}).encode()


TEST_ENVS = """\
default = "torch2.13"
[envs."torch2.13"]
lock = "ci/requirements-test.lock"
venv = ".venv-test"
[envs.t521]
lock = "ci/test-envs/t521.lock"
venv = ".venv-test-t521"
"""


class FakeProject:
    """Answers the commands the nightly runs; `fail` maps a step (a word of its command line,
    e.g. 'verify') to (exit code, stderr)."""

    def __init__(self, root: Path, gpu: bool = False, rebase: bool = True) -> None:
        self.root = root
        table = root / "ci" / "test-envs.toml"
        if not table.exists():  # a temporary project; never this checkout's own table
            table.parent.mkdir(exist_ok=True)
            table.write_text(TEST_ENVS)
        self.gpu = gpu
        self.rebase = rebase
        self.fail: dict[str, tuple[int, str]] = {}
        self.status: dict[str, Any] = STATUS
        self.calls: list[tuple[list[str], dict[str, str]]] = []
        self.built: list[tuple[str, str]] = []

    def __call__(
        self,
        args: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        capture: bool = True,
    ) -> Completed:
        argv = list(args)
        self.calls.append((argv, dict(env or {})))
        tool = Path(argv[0]).name
        words = set(argv)
        for word, (code, stderr) in self.fail.items():
            if word in words:
                return Completed(tuple(argv), code, "", stderr)
        if tool == "nvidia-smi":
            if not self.gpu:
                raise FileNotFoundError("nvidia-smi")
            return Completed(tuple(argv), 0, "GPU 0: NVIDIA H200 (UUID: GPU-x)\n", "")
        if tool == "carry" and argv[1] == "rebase" and not self.rebase:
            return Completed(tuple(argv), 2, "", "carry: error: invalid choice: 'rebase'")
        return Completed(tuple(argv), 0, "ok\n", "")

    def status_record(self) -> dict[str, Any]:
        return self.status

    def build(self, name: str, version: str, report: Reporter) -> BuildResult:
        """What the library's build returns: for sglang one wheel per Python, the cp311 one for
        this interpreter."""
        self.built.append((name, version))
        if "build" in self.fail:
            raise CarryError(self.fail["build"][1])
        report.step(f"build: {name} {version}: done")
        tags = ["tar.gz"] if name == "kvcached" else ["cp312-cp312-manylinux_2_34_x86_64.whl", CP311]
        artifacts = []
        for tag in tags:
            path = self.root / "dist" / f"{name}-{version}+carry.1-{tag}"
            path.parent.mkdir(exist_ok=True)
            here = "cp312" not in tag
            content = f"{name} {version}" + ("" if here else f" {tag}")
            path.write_bytes(content.encode())
            sha = hashlib.sha256(content.encode()).hexdigest()
            artifacts.append(BuiltArtifact(name, version, path, tag, here, sha, 0.1))
        return BuildResult(tuple(artifacts))

    def commands(self, word: str) -> list[list[str]]:
        """The calls with ``word`` among their arguments, or as the name of the program or of
        the script it runs (`python3 .../test_env.py NAME`)."""
        return [
            argv for argv, _ in self.calls if word in argv or any(Path(arg).name == word for arg in argv[:2])
        ]


@pytest.fixture(autouse=True)
def _no_index_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CARRY_INDEX_URL", raising=False)


def run(
    tmp_path: Path, project: FakeProject, index: bytes, **options: Any
) -> tuple[int, dict[str, Any], str]:
    out = tmp_path / "out"
    fetched: list[str] = []

    def fetch(url: str) -> bytes:
        fetched.append(url)
        return index

    clock = iter(range(0, 10_000, 2))
    runner = nightly.Nightly(
        project.root,
        nightly.Options(out=out, **options),
        runner=project,
        fetch=fetch,
        clock=lambda: next(clock),
        tool=project,
    )
    code = runner.run()
    if not options.get("no_canary"):
        assert fetched == ["https://pypi.org/simple/sglang/"]
    summary = json.loads((out / "summary.json").read_text())
    jsonschema.validate(summary, json.loads(SUMMARY_SCHEMA.read_text()))
    return code, summary, (out / "summary.md").read_text()


def test_no_gpu_runs_every_maintained_line_green(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    code, summary, markdown = run(tmp_path, project, simple_index("0.5.20", "0.5.21"), no_gpu=True)

    assert code == 0, markdown
    assert list(summary["lines"]) == ["project", "kvcached 0.1.6", "sglang 0.5.20", "sglang 0.5.21"]
    line = summary["lines"]["sglang 0.5.20"]
    assert {s: r["status"] for s, r in line.items()} == {
        "build": "pass",
        "verify": "pass",
        "cpu-tests": "pass",
        "e2e-cpu": "pass",
        "gpu-tests": "skipped",
        "e2e": "skipped",
        "bench": "skipped",
    }
    assert line["gpu-tests"]["reason"] == "--no-gpu" and line["bench"]["reason"] == "--no-gpu"
    assert summary["lines"]["kvcached 0.1.6"]["gpu-tests"]["reason"] == "no GPU tests for kvcached"
    assert summary["lines"]["kvcached 0.1.6"]["e2e-cpu"]["reason"] == "no end-to-end test for kvcached"
    # Without a GPU too, every sglang line gets a real server on CPU, in its own test environment.
    e2e_cpu = project.commands("--device")
    assert [argv[argv.index("--upstream") + 1] for argv in e2e_cpu] == ["0.5.20", "0.5.21"]
    assert all(argv[1].endswith("ci/e2e/run_e2e.py") and argv[2:4] == ["--device", "cpu"] for argv in e2e_cpu)
    # Every run the line has, also those ./scripts/test's default run leaves out (gdn-*).
    assert all(argv[argv.index("--runs") + 1] == "all" for argv in e2e_cpu)
    # ... and neither they nor the upstream tests once more inside the project row's ./scripts/test,
    # which names no test folder (its pytest options also reach every line's run).
    [(project_argv, project_env)] = [
        (argv, env) for argv, env in project.calls if Path(argv[0]).name == "test"
    ]
    assert project_argv[1:] == ["-q"]
    assert project_env == {"CARRY_TEST_LINES": "0", "CARRY_TEST_E2E": "0"}
    # Each line's upstream tests run the two-rank simulation over the nightly's seeds.
    upstream_tests = [env for argv, env in project.calls if "tests/upstream/sglang" in argv]
    assert upstream_tests == [{"CARRY_SIM_SEEDS": "0-1999"}] * 2
    wheel = summary["wheels"]["sglang 0.5.20"]
    assert wheel["sha256"] == hashlib.sha256(b"sglang 0.5.20").hexdigest()
    assert (tmp_path / "out" / "wheels" / wheel["file"]).is_file()
    # The night's wheels as a simple index, published with them.
    page = (tmp_path / "out" / "simple" / "sglang" / "index.html").read_text()
    assert f"{wheel['file']}#sha256={wheel['sha256']}" in page
    # Every pinned file of the line is built and published, beside the one for this interpreter.
    assert project.built == [("kvcached", "0.1.6"), ("sglang", "0.5.20"), ("sglang", "0.5.21")]
    cp312 = "sglang-0.5.20+carry.1-cp312-cp312-manylinux_2_34_x86_64.whl"
    assert (tmp_path / "out" / "wheels" / cp312).is_file() and cp312 in page
    assert wheel["file"] == "sglang-0.5.20+carry.1-cp311-cp311-manylinux_2_34_x86_64.whl"
    assert len(summary["artifacts"]) == 5 and f"| {cp312} |" in markdown
    assert line["build"]["seconds"] == 2 and (tmp_path / "out" / line["verify"]["log"]).is_file()
    # Every line is built and verified with its own --upstream; nvidia-smi is not even asked.
    # ... in the line's own test environment, built before verify where it is missing (verify
    # refuses an unbuilt one).
    verify = project.commands("verify")[-1]
    assert verify[verify.index("--upstream") + 1] == "0.5.21"
    assert verify[verify.index("--python") + 1] == str(tmp_path / ".venv-test-t521" / "bin" / "python")
    [(verify_at, _)] = [(i, argv) for i, (argv, _) in enumerate(project.calls) if argv is verify]
    built_at = [i for i, (argv, _) in enumerate(project.calls) if argv[-1] == "t521"]
    assert built_at[0] < verify_at
    assert project.commands("nvidia-smi") == []
    # Each line's CPU tests run after applying that line, in its own test environment, which is
    # built first where it is missing.
    pytest_runs = [argv for argv in project.commands("pytest") if argv[-1] == "tests/upstream/sglang"]
    assert [Path(argv[0]).parts[-3] for argv in pytest_runs] == [".venv-test", ".venv-test-t521"]
    builds = [argv[-1] for argv in project.commands("test_env.py")]
    # kvcached 0.1.6 (verify, cpu-tests), sglang 0.5.20 (verify, cpu-tests, e2e-cpu), 0.5.21 (the
    # same): the fake never has one
    assert builds == ["torch2.13"] * 5 + ["t521"] * 3
    assert summary["canary"]["status"] == "skipped"
    assert "not newer" in summary["canary"]["reason"]
    assert (
        "| sglang 0.5.20 | pass (2 s) | pass (2 s) | pass (2 s) | pass (2 s) | skipped: --no-gpu |"
        in markdown
    )


def test_line_test_environment_is_used_when_built(tmp_path: Path) -> None:
    python = tmp_path / ".venv-test-t521" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.touch()
    project = FakeProject(tmp_path)
    run(tmp_path, project, simple_index("0.5.21"), no_gpu=True)
    runs = [argv[0] for argv in project.commands("pytest") if argv[-1] == "tests/upstream/sglang"]
    assert runs == [str(tmp_path / ".venv-test" / "bin" / "python"), str(python)]
    assert "t521" not in [argv[-1] for argv in project.commands("test_env.py")]


def test_a_line_naming_an_unknown_test_environment_fails_its_cpu_tests(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    lines = [dict(line) for line in project.status["lines"]]
    lines[2]["test_env"] = "torch9"
    project.status = {**STATUS, "lines": lines}
    code, summary, _ = run(tmp_path, project, simple_index("0.5.21"), no_gpu=True)
    assert code == 1
    assert summary["lines"]["sglang 0.5.21"]["cpu-tests"] == {
        "status": "fail",
        "reason": "sglang 0.5.21 names test_env 'torch9', which ci/test-envs.toml does not define",
        "seconds": 0.0,
        "log": "",
        "details": {},
    }
    assert summary["lines"]["sglang 0.5.20"]["cpu-tests"]["status"] == "pass"


def test_canary_fails_loudly_naming_the_patch(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    project.fail["--check"] = (1, "carry rebase: error: 0002-Scheduler-wait.patch does not apply onto 0.5.24")
    index = simple_index("0.5.20", "0.5.24", "0.6.0rc1", yanked=["0.7.0"])
    code, summary, markdown = run(tmp_path, project, index, no_gpu=True)

    assert code == 1
    [check] = project.commands("--check")
    assert check[1:] == ["rebase", "--check", "0.5.24", "sglang", "--upstream", "0.5.21"]
    canary = summary["canary"]
    assert canary["status"] == "fail" and canary["newest_release"] == "0.5.24"
    assert "0002-Scheduler-wait.patch" in canary["reason"]
    assert "**Canary: FAIL**" in markdown and "0002-Scheduler-wait.patch" in markdown


def test_canary_passes_when_the_series_carries(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    code, summary, _ = run(tmp_path, project, simple_index("0.5.24"), no_gpu=True)
    assert code == 0
    assert summary["canary"]["status"] == "pass"
    assert summary["canary"]["reason"] == "the series of 0.5.21 carries onto sglang 0.5.24"


def test_canary_skipped_while_carry_has_no_rebase(tmp_path: Path) -> None:
    project = FakeProject(tmp_path, rebase=False)
    code, summary, _ = run(tmp_path, project, simple_index("0.5.24"), no_gpu=True)
    assert code == 0
    assert summary["canary"] == {
        "newest_release": "0.5.24",
        "newest_line": "0.5.21",
        "status": "skipped",
        "reason": "this carry has no `rebase` command",
    }


def test_registry_failure_is_reported_not_raised(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)

    def fetch(url: str) -> bytes:
        raise CarryError(f"cannot read {url} (network is unreachable): check the network")

    runner = nightly.Nightly(
        tmp_path, nightly.Options(out=tmp_path / "out", no_gpu=True), project, fetch, tool=project
    )
    assert runner.run() == 1
    assert runner.canary == {
        "status": "fail",
        "reason": "the package index query failed: cannot read https://pypi.org/simple/sglang/ "
        "(network is unreachable): check the network",
    }


def test_a_failing_step_fails_the_night_with_its_last_line(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    project.fail["verify"] = (1, "verify: 0001-x.patch: test passes without the patch\n")
    code, summary, _ = run(tmp_path, project, simple_index("0.5.20"), no_gpu=True)
    assert code == 1
    verdict = summary["lines"]["sglang 0.5.20"]["verify"]
    assert verdict["status"] == "fail"
    assert verdict["reason"] == "exit 1: verify: 0001-x.patch: test passes without the patch"
    assert summary["lines"]["sglang 0.5.20"]["cpu-tests"]["status"] == "pass"  # the night goes on


def test_with_a_gpu_the_gpu_tests_are_required_and_the_e2e_and_the_bench_run_on_the_built_wheel(
    tmp_path: Path,
) -> None:
    project = FakeProject(tmp_path, gpu=True)
    code, summary, _ = run(tmp_path, project, simple_index("0.5.20"), gpu_python="/opt/gpu/bin/python")
    assert code == 0
    gpu_runs = [(argv, env) for argv, env in project.calls if argv[-1] == "tests/gpu"]
    assert len(gpu_runs) == 2  # one per sglang line
    argv, env = gpu_runs[0]
    assert argv[0] == "/opt/gpu/bin/python"
    assert env["CARRY_REQUIRE_GPU"] == "1"
    assert env["CARRY_GPU_RESULTS"] == str(tmp_path / "out" / "gpu" / "0.5.20.json")
    [e2e, bench, _, _] = [argv for argv in project.commands("--wheel")]
    assert e2e[1] == str(ROOT / "ci" / "e2e" / "run_e2e.py") or e2e[1].endswith("ci/e2e/run_e2e.py")
    assert Path(e2e[e2e.index("--wheel") + 1]).parent == tmp_path / "out" / "wheels"
    # The series' cost to a real server on the GPU, on the same wheel, its wall clock judged (the
    # bench's default on a GPU), the servers run by the line's GPU interpreter.
    assert bench[0] == "/opt/gpu/bin/python" and bench[1].endswith("ci/bench/server.py")
    assert bench[2:4] == ["--device", "cuda"]
    assert bench[bench.index("--wheel") + 1] == e2e[e2e.index("--wheel") + 1]
    assert bench[bench.index("--python") + 1] == "/opt/gpu/bin/python" and "--judge" not in bench
    assert bench[bench.index("--cases") + 1] == "tp1,tp2,tp2-plain,tp2-control"
    assert bench[bench.index("--out") + 1] == str(tmp_path / "out" / "bench" / "0.5.20")
    assert summary["lines"]["sglang 0.5.20"]["bench"]["status"] == "pass"
    assert summary["gpu"] == "present"
    assert summary["lines"]["kvcached 0.1.6"]["e2e"]["status"] == "skipped"
    assert summary["lines"]["kvcached 0.1.6"]["bench"]["reason"] == "no benchmark for kvcached"


def test_without_a_gpu_the_reason_is_nvidia_smi(tmp_path: Path) -> None:
    project = FakeProject(tmp_path, gpu=False)
    _, summary, _ = run(tmp_path, project, simple_index("0.5.20"))
    assert (
        summary["lines"]["sglang 0.5.20"]["gpu-tests"]["reason"]
        == "no CUDA device: nvidia-smi is not installed"
    )


@pytest.mark.parametrize(
    ("versions", "newest"),
    [(("0.5.20", "0.5.9", "0.5.21.post1"), "0.5.21.post1"), (("1.0.0rc2", "0.5.20"), "0.5.20"), ((), None)],
)
def test_newest_release(versions: tuple[str, ...], newest: str | None) -> None:
    assert nightly.newest_release("sglang", lambda url: simple_index(*versions)) == newest


def test_newest_release_reads_the_index_carry_rebase_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CARRY_INDEX_URL", "file:///srv/mirror/simple/")
    fetched: list[str] = []

    def fetch(url: str) -> bytes:
        fetched.append(url)
        return simple_index("0.5.24")

    assert nightly.newest_release("sglang", fetch) == "0.5.24"
    assert fetched == ["file:///srv/mirror/simple/sglang/"]


def test_canary_only_runs_no_line(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    code, summary, _ = run(tmp_path, project, simple_index("0.5.24"), canary_only=True)
    assert code == 0
    assert summary["lines"] == {}
    assert summary["canary"]["status"] == "pass"
    assert project.built == [] and project.commands("nvidia-smi") == []


def test_gpu_python_per_line(tmp_path: Path) -> None:
    project = FakeProject(tmp_path, gpu=True)
    run(
        tmp_path,
        project,
        simple_index("0.5.20"),
        no_canary=True,
        gpu_python="/venvs/gpu-{version}/bin/python",
    )
    assert [argv[0] for argv in project.commands("tests/gpu")] == [
        "/venvs/gpu-0.5.20/bin/python",
        "/venvs/gpu-0.5.21/bin/python",
    ]


def test_list_lines(capsys: pytest.CaptureFixture[str]) -> None:
    fake = FakeProject(ROOT)
    assert nightly.main(["--list-lines"], runner=fake, tool=fake) == 0
    assert json.loads(capsys.readouterr().out) == [
        {"package": "kvcached", "version": "0.1.6"},
        {"package": "sglang", "version": "0.5.20"},
        {"package": "sglang", "version": "0.5.21"},
    ]


def test_lines_option_runs_one_line_but_the_canary_sees_all(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    _, summary, _ = run(tmp_path, project, simple_index("0.5.24"), no_gpu=True, only_versions=("0.5.20",))
    assert list(summary["lines"]) == ["project", "sglang 0.5.20"]
    assert summary["canary"]["newest_line"] == "0.5.21"


def test_a_build_the_library_refuses_fails_its_step_and_the_night_goes_on(tmp_path: Path) -> None:
    project = FakeProject(tmp_path)
    project.fail["build"] = (1, "upstream/sglang has uncommitted changes (python/x.py): commit them")
    code, summary, _ = run(tmp_path, project, simple_index("0.5.21"), no_gpu=True)
    assert code == 1
    build = summary["lines"]["sglang 0.5.20"]["build"]
    assert build["status"] == "fail" and build["reason"].startswith("upstream/sglang has uncommitted changes")
    assert "upstream/sglang has uncommitted changes" in (tmp_path / "out" / build["log"]).read_text()
    assert summary["lines"]["sglang 0.5.20"]["verify"]["status"] == "pass"
    assert summary["wheels"] == {} and summary["artifacts"] == []


def test_the_library_reads_this_checkouts_status_as_its_schema_writes_it() -> None:
    record = nightly.Library(ROOT).status_record()
    jsonschema.validate(record, json.loads((ROOT / "ci" / "schemas" / "status.schema.json").read_text()))
    assert {line["name"] for line in record["lines"]} == {"sglang", "kvcached"}


def test_a_build_with_no_artifact_for_this_interpreter_fails_its_step(tmp_path: Path) -> None:
    """The e2e installs the host's artifact: a build that made none must not pass."""
    project = FakeProject(tmp_path)
    real_build = project.build

    def only_other_platforms(name: str, version: str, report: Reporter) -> BuildResult:
        built = real_build(name, version, report)
        return BuildResult(tuple(a for a in built.artifacts if not a.for_this_interpreter))

    project.build = only_other_platforms  # type: ignore[method-assign]
    code, summary, _ = run(tmp_path, project, simple_index("0.5.21"), no_gpu=True)
    assert code == 1
    build = summary["lines"]["sglang 0.5.20"]["build"]
    assert (build["status"], build["reason"]) == ("fail", "the build made no artifact for this interpreter")
    assert "sglang 0.5.20" not in summary["wheels"]
