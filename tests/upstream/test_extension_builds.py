"""A torch JIT build killed mid-way does not hang the next one, and the tests' extension folder is
their own (extension_builds.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # mypy names it from tests/, in the package `upstream`
    from upstream import extension_builds
else:  # the one tests/upstream/conftest.py put on sys.path and installed
    import extension_builds

HERE = Path(__file__).resolve().parent
TINY_SOURCE = """#include <torch/extension.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
# A builder that takes torch's baton (its `lock` file) for the extension's folder, says so, and
# is then killed, as a rank killed during a build is.
HOLD_THE_BATON = """
import sys, time
from torch.utils.file_baton import FileBaton
assert FileBaton(sys.argv[1]).try_acquire()
print("holding", flush=True)
time.sleep(120)
"""
# The next test process: the tests' loader, then the extension loaded from the same folder.
LOAD = """
import sys
from pathlib import Path
import extension_builds
extension_builds.install([Path(sys.argv[2])])
import torch.utils.cpp_extension as cpp_extension
module = cpp_extension.load("carry_tiny", [sys.argv[1]], build_directory=sys.argv[3])
print("answer", module.answer(), flush=True)
"""
LOAD_LIMIT_S = 600  # a build of one small file; without the fix the load never returns


def test_a_builder_killed_holding_the_baton_does_not_hang_the_next_load(tmp_path: Path) -> None:
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY_SOURCE)
    build = tmp_path / "build" / "carry_tiny"
    build.mkdir(parents=True)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_BATON, str(build / "lock")], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert (build / "lock").exists()  # what a killed builder leaves

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("TORCH_EXTENSIONS_DIR", None)
    env.pop("CARRY_USER_TORCH_EXTENSIONS_DIR", None)
    loaded = subprocess.run(
        [sys.executable, "-c", LOAD, str(source), str(tmp_path), str(build)],
        capture_output=True,
        text=True,
        timeout=LOAD_LIMIT_S,
        env=env,
    )
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    # (From torch 2.14 on the `lock` file is an flock's and may stay; what matters is that the
    # load finished.)
    assert "answer 42" in loaded.stdout


def test_the_folder_is_per_tree_and_torch_inside_the_users(tmp_path: Path) -> None:
    trees = [tmp_path / "sglang-0.5.20"]
    other_trees = [tmp_path / "sglang-0.5.23"]
    users = str(tmp_path / "cache")
    mine = extension_builds.extension_dir(trees, "2.13.0", users)
    assert mine.parent == Path(users)
    assert mine != extension_builds.extension_dir(other_trees, "2.13.0", users)
    assert mine != extension_builds.extension_dir(trees, "2.14.1", users)
    assert extension_builds.extension_dir(trees, "2.13.0", None).parent == extension_builds.DEFAULT_PARENT
