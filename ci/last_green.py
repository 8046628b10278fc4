"""Report how old the last green nightly is, and how close GitHub is to disabling the schedule.

    python3 ci/last_green.py            (in GitHub Actions: GITHUB_REPOSITORY, GITHUB_TOKEN)

A fork's scheduled workflow dies silently in two ways:
- GitHub disables a schedule after 60 days without activity in the repository (a push, ...):
  the nightly then simply stops;
- schedules run only from the default branch: a nightly.yml on any other branch never runs.
Neither shows up as a red run. This step, run by every nightly, prints the age of the last
successful nightly on the default branch and the days since the last push, into the job
summary, with a warning annotation when the last green run is older than 2 days or the last push
older than 45 days. It reads the GitHub API with the job's token (permission actions: read).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

FetchJson = Callable[[str, Mapping[str, str]], Any]
WORKFLOW_FILE = "nightly.yml"
GREEN_WARN_DAYS = 2
PUSH_WARN_DAYS = 45  # GitHub disables schedules at 60


def fetch_json(url: str, headers: Mapping[str, str]) -> Any:
    request = urllib.request.Request(url, headers=dict(headers))
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


def _parse(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def report(env: Mapping[str, str], fetch: FetchJson, now: dt.datetime) -> tuple[list[str], list[str]]:
    """(summary lines in Markdown, warning annotations)."""
    api = env.get("GITHUB_API_URL", "https://api.github.com")
    repo = env["GITHUB_REPOSITORY"]
    headers = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": "2022-11-28"}
    if env.get("GITHUB_TOKEN"):
        headers["Authorization"] = f"Bearer {env['GITHUB_TOKEN']}"
    info = fetch(f"{api}/repos/{repo}", headers)
    default = info["default_branch"]
    runs = fetch(
        f"{api}/repos/{repo}/actions/workflows/{WORKFLOW_FILE}/runs?branch={default}&status=success&per_page=1",
        headers,
    )
    lines = [f"### Nightly health ({repo}, default branch `{default}`)", ""]
    warnings: list[str] = []
    green = runs.get("workflow_runs") or []
    if green:
        last = _parse(green[0]["created_at"])
        age = (now - last).total_seconds() / 86400
        url = green[0]["html_url"]
        lines.append(f"- last green nightly: {last:%Y-%m-%d %H:%M} UTC, **{age:.1f} days ago** ({url})")
        if age > GREEN_WARN_DAYS:
            warnings.append(f"the last green nightly is {age:.1f} days old")
    else:
        lines.append("- last green nightly: **none** on the default branch")
        warnings.append("no green nightly on the default branch yet")
    pushed = (now - _parse(info["pushed_at"])).total_seconds() / 86400
    lines.append(f"- last push to the repository: {pushed:.0f} days ago (GitHub disables schedules at 60)")
    if pushed > PUSH_WARN_DAYS:
        warnings.append(
            f"no push for {pushed:.0f} days: GitHub disables this schedule at 60; push, or re-enable it"
            " under Actions > nightly"
        )
    ref = env.get("GITHUB_REF_NAME")
    if env.get("GITHUB_EVENT_NAME") == "workflow_dispatch" and ref and ref != default:
        lines.append(f"- this run is on `{ref}`: only `{default}`'s nightly.yml runs on the schedule")
    return lines, warnings


def main(env: Mapping[str, str] = os.environ, fetch: FetchJson = fetch_json) -> int:
    try:
        lines, warnings = report(env, fetch, dt.datetime.now(dt.UTC))
    except Exception as error:  # reporting must not hide the night's own result
        print(f"::warning title=nightly health::could not read the GitHub API: {error}")
        return 0
    text = "\n".join(lines) + "\n"
    print(text)
    for warning in warnings:
        print(f"::warning title=nightly health::{warning}")
    summary = env.get("GITHUB_STEP_SUMMARY")
    if summary:
        with open(summary, "a", encoding="utf-8") as stream:
            stream.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
