"""Each line's test environment and CI schedule, from its pin and ci/test-envs.toml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sglang_carry import testenv
from sglang_carry.errors import CarryError
from sglang_carry.pins import load_upstream
from sglang_carry.testenv import EVERY, NIGHTLY, ci_runs, ci_schedule, env_for
from sglang_carry.verify import verify

from .conftest import DemoProject

ENV_TABLE = """\
default = "old-torch"

[envs."old-torch"]
lock = "ci/old.lock"
venv = ".venv-test"

[envs."new-torch"]
lock = "ci/new.lock"
venv = ".venv-test-new"
"""


def with_envs(demo: DemoProject, *built: str) -> None:
    (demo.root / "ci").mkdir()
    (demo.root / "ci" / "test-envs.toml").write_text(ENV_TABLE)
    for venv in built:
        python = demo.root / venv / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.symlink_to(sys.executable)


def add_keys(demo: DemoProject, version: str, keys: str) -> None:
    pin = demo.root / "upstream" / "demo.toml"
    text = pin.read_text()
    header = f'version = "{version}"\n'
    pin.write_text(text.replace(header, header + keys))


def series_for(demo: DemoProject, version: str) -> None:
    folder = demo.root / "patches" / "demo" / version
    folder.mkdir(parents=True)
    (folder / "carries-nothing").write_text("nothing to carry\n")


def test_release_keys_are_read_and_checked(demo: DemoProject) -> None:
    add_keys(demo, "1.0", 'test_env = "new-torch"\nci = "nightly"\n')
    release = load_upstream(demo.root / "upstream" / "demo.toml").release("1.0")
    assert (release.test_env, release.ci) == ("new-torch", "nightly")
    add_keys(demo, "1.0", 'ci = "weekly"\n')
    pin = demo.root / "upstream" / "demo.toml"
    pin.write_text(pin.read_text().replace('ci = "nightly"\n', ""))
    with pytest.raises(CarryError, match="'ci' must be 'every' or 'nightly'"):
        load_upstream(demo.root / "upstream" / "demo.toml")


def test_each_line_gets_its_own_environment(demo: DemoProject) -> None:
    with_envs(demo, ".venv-test", ".venv-test-new")
    demo.pin_release("2.0", {"demo/__init__.py": "VALUE = 2\n"})
    add_keys(demo, "2.0", 'test_env = "new-torch"\n')
    old, new = (demo.target("demo", v).release for v in ("1.0", "2.0"))
    assert env_for(demo.project, old).name == "old-torch"
    assert testenv.test_python(demo.project, old) == str(demo.root / ".venv-test" / "bin" / "python")
    assert testenv.test_python(demo.project, new) == str(demo.root / ".venv-test-new" / "bin" / "python")


def test_a_missing_or_unknown_environment_names_the_fix(demo: DemoProject) -> None:
    with_envs(demo, ".venv-test")
    demo.pin_release("2.0", {"demo/__init__.py": "VALUE = 2\n"})
    add_keys(demo, "2.0", 'test_env = "new-torch"\n')
    with pytest.raises(CarryError, match=r"run `python3 scripts/test_env.py new-torch`"):
        testenv.test_python(demo.project, demo.target("demo", "2.0").release)
    add_keys(demo, "1.0", 'test_env = "no-such"\n')
    with pytest.raises(
        CarryError, match=r"names test_env 'no-such', which ci/test-envs\.toml does not define"
    ):
        testenv.test_python(demo.project, demo.target("demo", "1.0").release)


def test_verify_without_python_refuses_a_line_whose_environment_is_not_built(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    with_envs(demo)
    demo.lay_down("tiny")
    demo.fetch()
    series_for(demo, "1.0")
    with pytest.raises(CarryError, match=r"\(old-torch, \.venv-test\) is not built"):
        verify(demo.project, [demo.target()], None, demo.pip)


def test_verify_says_a_line_has_no_series_before_asking_for_its_environment(demo: DemoProject) -> None:
    """It first demanded a test environment of several GB, for a line with nothing to verify."""
    with_envs(demo)
    demo.fetch()
    with pytest.raises(CarryError, match=r"demo 1.0 has no series in patches/demo/1.0"):
        verify(demo.project, [demo.target()], None, demo.pip)


def test_ci_schedule_and_runs(demo: DemoProject) -> None:
    with_envs(demo)
    demo.pin_release("2.0", {"demo/__init__.py": "VALUE = 2\n"})
    demo.pin_release("3.0", {"demo/__init__.py": "VALUE = 3\n"})
    for version in ("1.0", "2.0", "3.0"):
        series_for(demo, version)
    add_keys(demo, "1.0", 'ci = "every"\n')
    add_keys(demo, "3.0", 'test_env = "new-torch"\n')
    lines = {v: demo.target("demo", v) for v in ("1.0", "2.0", "3.0")}
    # 3.0 is the default line (the newest with a series): every run without saying so.
    assert [ci_schedule(demo.project, lines[v]) for v in ("1.0", "2.0", "3.0")] == [EVERY, NIGHTLY, EVERY]
    every = ci_runs(demo.project, EVERY)
    assert [(run.label, run.env.name) for run in every] == [
        ("demo 1.0 + tiny 0.3", "old-torch"),
        ("demo 3.0 + tiny 0.3", "new-torch"),
    ]
    # tiny's only line is its default: it is tested beside demo's default line, not on its own.
    assert [(run.label, run.env.name) for run in ci_runs(demo.project, NIGHTLY)] == [
        ("demo 2.0 + tiny 0.3", "old-torch")
    ]


def test_lines_tested_together_must_agree_on_the_environment(demo: DemoProject) -> None:
    with_envs(demo)
    add_keys(demo, "1.0", 'test_env = "new-torch"\n')
    tiny = demo.root / "upstream" / "tiny.toml"
    tiny.write_text(
        tiny.read_text().replace('version = "0.3"\n', 'version = "0.3"\ntest_env = "old-torch"\n')
    )
    with pytest.raises(CarryError, match="different test environments"):
        ci_runs(demo.project, EVERY)


def test_the_project_pins_name_known_environments() -> None:
    from sglang_carry.project import Project, select_targets

    project = Project(Path(__file__).resolve().parents[2])
    for target in select_targets(project, [], None, every_line=True):
        assert env_for(project, target.release).venv.parent == project.root
    assert ci_runs(project, EVERY)


HANGING_TEST = """
import time


