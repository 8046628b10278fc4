"""Download pinned artifacts (hash-checked) and lay each down as a pristine git checkout."""

from __future__ import annotations

import enum
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .errors import CarryError
from .git import PRISTINE_AUTHOR, Git
from .kinds import Wanted, kind_of
from .pins import PinnedFile, select_file
from .progress import SILENT, Reporter, Stopwatch, megabytes
from .project import Project, Target
from .runner import Runner, run_subprocess

IGNORED_IN_CHECKOUT = "__pycache__/\n*.py[co]\n.pytest_cache/\n"


class CheckoutState(enum.Enum):
    PRESENT = "present"  # the pristine tag was there already
    LAID = "laid"


@dataclass(frozen=True)
class Checkout:
    package: str
    line: str
    tag: str
    state: CheckoutState
    seconds: float
    laid_from: str | None = None

    def describe(self) -> str:
        if self.state is CheckoutState.PRESENT:
            return f"{self.package} {self.line}: checkout has {self.tag}"
        return f"{self.package} {self.line}: laid {self.tag} from {self.laid_from} ({self.seconds:.1f} s)"


@dataclass(frozen=True)
class FetchResult:
    checkouts: tuple[Checkout, ...]
    exit_code: ClassVar[int] = 0


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_hash(path: Path, pinned: PinnedFile, what: str) -> None:
    actual = sha256_of(path)
    if actual != pinned.sha256:
        raise CarryError(
            f"{what} {pinned.filename} has sha256 {actual} but the pin says {pinned.sha256}: "
            "check the pin in upstream/ or remove the file and fetch again"
        )


def download(
    project: Project, target: Target, pinned: PinnedFile, runner: Runner, report: Reporter = SILENT
) -> Path:
    """The pinned file in the download cache, fetched if absent or not matching its pin (an
    interrupted download, say); never used, and never replaced, unless the new file's hash matches."""
    cached = project.downloads_dir / pinned.filename
    if cached.exists():
        actual = sha256_of(cached)
        if actual == pinned.sha256:
            report.step(f"fetch: {pinned.filename}: cached, sha256 ok")
            return cached
        report.step(
            f"fetch: cached {pinned.filename} has sha256 {actual[:16]}…, not the pinned "
            f"{pinned.sha256[:16]}… (an interrupted download?): downloading it again"
        )
    project.downloads_dir.mkdir(parents=True, exist_ok=True)
    watch = Stopwatch()
    with tempfile.TemporaryDirectory(dir=project.downloads_dir, prefix=".incoming-") as tmp:
        incoming = Path(tmp)
        report.step(f"fetch: downloading {pinned.filename}")
        wanted = Wanted(
            target.name, target.version, pinned.filename, pinned.url, f"upstream/{target.name}.toml"
        )
        pinned.kind.download(wanted, incoming, runner, report)
        fetched = incoming / pinned.filename
        if not fetched.exists():
            found = ", ".join(p.name for p in incoming.iterdir()) or "nothing"
            raise CarryError(f"download of {pinned.filename} produced {found}: check the pin's filename")
        check_hash(fetched, pinned, "downloaded")
        size = fetched.stat().st_size
        fetched.replace(cached)
    report.step(f"fetch: {pinned.filename}: downloaded {megabytes(size)}, sha256 ok ({watch})")
    return cached


def extract_pristine(artifact: Path, tree: Path, source_subdir: str) -> None:
    """Unpack an official artifact's sources into ``tree`` (under ``source_subdir``)."""
    root = tree / source_subdir if source_subdir else tree
    root.mkdir(parents=True, exist_ok=True)
    kind_of(artifact.name).extract(artifact, root)


def lay_checkout(
    project: Project, target: Target, artifact: Path, runner: Runner, report: Reporter = SILENT
) -> Checkout:
    """Record the pristine tree as tag ``upstream/<version>`` in ``upstream/<name>/``."""
    repo = project.checkout(target.name)
    git = Git(repo, runner)
    if not git.exists():
        repo.mkdir(parents=True, exist_ok=True)
        git.run("init", "--quiet")
        (repo / ".git" / "info").mkdir(exist_ok=True)
        (repo / ".git" / "info" / "exclude").write_text(IGNORED_IN_CHECKOUT)
    if git.rev(target.upstream_tag):
        return Checkout(target.name, target.version, target.upstream_tag, CheckoutState.PRESENT, 0.0)
    watch = Stopwatch()
    report.step(f"fetch: laying down {target.upstream_tag} in upstream/{target.name}")
    project.scratch_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=project.scratch_dir, prefix="pristine-") as tmp:
        tree = Path(tmp) / "tree"
        extract_pristine(artifact, tree, target.upstream.source_subdir)
        index_env = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        git.run(f"--work-tree={tree}", "add", "--all", "--force", ".", env=index_env)
        tree_id = git.out("write-tree", env=index_env)
    parent = _previous_upstream(git, target)
    message = (
        f"{target.name} {target.version}: pristine upstream\n\n"
        f"Unpacked from {artifact.name}\n"
        f"(sha256 {sha256_of(artifact)}), upstream tag {target.release.git_tag}.\n"
    )
    parent_args = ["-p", parent] if parent else []
    commit = git.out("commit-tree", tree_id, *parent_args, "-m", message, env=PRISTINE_AUTHOR)
    git.run("tag", target.upstream_tag, commit)
    if git.rev("HEAD") is None:
        git.run("checkout", "--quiet", "-B", target.branch, target.upstream_tag)
    return Checkout(
        target.name,
        target.version,
        target.upstream_tag,
        CheckoutState.LAID,
        round(watch.seconds, 1),
        artifact.name,
    )


def _previous_upstream(git: Git, target: Target) -> str | None:
    """The newest older pristine tree, so that upstream tags form a history that rebases follow."""
    older = [
        release.version
        for release in target.upstream.releases
        if release.parsed_version < target.release.parsed_version and git.rev(f"upstream/{release.version}")
    ]
    if not older:
        return None
    newest = max(older, key=lambda v: target.upstream.release(v).parsed_version)
    return git.rev(f"upstream/{newest}")


def fetch(
    project: Project, targets: list[Target], runner: Runner = run_subprocess, report: Reporter = SILENT
) -> FetchResult:
    laid = []
    for target in targets:
        artifact = download(project, target, select_file(target.release), runner, report)
        checkout = lay_checkout(project, target, artifact, runner, report)
        report.step(f"fetch: {checkout.describe()}")
        laid.append(checkout)
    return FetchResult(tuple(laid))
