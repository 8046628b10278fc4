"""ci/gpu-bare: the bundle fits the budget in the requirement file's order (a fake download), and
the scripts it ships are where the README says, executable and valid shell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from script_module import load_script

ROOT = Path(__file__).resolve().parents[2]
BARE = ROOT / "ci" / "gpu-bare"
prepare = load_script("carry_gpu_bare_prepare", BARE / "prepare.py")


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


STANDIN_CHECK = """
import sys, torch
sys.path.insert(0, sys.argv[1])
import carry_standin
assert "flashinfer" in carry_standin.install()
import flashinfer
from flashinfer.gemm import bmm_fp8  # a placeholder package and submodule
class Derived(flashinfer.SomeBase):  # a placeholder can be a base class
    pass
import sgl_kernel
from sgl_kernel import kvcacheio as io
from sgl_kernel.flash_attn import flash_attn_varlen_func  # any name imports
assert sgl_kernel.CARRY_STANDIN
try:
    flash_attn_varlen_func()
except NotImplementedError as e:
    assert "sgl_kernel.flash_attn.flash_attn_varlen_func" in str(e)
else:
    raise AssertionError("a placeholder ran")
torch.manual_seed(0)
layers, tokens, page, heads = 3, 16, 4, 2
device = [torch.randn(tokens, heads) for _ in range(2 * layers)]  # k layers then v layers
host = [torch.zeros(tokens // page, layers, page, heads) for _ in range(2)]  # page-first k, v
src, dst = torch.tensor([1, 5, 6, 14]), torch.tensor([8, 2, 3, 12])
io.transfer_kv_all_layer_direct_lf_pf(device, host, src, dst, page)
for i, layer in enumerate(device):
    d = dst
    assert torch.equal(host[i // layers][d // page, i % layers, d % page], layer[src])
back = [torch.zeros(tokens, heads) for _ in range(2)]
io.transfer_kv_per_layer_direct_pf_lf(host, back, dst, src, 1, page)
assert torch.equal(back[0][src], device[1][src]) and torch.equal(back[1][src], device[layers + 1][src])
slots = [torch.zeros(6, 5)]
io.transfer_kv_direct([torch.arange(30.0).view(6, 5)], slots, torch.tensor([4]), torch.tensor([1]), 1)
assert torch.equal(slots[0][1], torch.arange(20.0, 25.0))
print("standin ok")
"""


def test_sgl_kernel_standin_copies_round_trip() -> None:
    """In a subprocess: the stand-in must never leak into this test session's imports."""
    done = subprocess.run(
        [sys.executable, "-c", STANDIN_CHECK, str(BARE / "standin")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip() == "standin ok", done.stderr
