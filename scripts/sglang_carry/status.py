"""What is pinned, fetched, applied and carried, for every line."""

from __future__ import annotations

from .errors import CarryError
from .git import Git
from .patching import branch_matches_series
from .pins import select_file
from .project import Project, Target
from .runner import Runner, run_subprocess


def describe(project: Project, target: Target, runner: Runner) -> list[str]:
    lines = [f"{target.label} (tag {target.release.git_tag})"]
    try:
        pinned = select_file(target.release)
        fetched = (project.downloads_dir / pinned.filename).exists()
        fetch_state = "fetched" if fetched else "not fetched"
        lines.append(f"  pin       {pinned.filename} sha256 {pinned.sha256[:16]}… {fetch_state}")
    except CarryError as exc:
        lines.append(f"  pin       {exc}")
    try:
        series = project.series(target.release)
    except CarryError as exc:
        lines.append(f"  series    BROKEN: {exc}")
        return lines
    current = "recorded" if series.revision_is_current() else "CHANGED since recorded (run `carry export`)"
    count = len(series.entries)
    lines.append(f"  series    {series.label}: {count} entries, revision {series.revision} {current}")
    for entry in series.entries:
        lines.append(f"    {entry.filename}  [{entry.status_line}]")
    git = Git(project.checkout(target.name), runner)
    if not git.exists() or git.rev(target.upstream_tag) is None:
        lines.append("  checkout  missing (run `carry fetch`)")
        return lines
    head = git.current_branch() or "detached HEAD"
    dirty = len(git.dirty_paths())
    state = f"{dirty} uncommitted change(s)" if dirty else "clean"
    if git.am_in_progress():
        state = "git am in progress"
        in_sync = "unknown"
    elif git.rev(target.branch) is None:
        in_sync = "no branch (run `carry apply`)"
    else:
        in_sync = (
            "matches patches/"
            if branch_matches_series(git, target, series, project.scratch_dir)
            else "DIFFERS from patches/"
        )
    lines.append(f"  checkout  upstream/{target.name} on {head}, {state}; {target.branch} {in_sync}")
    return lines


def status(project: Project, targets: list[Target], runner: Runner = run_subprocess) -> int:
    for target in targets:
        print("\n".join(describe(project, target, runner)))
    return 0
