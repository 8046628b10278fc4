"""Fixtures for the tool's tests: tiny local upstreams (a wheel and an sdist) and a project
around them. Nothing here touches the network."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import subprocess
import tarfile
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from sglang_carry.cli import main
from sglang_carry.fetch import fetch
from sglang_carry.patching import apply
from sglang_carry.project import Project, Target, select_targets
from sglang_carry.runner import Completed, run_subprocess

DEMO_FILES = {
    "demo/__init__.py": "VALUE = 1\n",
    "demo/core.py": "def answer():\n    return 41\n",
    "demo/native.so": "\x7fELF not really\n",
}
AUTHOR_ENV = {
    "GIT_AUTHOR_NAME": "Dev",
    "GIT_AUTHOR_EMAIL": "dev@example.com",
    "GIT_COMMITTER_NAME": "Dev",
    "GIT_COMMITTER_EMAIL": "dev@example.com",
    "GIT_CONFIG_GLOBAL": "/dev/null",
    "GIT_CONFIG_NOSYSTEM": "1",
}


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_wheel(directory: Path, name: str, version: str, files: Mapping[str, str]) -> Path:
    path = directory / f"{name}-{version}-py3-none-any.whl"
    dist_info = f"{name}-{version}.dist-info"
    entries = dict(files)
    entries[f"{dist_info}/METADATA"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    entries[f"{dist_info}/WHEEL"] = "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    rows = []
    with zipfile.ZipFile(path, "w") as wheel:
        for arcname, text in entries.items():
            data = text.encode()
            wheel.writestr(zipfile.ZipInfo(arcname, date_time=(2024, 1, 2, 3, 4, 6)), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{arcname},sha256={digest},{len(data)}")
        rows.append(f"{dist_info}/RECORD,,")
        wheel.writestr(
            zipfile.ZipInfo(f"{dist_info}/RECORD", date_time=(2024, 1, 2, 3, 4, 6)), "\n".join(rows)
        )
    return path


def make_sdist(directory: Path, name: str, version: str, files: Mapping[str, str]) -> Path:
    path = directory / f"{name}-{version}.tar.gz"
    entries = dict(files)
    entries["PKG-INFO"] = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    entries["pyproject.toml"] = f'[project]\nname = "{name}"\nversion = "{version}"\n'
    with tarfile.open(path, "w:gz") as sdist:
        for relative, text in entries.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}-{version}/{relative}")
            info.size = len(data)
            info.mtime = 1_700_000_000
            sdist.addfile(info, io.BytesIO(data))
    return path


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", *args],
        cwd=repo,
        env={**os.environ, **AUTHOR_ENV},
        text=True,
        capture_output=True,
        check=check,
    )


def patch_message(subject: str, status: str = "Pending", tests: str = "tests/test_demo.py") -> str:
    return (
        f"{subject}\n\nWhy this change is carried.\n\n"
        f"Upstream-Status: {status}\nBug: https://example.com/issue/1\n"
        f"Drop-When: upstream fixes it\nTest: {tests}\n"
    )


class FakePip:
    """Stands in for `pip download`: copies a prepared file into --dest, or fails."""

    def __init__(self, files: dict[str, Path]) -> None:
        self.files = files
        self.calls: list[tuple[str, ...]] = []

    def __call__(
        self,
        args: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        stdin: str | None = None,
        capture: bool = True,
    ) -> Completed:
        if list(args[1:4]) == ["-m", "pip", "download"]:
            self.calls.append(tuple(args))
            dest = Path(args[args.index("--dest") + 1])
            requirement = args[-1]
            # A file for one platform only ("demo==1.0 manylinux_2_34_aarch64"), else for any.
            platform = args[args.index("--platform") + 1] if "--platform" in args else ""
            source = self.files.get(f"{requirement} {platform}", self.files.get(requirement))
            if source is None:
                return Completed(
                    tuple(args), 1, "", f"ERROR: No matching distribution found for {requirement}"
                )
            (dest / source.name).write_bytes(source.read_bytes())
            return Completed(tuple(args), 0, "", "")
        return run_subprocess(args, cwd=cwd, env=env, stdin=stdin, capture=capture)


class DemoProject:
    """A carry project around a tiny upstream 'demo' (a wheel) and 'tiny' (an sdist)."""

    def __init__(self, root: Path, artifacts: Path) -> None:
        self.root = root
        self.artifacts = artifacts
        self.project = Project(root)
        (root / "upstream").mkdir(parents=True)
        (root / "patches").mkdir()
        self.wheel = make_wheel(artifacts, "demo", "1.0", DEMO_FILES)
        self.sdist = make_sdist(artifacts, "tiny", "0.3", {"tiny/__init__.py": "X = 1\n"})
        self.write_pin("demo", "python", "1.0", self.wheel.name, sha256_file(self.wheel))
        self.write_pin("tiny", "", "0.3", self.sdist.name, sha256_file(self.sdist), url=self.sdist.as_uri())
        self.pip = FakePip({"demo==1.0": self.wheel})

    def write_pin(
        self, name: str, subdir: str, version: str, filename: str, sha256: str, url: str | None = None
    ) -> None:
        url_line = f'url = "{url}"\n' if url else ""
        (self.root / "upstream" / f"{name}.toml").write_text(
            f'name = "{name}"\nsource_subdir = "{subdir}"\n\n[[release]]\nversion = "{version}"\n'
            f'git_tag = "v{version}"\n\n[[release.files]]\nfilename = "{filename}"\n'
            f'sha256 = "{sha256}"\n{url_line}'
        )

    def pin_release(self, version: str, files: Mapping[str, str]) -> Path:
        """Pin another demo release (its wheel fetched by the fake pip like the first)."""
        wheel = make_wheel(self.artifacts, "demo", version, files)
        with (self.root / "upstream" / "demo.toml").open("a") as pin:
            pin.write(
                f'\n[[release]]\nversion = "{version}"\ngit_tag = "v{version}"\n\n[[release.files]]\n'
                f'filename = "{wheel.name}"\nsha256 = "{sha256_file(wheel)}"\n'
            )
        self.pip.files[f"demo=={version}"] = wheel
        return wheel

    def target(self, name: str = "demo", version: str | None = None) -> Target:
        return select_targets(self.project, [name], version)[0]

    @property
    def checkout(self) -> Path:
        return self.root / "upstream" / "demo"

    @property
    def series_dir(self) -> Path:
        return self.root / "patches" / "demo" / "1.0"

    def fetch(self, name: str = "demo", version: str | None = None) -> None:
        assert fetch(self.project, [self.target(name, version)], self.pip).exit_code == 0

    def lay_down(self, name: str) -> None:
        """``name`` fetched and its carry branch built from patches/: another package whose tree
        the tests of a line import (tests/upstream/conftest.py), as `carry verify` requires."""
        self.fetch(name)
        apply(self.project, self.target(name))

    def commit_change(self, path: str, content: str, message: str, repo: Path | None = None) -> None:
        repo = repo or self.checkout
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(content)
        git(repo, "add", path)
        git(repo, "commit", "-q", "-m", message)

    def commit_empty(self, message: str) -> None:
        git(self.checkout, "commit", "-q", "--allow-empty", "-m", message)

    def snapshot(self, directory: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}

    def carry(self, *args: str) -> int:
        """The CLI, as a user runs it, on this project."""
        return main(["--root", str(self.root), *args])


@pytest.fixture
def demo(tmp_path: Path) -> Iterator[DemoProject]:
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    yield DemoProject(tmp_path / "project", artifacts)
