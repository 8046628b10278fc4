"""`carry index DIR`: a PEP 503 simple index of dist/ that pip installs the patched wheel from."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_carry.build import build
from sglang_carry.patching import export

from .conftest import DemoProject, patch_message

CORE = "python/demo/core.py"


def built(demo: DemoProject) -> Path:
    demo.fetch()
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    export(demo.project, demo.target())
    return build(demo.project, demo.target())


def test_pip_downloads_the_patched_wheel_from_the_index(
    demo: DemoProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = built(demo)
    index = tmp_path / "simple"
    assert demo.carry("index", str(index)) == 0
    assert (
        f"index: 1 file(s) of demo in {index}; install with `pip install --no-deps" in capsys.readouterr().out
    )
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert f'href="{wheel.name}#sha256={digest}"' in (index / "demo" / "index.html").read_text()
    into = tmp_path / "downloaded"
    pip = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-cache-dir",
            "--index-url",
            index.as_uri(),
            "--dest",
            str(into),
            "demo==1.0+carry.1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert pip.returncode == 0, pip.stderr
    assert (into / wheel.name).read_bytes() == wheel.read_bytes()


def test_an_index_is_rewritten_whole_and_never_over_another_folder(demo: DemoProject, tmp_path: Path) -> None:
    built(demo)
    index = tmp_path / "simple"
    assert demo.carry("index", str(index)) == 0
    (index / "demo" / "stale.whl").write_text("from an older run")
    assert demo.carry("index", str(index)) == 0
    assert not (index / "demo" / "stale.whl").exists()
    mine = tmp_path / "my-files"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert demo.carry("index", str(mine)) == 1
    assert (mine / "notes.txt").read_text() == "keep me"


def test_an_empty_dist_says_what_to_do(
    demo: DemoProject, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.carry("index", str(tmp_path / "simple")) == 1
    assert "holds no wheel or sdist to index: run `carry build` first" in capsys.readouterr().err
