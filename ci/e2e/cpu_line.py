"""What `run_e2e.py --device cpu --upstream V` serves: the line's trees, its interpreter and the
server's extra dependencies, all made from this checkout by the tool's library.

- the pristine wheel: the pin's file (fetched, hash-checked, if missing);
- the patched wheel: dist/<the line's artifact>; if missing, the line is laid down (`carry apply`)
  and the wheel built, and upstream/sglang is put back on the branch it was found on;
- the series without its load wait: the line's series minus the entry whose `Test:` is
  LOAD_WAIT_TEST, applied with `git am` onto upstream/V in a scratch worktree, whose package
  folder is copied out (the worktree is then removed: nothing is left in upstream/sglang but
  objects);
- the interpreter: the line's test environment (ci/test-envs.toml), built if missing, plus its
  `e2e_server_lock` installed into <venv>/carry-e2e-server (stamped with the lock's sha256),
  which only the servers get on their PYTHONPATH.
Each tree is a folder to put first on a server's PYTHONPATH (a wheel is unpacked, not installed).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from sglang_carry.build import artifact_name, build  # noqa: E402
from sglang_carry.errors import CarryError  # noqa: E402
from sglang_carry.fetch import fetch  # noqa: E402
from sglang_carry.git import Git, summarize_git_output  # noqa: E402
from sglang_carry.patching import apply  # noqa: E402
from sglang_carry.pins import select_file  # noqa: E402
from sglang_carry.project import Project, Target, select_targets  # noqa: E402
from sglang_carry.series import Series  # noqa: E402
from sglang_carry.testenv import env_for  # noqa: E402
from sglang_carry.trees import found_branch_restored  # noqa: E402

LOAD_WAIT_TEST = "tests/upstream/sglang/test_unwind_waits_for_load.py"
SERVER_DEPS = "carry-e2e-server"
STAMP = ".carry-e2e-server"


@dataclass(frozen=True)
class CpuLine:
    version: str
    python: Path
    server_deps: Path
    pristine_wheel: Path
    patched_wheel: Path
    without_load_wait: Path  # a tree: the series minus its load-wait entry
    load_wait_entry: str


def line_target(project: Project, version: str | None) -> Target:
    return select_targets(project, ["sglang"], version)[0]


def ensure_interpreter(project: Project, target: Target) -> tuple[Path, Path]:
    """The line's test environment (built if missing) and its server dependencies folder."""
    env = env_for(project, target.release)
    if not env.python.exists():
        subprocess.run([sys.executable, str(ROOT / "scripts" / "test_env.py"), env.name], check=True)
    if env.e2e_server_lock is None:
        raise CarryError(f"ci/test-envs.toml: {env.name} names no e2e_server_lock: add one")
    target_dir = env.venv / SERVER_DEPS
    wanted = hashlib.sha256(env.e2e_server_lock.read_bytes()).hexdigest()
    stamp = target_dir / STAMP
    if not (stamp.exists() and stamp.read_text().strip() == wanted):
        print(
            f"e2e: installing {env.e2e_server_lock.relative_to(project.root)} into {target_dir}", flush=True
        )
        shutil.rmtree(target_dir, ignore_errors=True)
        pip = [str(env.python), "-m", "pip", "install", "--quiet", "--no-input", "--no-deps"]
        subprocess.run([*pip, "--target", str(target_dir), "-r", str(env.e2e_server_lock)], check=True)
        stamp.write_text(wanted + "\n")
    return env.python, target_dir


def patched_wheel(project: Project, target: Target, series: Series) -> Path:
    """dist/<the line's wheel>; when it is not there, the line is laid down and the wheel built."""
    pinned = project.downloads_dir / select_file(target.release).filename
    local = f"{target.version}+carry.{series.revision}"
    wheel = project.dist_dir / artifact_name(pinned, target.version, local)
    if not wheel.exists():
        print(f"e2e: building {wheel.name}", flush=True)
        with found_branch_restored(project, [target.name]) as not_restored:
            apply(project, target)
            wheel = build(project, target)
        if not_restored:
            raise CarryError(not_restored[0])
    return wheel


