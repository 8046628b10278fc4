"""Where the upstream tests' torch JIT extensions are built, and a build lock that dies with its holder.

torch compiles JIT extensions (sglang's HiCache native hash) into one folder per name and guards
each build with a `lock` file it waits on while it exists, with no timeout: a process killed
mid-build (the two-rank tests kill peers on purpose) leaves every later build waiting forever.
sglang removes such stale locks itself from 0.5.22 on (srt/utils/cpp_extension_loader.py), under
an flock; the older lines do not. So every test process loads extensions here:
- in a folder of its own per upstream tree and torch version, nested inside a
  TORCH_EXTENSIONS_DIR the user set (CI caches do), never the shared folder itself;
- behind an flock per extension, which the kernel releases when its holder dies: whoever holds it
  and still finds torch's `lock` knows its builder is dead, and removes it.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Where the extensions go when the user set no TORCH_EXTENSIONS_DIR.
DEFAULT_PARENT = Path(__file__).resolve().parents[2] / "build" / "torch_extensions"


def extension_dir(trees: Sequence[Path], torch_version: str, user_dir: str | None) -> Path:
    """The folder for these trees and this torch: one per tree set and torch build, so two lines
    (or two torches) never build over each other's extensions."""
    key = hashlib.sha256("\0".join([torch_version, *map(str, trees)]).encode()).hexdigest()[:16]
    return (Path(user_dir) if user_dir else DEFAULT_PARENT) / f"carry-{key}"


def behind_a_kernel_lock(
    load: Callable[..., Any], build_directory_of: Callable[[str], str]
) -> Callable[..., Any]:
    """`load` (torch.utils.cpp_extension.load) serialised by an flock per extension, removing the
    `lock` file of a builder that died holding torch's baton."""

    @functools.wraps(load)
    def locked_load(name: str, *args: Any, **kwargs: Any) -> Any:
        directory = Path(kwargs.get("build_directory") or build_directory_of(name))
        directory.parent.mkdir(parents=True, exist_ok=True)
        with (directory.parent / f".{directory.name}.carry-build.lock").open("a+") as held:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
            # Every builder of this folder holds the flock while it builds: a `lock` left now is
            # a dead one's.
            (directory / "lock").unlink(missing_ok=True)
            return load(name, *args, **kwargs)

    return locked_load


def install(trees: Sequence[Path]) -> Path:
    """Set this process's extension folder and wrap torch's loader; returns the folder."""
    import torch
    import torch.utils.cpp_extension as cpp_extension

    user_dir = os.environ.get("CARRY_USER_TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR"))
    folder = extension_dir(trees, torch.__version__, user_dir)
    # Child processes (forked ranks, servers) inherit the folder; the user's own stays known, so
    # a nested install does not nest again.
    if user_dir is not None:
        os.environ["CARRY_USER_TORCH_EXTENSIONS_DIR"] = user_dir
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    if not hasattr(cpp_extension.load, "__wrapped__"):
        cpp_extension.load = behind_a_kernel_lock(
            cpp_extension.load, lambda name: cpp_extension._get_build_directory(name, verbose=False)
        )
    return folder
