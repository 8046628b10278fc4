"""ci/last_green.py against a fake GitHub API."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[2]
last_green = load_script("carry_last_green", ROOT / "ci" / "last_green.py")

NOW = dt.datetime(2026, 11, 30, 12, 0, tzinfo=dt.UTC)
ENV = {
    "GITHUB_REPOSITORY": "acme/sglang-carry",
    "GITHUB_TOKEN": "t0k",
    "GITHUB_API_URL": "https://api.example",
}


def fake_api(green: list[dict[str, str]], pushed_at: str) -> tuple[Any, list[tuple[str, dict[str, str]]]]:
    calls: list[tuple[str, dict[str, str]]] = []

    def fetch(url: str, headers: Mapping[str, str]) -> Any:
        calls.append((url, dict(headers)))
        if url.endswith("/repos/acme/sglang-carry"):
            return {"default_branch": "main", "pushed_at": pushed_at}
        return {"workflow_runs": green}

    return fetch, calls


def test_recent_green_and_recent_push_no_warning() -> None:
    run = {"created_at": "2026-11-30T03:17:00Z", "html_url": "https://x/runs/1"}
    fetch, calls = fake_api([run], "2026-11-20T00:00:00Z")
    lines, warnings = last_green.report(ENV, fetch, NOW)
    assert warnings == []
    assert any("0.4 days ago" in line for line in lines)
    runs_url = calls[1][0]
    assert runs_url == (
        "https://api.example/repos/acme/sglang-carry/actions/workflows/nightly.yml/runs"
        "?branch=main&status=success&per_page=1"
    )
    assert calls[1][1]["Authorization"] == "Bearer t0k"


def test_old_green_and_quiet_repository_warn() -> None:
    run = {"created_at": "2026-11-20T03:17:00Z", "html_url": "https://x/runs/1"}
    fetch, _ = fake_api([run], "2026-10-01T00:00:00Z")
    _, warnings = last_green.report(ENV, fetch, NOW)
    assert warnings[0] == "the last green nightly is 10.4 days old"
    assert "GitHub disables this schedule at 60" in warnings[1]


def test_no_green_run_yet() -> None:
    fetch, _ = fake_api([], "2026-11-29T00:00:00Z")
    lines, warnings = last_green.report(ENV, fetch, NOW)
    assert "**none**" in lines[2] and warnings == ["no green nightly on the default branch yet"]


def test_api_failure_is_a_warning_not_a_failure(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def fetch(url: str, headers: Mapping[str, str]) -> Any:
        raise OSError("HTTP Error 403: rate limited")

    assert last_green.main(ENV, fetch) == 0
    assert "could not read the GitHub API: HTTP Error 403" in capsys.readouterr().out


def test_writes_the_job_summary(tmp_path: Path) -> None:
    summary = tmp_path / "summary.md"
    fetch, _ = fake_api([], "2026-11-29T00:00:00Z")
    env = {**ENV, "GITHUB_STEP_SUMMARY": str(summary)}
    original = last_green.fetch_json
    assert last_green.main(env, fetch) == 0
    assert last_green.fetch_json is original
    assert "Nightly health" in summary.read_text()
