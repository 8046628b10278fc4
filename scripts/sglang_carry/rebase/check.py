"""`carry rebase --check`: the whole rebase in a scratch copy under build/, so that the
checkout's files, branches and tags stay as they are."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..git import Git
from ..patching import apply
from ..pins import Upstream
from ..progress import Reporter
from ..project import Project, Target
from ..registry import Fetcher, append_release
from ..runner import Runner
from ..testenv import test_python
from .journal import STATE_FILE
from .replay import ConflictPolicy, Session
from .steps import RebaseResult, Request, begin, pin, pin_file, run


@dataclass(frozen=True)
class ScratchProject(Project):
    """A project whose pins, patches and checkouts live under ``base``, while its tests still run
    from the real root."""

    base: Path

    @property
    def upstream_dir(self) -> Path:
        return self.base / "upstream"

    @property
    def patches_dir(self) -> Path:
        return self.base / "patches"

    @property
    def scratch_dir(self) -> Path:
        return self.base / "build"


def check(
    project: Project,
    request: Request,
    upstream: Upstream,
    old: Target,
    runner: Runner,
    fetch: Fetcher,
    report: Reporter,
) -> RebaseResult:
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(dir=project.scratch_dir, prefix="rebase-check-"))
    report.step(f"rebase: --check works in {base.relative_to(project.root)} and removes it at the end")
    try:
        scratch = ScratchProject(project.root, base)
        _copy_into_scratch(project, scratch, upstream.name, old, runner, report)
        scratch_upstream = scratch.pins()[upstream.name]
        pinned, pin_text = pin(scratch_upstream, old.release, request, fetch)
        # The environments live in the real checkout, not in the scratch copy.
        python = request.python or test_python(project, pinned or scratch_upstream.release(request.new))
        git = Git(scratch.checkout(upstream.name), runner)
        command = f"carry rebase --check {request.new} {upstream.name} --upstream {old.version}"
        pin_source = pin_text.replace(str(base) + "/", "")
        state = begin(request, old, python, command, pin_file(scratch, upstream.name), pin_source)
        policy = ConflictPolicy.SKIP
        recorded = project.patches_dir / upstream.name / request.new
        if recorded.is_dir():
            state.recorded_ports = str(recorded)
            policy = ConflictPolicy.RECORDED_PORT
            report.step(
                f"rebase: patches/{upstream.name}/{request.new} exists: a patch that conflicts is "
                "tried in the form that line records"
            )
        if pinned is not None:
            append_release(Path(state.pin_file), pinned)
        session = Session(scratch, git, git.state_file(STATE_FILE), state, runner, report, check=True)
        return run(session, policy)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _copy_into_scratch(
    project: Project, scratch: ScratchProject, name: str, old: Target, runner: Runner, report: Reporter
) -> None:
    """Pins and the old series copied, downloads linked, the checkout's pristine tags fetched into
    a new repository that borrows the real one's objects (nothing is written there), and the old
    line rebuilt there from its patches with `carry apply`."""
    scratch.upstream_dir.mkdir(parents=True)
    for pinned in project.upstream_dir.glob("*.toml"):
        shutil.copy2(pinned, scratch.upstream_dir / pinned.name)
    shutil.copytree(project.patches_dir / name / old.version, scratch.patches_dir / name / old.version)
    scratch.downloads_dir.mkdir()
    if project.downloads_dir.is_dir():
        for cached in project.downloads_dir.iterdir():
            if cached.is_file() and not cached.name.startswith("."):
                (scratch.downloads_dir / cached.name).symlink_to(cached.resolve())
    real = Git(project.checkout(name), runner)
    clone = Git(scratch.checkout(name), runner)
    clone.repo.mkdir()
    clone.run("init", "--quiet")
    objects = real.out("rev-parse", "--path-format=absolute", "--git-common-dir")
    (clone.git_path("objects") / "info" / "alternates").write_text(f"{objects}/objects\n")
    exclude = real.git_path("info/exclude")
    if exclude.exists():
        clone.git_path("info").mkdir(exist_ok=True)
        shutil.copy2(exclude, clone.git_path("info/exclude"))
    clone.run("fetch", "--quiet", "--no-tags", str(real.repo), "refs/tags/upstream/*:refs/tags/upstream/*")
    for line in apply(scratch, Target(scratch.pins()[name], old.release), runner).describe():
        report.step(line)
