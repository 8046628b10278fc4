"""ci/kvcached_suite.py: what it says before it runs anything."""

from __future__ import annotations

import shutil
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


def test_a_line_not_laid_down_is_one_line_naming_the_command_that_lays_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A clone that never fetched: this project's pins and series, no checkout.
    (tmp_path / "upstream").mkdir()
    shutil.copy2(ROOT / "upstream" / "kvcached.toml", tmp_path / "upstream" / "kvcached.toml")
    shutil.copytree(ROOT / "patches" / "kvcached", tmp_path / "patches" / "kvcached")
    monkeypatch.setattr(suite, "ROOT", tmp_path)
    assert _main(monkeypatch) == 1
    assert capsys.readouterr().err.splitlines() == [
        "kvcached-suite: error: no checkout of kvcached 0.1.6 in upstream/kvcached: run `carry fetch` first"
    ]
