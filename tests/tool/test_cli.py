from __future__ import annotations

import pytest

from sglang_carry.cli import main

from .conftest import DemoProject


def test_unknown_version_is_one_line_and_non_zero(
    demo: DemoProject, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--root", str(demo.root), "apply", "demo", "--upstream", "2.0"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("carry apply: error: demo 2.0 is not pinned")


def test_status_before_fetch(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--root", str(demo.root), "status"]) == 0
    out = capsys.readouterr().out
    assert "demo 1.0" in out and "not fetched" in out and "checkout  missing (run `carry fetch`)" in out


def test_build_before_fetch_says_what_to_do(demo: DemoProject, capsys: pytest.CaptureFixture[str]) -> None:
    demo.series_dir.mkdir(parents=True)
    (demo.series_dir / "carries-nothing").write_text("upstream has every fix\n")
    assert main(["--root", str(demo.root), "build", "demo"]) == 1
    assert "run `carry fetch` first" in capsys.readouterr().err
