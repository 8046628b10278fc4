"""What a run of the harness leaves: report.json (the line, then every run's record), report.md
and the printed table (one row per run, its verdict last), and a notice for each pristine run
that survived its injected misses (upstream fixed the bug)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .verdicts import PRISTINE, Run, per_rank


def table(runs: Sequence[Run]) -> list[str]:
    lines = [
        f"{'model':<7} {'run':<23} {'ok':<3} {'done':>4} {'fail':>4} {'host':>5} {'miss':>11}"
        f" {'unw/retr':>11} {'diff':>4} {'s':>4}  verdict"
    ]
    for r in runs:
        differing = "-" if r.outputs_differing is None else str(r.outputs_differing)
        lines.append(
            f"{r.model:<7} {r.name:<23} {'yes' if r.ok else 'NO':<3} {r.finished:>4} {r.failed:>4}"
            f" {r.host_cached_tokens:>5} {per_rank(r.misses):>11} {per_rank(r.recoveries):>11} {differing:>4}"
            f" {r.seconds:>4.0f}  {r.verdict}"
        )
    return lines


def upstream_fixed(runs: Sequence[Run]) -> list[str]:
    return [
        f"{r.model} {r.name}" for r in runs if r.kind == PRISTINE and r.verdict.startswith("UPSTREAM FIXED")
    ]


def publish(out: Path, report: dict[str, Any], runs: Sequence[Run]) -> None:
    """Write report.json (`report`, then the runs) and report.md; print the notices and the table."""
    fixed = upstream_fixed(runs)
    report = report | {"runs": [asdict(r) for r in runs], "upstream_fixed": fixed}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = table(runs)
    (out / "report.md").write_text("```\n" + "\n".join(lines) + "\n```\n")
    for what in fixed:
        print(f"e2e: NOTICE: {what}: pristine sglang survived the injected misses: upstream fixed it")
        if os.environ.get("GITHUB_ACTIONS") == "true":
            print(f"::notice title=upstream fixed it::{what}: pristine survived the injected misses")
    print("\n".join(lines))
