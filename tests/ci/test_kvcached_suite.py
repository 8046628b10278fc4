"""ci/kvcached_suite.py: what it says before it runs anything."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from script_module import load_script

ROOT = Path(__file__).resolve().parents[2]
suite = load_script("carry_kvcached_suite", ROOT / "ci" / "kvcached_suite.py")


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setattr(sys, "argv", ["kvcached_suite.py", *args])
    code: int = suite.main()
    return code


def test_an_unpinned_version_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _main(monkeypatch, "--version", "9.9") == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "kvcached-suite: error: kvcached 9.9 is not pinned (pinned: 0.1.6): "
        "add a [[release]] to upstream/kvcached.toml"
    ]


def test_a_line_not_laid_down_names_the_commands_that_lay_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(suite, "CHECKOUT", tmp_path / "kvcached")  # no checkout: never fetched
    assert _main(monkeypatch) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"kvcached-suite: error: upstream/0.1.6 is not in {tmp_path / 'kvcached'}: lay the line down first "
        "(./scripts/carry fetch kvcached --upstream 0.1.6 && ./scripts/carry apply kvcached --upstream 0.1.6)"
    ]