def load_wait_entry(series: Series) -> str:
    found = [e.filename for e in series.entries if any(t.startswith(LOAD_WAIT_TEST) for t in e.tests)]
    if len(found) != 1:
        raise CarryError(
            f"{series.label}: {len(found)} entries name {LOAD_WAIT_TEST} in Test:, not one: "
            "the e2e cannot tell which entry is the load wait"
        )
    return found[0]


def tree_without(
    project: Project, target: Target, series: Series, left_out: str, dest: Path, python: Path
) -> Path:
    """The line's series minus one entry, applied onto upstream/<version>, as a folder at dest."""
    git = Git(project.checkout(target.name))
    (project.scratch_dir / "e2e-worktrees").mkdir(parents=True, exist_ok=True)
    # Its own folder per run: two runs side by side never remove each other's worktree.
    scratch = Path(
        tempfile.mkdtemp(prefix=f"{target.version}-without-", dir=project.scratch_dir / "e2e-worktrees")
    )
    git.fresh_worktree(scratch, target.upstream_tag)
    try:
        work = Git(scratch)
        patches = [str(series.directory / e.filename) for e in series.entries if e.filename != left_out]
        done = work.run("am", "--3way", "--keep", "--empty=keep", *patches, check=False)
        if done.returncode != 0:
            work.run("am", "--abort", check=False)
            raise CarryError(
                f"{series.label} without {left_out} does not apply to {target.label} "
                f"({summarize_git_output(done.output)}): a later entry depends on it, so the e2e cannot "
                "make the tree without the load wait; port that entry so it stands without it"
            )
        subdir = target.upstream.source_subdir
        tree = dest / subdir if subdir else dest
        shutil.rmtree(dest, ignore_errors=True)
        # The package folder only: the worktree's own .git file stays behind with the worktree.
        shutil.copytree(scratch / subdir if subdir else scratch, tree, ignore=shutil.ignore_patterns(".git"))
        byte_compiled(tree, python)
    finally:
        git.run("worktree", "remove", "--force", str(scratch), check=False)
        git.run("worktree", "prune", check=False)
        shutil.rmtree(scratch, ignore_errors=True)
    return tree


def unpack_wheel(wheel: Path, dest: Path, python: Path | str) -> Path:
    """A wheel's files in a folder, byte-compiled by the interpreter that serves them (what an
    install puts in site-packages), kept while unchanged."""
    marker = dest / ".carry-wheel"
    if marker.exists() and marker.read_text() == wheel.name:
        return dest
    shutil.rmtree(dest, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(dest)
    byte_compiled(dest, python)
    marker.write_text(wheel.name)
    return dest


def byte_compiled(tree: Path, python: Path | str) -> Path:
    """The tree's modules compiled, as pip compiles what it installs. Without it every server
    process compiles sglang's ~4700 modules again at each start-up (PYTHONDONTWRITEBYTECODE, or a
    read-only site, keeps what it compiled from being written), about 12 s of each process's
    imports on 2 cores; compiling once takes about 10 s."""
    compiled = subprocess.run(
        [str(python), "-m", "compileall", "-q", "-j", "0", str(tree)], capture_output=True, text=True
    )
    if compiled.returncode != 0:
        found = (compiled.stdout + compiled.stderr).strip().splitlines()
        raise CarryError(f"{tree}: a module does not compile with {python}: {found[-1] if found else ''}")
    return tree


def prepare(version: str | None, out: Path) -> CpuLine:
    project = Project(ROOT)
    target = line_target(project, version)
    fetch(project, [target])
    python, deps = ensure_interpreter(project, target)
    series = project.series(target.release)
    left_out = load_wait_entry(series)
    return CpuLine(
        version=target.version,
        python=python,
        server_deps=deps,
        pristine_wheel=project.downloads_dir / select_file(target.release).filename,
        patched_wheel=patched_wheel(project, target, series),
        without_load_wait=tree_without(
            project, target, series, left_out, out / "trees" / "without-load-wait", python
        ),
        load_wait_entry=left_out,
    )
