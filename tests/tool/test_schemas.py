"""The written schemas (ci/schemas/) against real output: `carry status --json` in every state a
line and the checkout can be in, and every command's --json result; and the schema's enums
against the code's, so that neither drifts from the other."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from sglang_carry.line_state import BranchState
from sglang_carry.status import CheckoutPresence, DownloadState, SeriesState

from .conftest import DemoProject, git, patch_message
from .test_cli import CORE, carried

SCHEMAS = Path(__file__).resolve().parents[2] / "ci" / "schemas"


def schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SCHEMAS / f"{name}.schema.json").read_text())
    jsonschema.Draft202012Validator.check_schema(loaded)
    return loaded


def status_json(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    demo.carry("status", "--json")
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    jsonschema.validate(report, schema("status"))
    return report


def test_status_json_holds_to_its_schema_in_every_state(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: set[tuple[str, str]] = set()

    def look() -> None:
        for line in status_json(demo, capsys)["lines"]:
            seen.add(("download", line["pin"]["download"]))
            seen.add(("series", line["series"]["state"]))
            if "checkout" in line:
                seen.add(("checkout", line["checkout"]["state"]))
                seen.add(("branch", line["checkout"].get("branch", "missing")))

    look()  # nothing fetched; tiny has no series
    carried(demo)
    look()  # recorded, matches
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Not exported"))
    look()  # differs
    git(demo.checkout, "reset", "-q", "--hard", "HEAD~1")
    git(demo.checkout, "checkout", "-q", "--orphan", "elsewhere")
    git(demo.checkout, "commit", "-q", "--allow-empty", "-m", "unrelated")
    git(demo.checkout, "branch", "-q", "-f", "carry/1.0", "elsewhere")
    look()  # does not descend
    git(demo.checkout, "branch", "-q", "-D", "carry/1.0")
    look()  # no branch
    (demo.series_dir / "0099-x.patch").write_text("stray\n")
    look()  # broken
    (demo.series_dir / "0099-x.patch").unlink()
    patch = demo.series_dir / "0001-Fix-the-answer.patch"
    patch.write_text(
        patch.read_text().replace("Bug: https://example.com/issue/1", "Bug: https://example.com/issue/7")
    )
    look()  # edited
    cached = demo.project.downloads_dir / demo.wheel.name
    cached.write_bytes(cached.read_bytes()[:50])
    look()  # wrong sha256
    (demo.root / "patches" / "tiny" / "0.3").mkdir(parents=True)
    (demo.root / "patches" / "tiny" / "0.3" / "carries-nothing").write_text("nothing to fix\n")
    look()
    (demo.project.scratch_dir / "tmpk1ll3d.partial").write_bytes(b"half a wheel")
    assert status_json(demo, capsys)["checkout"]["leftovers"] == [
        str(demo.project.scratch_dir / "tmpk1ll3d.partial")
    ]
    every = {("download", s.value) for s in DownloadState} | {("series", s.value) for s in SeriesState}
    every |= {("checkout", s.value) for s in CheckoutPresence}
    every |= {("branch", s.value) for s in BranchState if s is not BranchState.UNKNOWN}
    assert every <= seen, every - seen


def test_the_status_schema_names_exactly_the_codes_states() -> None:
    defs = schema("status")["$defs"]["line"]["properties"]
    assert defs["pin"]["oneOf"][0]["properties"]["download"]["enum"] == [s.value for s in DownloadState]
    assert defs["series"]["properties"]["state"]["enum"] == [s.value for s in SeriesState]
    present = defs["checkout"]["oneOf"][1]["properties"]
    assert present["branch"]["enum"] == [s.value for s in BranchState]
    states = [variant["properties"]["state"]["const"] for variant in defs["checkout"]["oneOf"]]
    assert states == [s.value for s in CheckoutPresence]
