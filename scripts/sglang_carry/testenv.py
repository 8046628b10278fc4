"""Which test environment each upstream line's tests run in, and which lines CI runs when.

The environments are named in ci/test-envs.toml (a lock and a venv each, built by
scripts/test_env.py). A pinned release picks one with `test_env = "<name>"` in
upstream/<name>.toml, else the table's default; `ci = "every"` or `"nightly"` says when CI runs its
upstream tests (without it: every run for a package's default line, nightly for the others).
"""

from __future__ import annotations

from dataclasses import dataclass

from .env_table import ENV_TABLE, TestEnv, read_env_table
from .errors import CarryError
from .pins import Release
from .project import Project, Target, default_target

__all__ = ["ENV_TABLE", "TestEnv", "ci_runs", "env_for", "test_envs", "test_python"]

EVERY, NIGHTLY = "every", "nightly"


def test_envs(project: Project) -> tuple[str, dict[str, TestEnv]]:
    """The default environment's name and every environment, from ci/test-envs.toml."""
    return read_env_table(project.root)


def env_for(project: Project, release: Release) -> TestEnv:
    default, envs = test_envs(project)
    name = release.test_env or default
    if name not in envs:
        raise CarryError(
            f"upstream/{release.name}.toml: {release.name} {release.version} names test_env '{name}', "
            f"which {ENV_TABLE} does not define (defined: {', '.join(sorted(envs))})"
        )
    return envs[name]


def test_python(project: Project, release: Release) -> str:
    """The interpreter of ``release``'s test environment; a CarryError when it is not built."""
    env = env_for(project, release)
    if not env.python.exists():
        raise CarryError(
            f"the test environment of {release.name} {release.version} ({env.name}, "
            f"{env.venv.relative_to(project.root)}) is not built: run `{env.build_command}` "
            "(or pass --python)"
        )
    return str(env.python)


def ci_schedule(project: Project, target: Target) -> str:
    if target.release.ci is not None:
        return target.release.ci
    return EVERY if default_target(project, target.upstream).release == target.release else NIGHTLY


@dataclass(frozen=True)
class CiRun:
    """One pytest process of CI's upstream tests: a tree for each package, in one environment."""

    lines: tuple[Target, ...]
    env: TestEnv

    @property
    def label(self) -> str:
        return " + ".join(line.label for line in self.lines)


def ci_runs(project: Project, schedule: str) -> list[CiRun]:
    """The runs for ``schedule``: each line CI runs then is tested beside the other packages'
    default lines, in its own environment; the default lines together make one run."""
    pins = project.pins()
    defaults = {name: default_target(project, upstream) for name, upstream in sorted(pins.items())}
    runs: list[CiRun] = []
    for name, upstream in sorted(pins.items()):
        for release in sorted(upstream.releases, key=lambda r: r.parsed_version):
            line = Target(upstream, release)
            if ci_schedule(project, line) != schedule:
                continue
            lines = tuple(line if other == name else defaults[other] for other in defaults)
            if any(run.lines == lines for run in runs):
                continue
            runs.append(CiRun(lines, _shared_env(project, lines)))
    return runs


def _shared_env(project: Project, lines: tuple[Target, ...]) -> TestEnv:
    """The environment the lines name; lines that name none take whichever the others name."""
    named = {line.release.test_env for line in lines} - {None}
    if len(named) > 1:
        labels = ", ".join(f"{line.label} ({line.release.test_env})" for line in lines)
        raise CarryError(f"lines tested together name different test environments: {labels}")
    chosen = next((line for line in lines if line.release.test_env), lines[0])
    return env_for(project, chosen.release)