def test_that_hangs():
    time.sleep(120)
"""


@pytest.mark.parametrize("lock", ["ci/requirements-test.lock", "ci/test-envs/torch2.14.lock"])
def test_every_test_environment_bounds_each_test(lock: str) -> None:
    """No test may hang: every environment's lock installs pytest-timeout, which the project's
    pytest configuration turns on."""
    root = Path(__file__).resolve().parents[2]
    pins = (root / lock).read_text().splitlines()
    assert any(line.startswith("pytest-timeout==") for line in pins)
    assert "\ntimeout = " in (root / "pyproject.toml").read_text()


def test_a_hanging_test_is_failed_by_the_bound(tmp_path: Path) -> None:
    """In this environment, under the project's pytest configuration (its bound lowered to 2 s),
    a test that sleeps is failed with a timeout instead of waiting."""
    root = Path(__file__).resolve().parents[2]
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            str(root / "pyproject.toml"),
            "--rootdir",
            str(tmp_path),
            "-o",
            "timeout=2",
            str(tmp_path / "test_hang.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1
    assert "Timeout" in run.stdout


def _test_env_script() -> Any:
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "scripts" / "test_env.py"
    spec = importlib.util.spec_from_file_location("carry_test_env_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("failure", "code", "said"),
    [
        (KeyboardInterrupt(), 130, "interrupted while building .venv-test; the next run builds it again"),
        (
            subprocess.CalledProcessError(1, ["python", "-m", "pip"]),
            1,
            "failed: pip exited 1 (its output is above)",
        ),
    ],
    ids=["ctrl-c", "pip-fails"],
)
def test_building_an_environment_ends_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    failure: BaseException,
    code: int,
    said: str,
) -> None:
    """Ctrl-C while .venv-test is made exited 1 with pip's text and a traceback."""
    script = _test_env_script()

    def build(env: Any) -> None:
        raise failure

    monkeypatch.setattr(script, "build", build)
    assert script.main(["torch2.13"]) == code
    [line] = capsys.readouterr().err.strip().splitlines()
    assert said in line
