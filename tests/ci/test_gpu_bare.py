"""ci/gpu-bare: the bundle fits the budget in the requirement file's order (a fake download), and
the scripts it ships are where the README says, executable and valid shell."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BARE = ROOT / "ci" / "gpu-bare"
_spec = importlib.util.spec_from_file_location("carry_gpu_bare_prepare", BARE / "prepare.py")
assert _spec is not None and _spec.loader is not None
prepare = importlib.util.module_from_spec(_spec)
sys.modules["carry_gpu_bare_prepare"] = prepare
_spec.loader.exec_module(prepare)


def test_pack_takes_wheels_in_order_while_they_fit(tmp_path: Path) -> None:
    sglang = tmp_path / "sglang-0.5.20+carry.4-cp312-cp312-manylinux_2_34_x86_64.whl"
    sglang.write_bytes(b"s" * 50)
    sizes = {"small==1": 10, "big==2": 60, "tiny==3": 5}
    fetched: list[str] = []

    def fetch(requirement: str, dest: Path) -> Path:
        fetched.append(requirement)
        name, version = requirement.split("==")
        wheel = dest / f"{name}-{version}-py3-none-any.whl"
        wheel.write_bytes(b"w" * sizes[requirement])
        return wheel

    manifest = prepare.pack(sglang, list(sizes), tmp_path / "out", budget=70, fetch=fetch)
    assert [c["file"] for c in manifest["carried"]] == [
        sglang.name,
        "small-1-py3-none-any.whl",
        "tiny-3-py3-none-any.whl",
    ]
    assert manifest["left_out"] == [{"requirement": "big==2", "bytes": 60}]
    assert manifest["carried_bytes"] == 65
    assert json.loads((tmp_path / "out" / "manifest.json").read_text()) == manifest
    # A second run takes the cached downloads.
    prepare.pack(sglang, list(sizes), tmp_path / "out", budget=70, fetch=fetch)
    assert fetched == list(sizes)


def test_requirements_are_pinned_and_name_what_the_gpu_tests_import() -> None:
    wanted = prepare.requirements(BARE / "requirements.txt")
    assert all("==" in r for r in wanted)
    names = [r.split("==")[0].lower() for r in wanted]
    assert names[0] == "pytest" and "transformers" in names[:8]
    assert "torch" not in names  # the machine's own torch
    assert names[-1] == "xgrammar"


def test_scripts_are_executable_valid_shell() -> None:
    run = BARE / "run"
    assert os.access(run, os.X_OK)
    subprocess.run(["bash", "-n", str(run)], check=True)
    text = run.read_text()
    assert "--system-site-packages" in text and "--no-index --no-deps" in text
    assert "CARRY_REQUIRE_GPU=1" in text
    assert (BARE / "README.md").is_file()
