"""The nightly workflow, checked without GitHub: zizmor --offline and actionlint (with shellcheck)
from the test environment, as ./scripts/test runs them (skipped where that environment predates
them), and always a structural check of the parsed YAML against what the nightly needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "nightly.yml"


@pytest.fixture(scope="module")
def workflow() -> dict[Any, Any]:
    parsed: dict[Any, Any] = yaml.safe_load(WORKFLOW.read_text())
    return parsed


def steps(workflow: dict[Any, Any], job: str) -> list[dict[str, Any]]:
    return list(workflow["jobs"][job]["steps"])


def all_steps(workflow: dict[Any, Any]) -> list[dict[str, Any]]:
    return [step for job in workflow["jobs"] for step in steps(workflow, job)]


def test_where_github_finds_it_and_nothing_stale() -> None:
    assert WORKFLOW.is_file()
    assert not (ROOT / "ci" / "nightly.yml").exists(), "GitHub never reads ci/: one workflow, in .github"
    assert not (ROOT / "ci" / "gpu-check").exists()


def venv_tool(name: str) -> str:
    """The lock's linter beside this interpreter (the PATH may not name the venv), else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (it is in ci/requirements-test.lock: rebuild .venv-test)")
    return found


def test_zizmor_offline_finds_nothing() -> None:
    done = subprocess.run(
        [venv_tool("zizmor"), "--offline", str(WORKFLOW)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_actionlint_with_shellcheck_finds_nothing() -> None:
    command = [venv_tool("actionlint"), "-shellcheck", venv_tool("shellcheck"), "-pyflakes=", str(WORKFLOW)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_triggers_cron_and_dispatch(workflow: dict[Any, Any]) -> None:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert on is not None, "the workflow has no triggers"
    [schedule] = on["schedule"]
    assert len(schedule["cron"].split()) == 5
    inputs = on["workflow_dispatch"]["inputs"]
    assert {"runner_labels", "lines"} <= set(inputs)


def test_permissions_none_by_default_and_read_only_per_job(workflow: dict[Any, Any]) -> None:
    assert workflow["permissions"] == {}
    jobs = workflow["jobs"]
    for name, job in jobs.items():
        wanted = {"contents": "read", "actions": "read"} if name == "canary" else {"contents": "read"}
        assert job["permissions"] == wanted, name  # only ci/last_green.py reads the past runs


def test_gpu_job_is_a_matrix_over_the_maintained_lines_on_labelled_runners(workflow: dict[Any, Any]) -> None:
    lines, line = workflow["jobs"]["lines"], workflow["jobs"]["line"]
    assert any("ci/nightly --list-lines" in step.get("run", "") for step in lines["steps"])
    assert line["needs"] == "lines"
    assert line["strategy"]["fail-fast"] is False
    assert line["strategy"]["matrix"]["line"] == "${{ fromJSON(needs.lines.outputs.matrix) }}"
    assert line["runs-on"] == "${{ fromJSON(needs.lines.outputs.runner) }}"
    labels = workflow["env"]["RUNNER_LABELS"]
    assert "inputs.runner_labels" in labels and "vars.CARRY_GPU_RUNNER_LABELS" in labels
    assert "self-hosted" in labels


def test_venvs_cached_outside_the_clean_checkout(workflow: dict[Any, Any]) -> None:
    for job in ("line", "canary"):
        job_steps = steps(workflow, job)
        checkout = next(
            i for i, s in enumerate(job_steps) if str(s.get("uses", "")).startswith("actions/checkout")
        )
        cache = next(i for i, s in enumerate(job_steps) if str(s.get("uses", "")).startswith("actions/cache"))
        assert cache > checkout, "restored after the checkout, which cleans the workspace"
        spec = job_steps[cache]["with"]
        assert ".venv-test" in spec["path"]
        assert "hashFiles(" in spec["key"] and "ci/requirements-test.lock" in spec["key"]
    gpu_env = next(s for s in steps(workflow, "line") if "ci/gpu-env" in s.get("run", ""))
    assert "runner.tool_cache" in gpu_env["env"]["VENV_ROOT"]  # a persistent path, not the workspace
    assert "PIP_EXTRA_INDEX_URL" not in gpu_env.get("env", {}), (
        "the CPU torch index must not reach the GPU venv"
    )


def test_artifacts_and_summaries_on_failure_too(workflow: dict[Any, Any]) -> None:
    uploads = [s for s in all_steps(workflow) if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert len(uploads) == 2
    for step in uploads:
        assert step.get("if") == "always()", step
    summaries = [s for s in all_steps(workflow) if "GITHUB_STEP_SUMMARY" in s.get("run", "")]
    assert summaries and all(s.get("if") == "always()" for s in summaries)
    [line_upload] = [s for s in uploads if "matrix" in s["with"]["name"]]
    assert "build/nightly/run/" in line_upload["with"]["path"]  # summary, logs, wheels, server logs


def test_canary_and_nightly_health(workflow: dict[Any, Any]) -> None:
    canary = workflow["jobs"]["canary"]
    assert canary["if"] == "always()" and canary["needs"] == "line"
    runs = [s.get("run", "") for s in canary["steps"]]
    assert any("ci/nightly --canary-only" in r for r in runs)
    health = next(s for s in canary["steps"] if "ci/last_green.py" in s.get("run", ""))
    assert health["env"]["GITHUB_TOKEN"] == "${{ secrets.GITHUB_TOKEN }}" and health["if"] == "always()"
    text = WORKFLOW.read_text()
    assert "60 days" in text and "default branch" in text  # the two silent deaths, documented


def test_every_script_a_step_runs_exists(workflow: dict[Any, Any]) -> None:
    # A repository path a step runs: at a line start or after a blank/quote, optionally as ./path.
    script_path = re.compile(r"(?:^|[\s\"'(])(?:\./)?((?:ci|scripts)/[\w.-]+(?:/[\w.-]+)*)", re.M)
    mentioned = set()
    for step in all_steps(workflow):
        mentioned.update(script_path.findall(step.get("run", "")))
    expected = {"ci/nightly", "ci/gpu-env", "scripts/build", "scripts/test_env.py", "ci/last_green.py"}
    assert expected <= mentioned
    for path in mentioned:
        target = ROOT / path
        assert target.is_file(), path
        if not path.endswith(".py"):
            assert os.access(target, os.X_OK), f"{path} is run directly: it must be executable"


def test_actions_pinned_by_commit_with_the_tag_named(workflow: dict[Any, Any]) -> None:
    for step in all_steps(workflow):
        if "uses" in step:
            assert re.fullmatch(r"[\w-]+/[\w-]+@[0-9a-f]{40}", step["uses"]), step["uses"]
    uses_lines = [line for line in WORKFLOW.read_text().splitlines() if "uses:" in line]
    assert uses_lines
    for line in uses_lines:
        assert re.search(r"@[0-9a-f]{40} # v\d+\.\d+\.\d+$", line), line


def test_checkout_keeps_no_token(workflow: dict[Any, Any]) -> None:
    checkouts = [s for s in all_steps(workflow) if str(s.get("uses", "")).startswith("actions/checkout@")]
    assert len(checkouts) == 3
    for step in checkouts:
        assert step["with"]["persist-credentials"] is False, step
