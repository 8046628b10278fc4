"""A PEP 503 simple index of dist/, so that a team installs the patched artifacts with
`pip install --extra-index-url file:///that/folder` (or serves the folder over HTTP).

The folder is self-contained: each project's page sits beside copies of its files, linked with
their sha256 (pip checks it), so it can be published as one artifact. It is written beside its
place and swapped in, like a series folder: a reader never sees half an index.
"""

from __future__ import annotations

import hashlib
import html
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .errors import CarryError
from .files import replace_folder
from .kinds import parse_or_none


@dataclass(frozen=True)
class IndexedFile:
    project: str  # canonical name
    path: Path  # in dist/
    sha256: str


@dataclass(frozen=True)
class IndexResult:
    folder: Path
    files: tuple[IndexedFile, ...]
    exit_code: ClassVar[int] = 0
    json_extra: ClassVar[tuple[str, ...]] = ("projects",)

    @property
    def projects(self) -> list[str]:
        return sorted({f.project for f in self.files})


def artifact_project(filename: str) -> str | None:
    """The canonical project a file of a known kind (kinds/) belongs to (None: none)."""
    parsed = parse_or_none(filename)
    return None if parsed is None else parsed[0]


def _page(title: str, links: list[tuple[str, str]]) -> bytes:
    rows = "".join(f'    <a href="{html.escape(href)}">{html.escape(text)}</a><br>\n' for href, text in links)
    return (
        '<!DOCTYPE html>\n<html>\n  <head><meta name="pypi:repository-version" content="1.0">'
        f"<title>{html.escape(title)}</title></head>\n  <body>\n{rows}  </body>\n</html>\n"
    ).encode()


# Marks a folder this module wrote, so that rewriting it never replaces a folder it did not.
MARKER = ".carry-simple-index"


def write_index(dist_dir: Path, folder: Path) -> IndexResult:
    """Write ``folder`` as a simple index of every wheel and sdist in ``dist_dir``."""
    if folder.exists() and not (folder / MARKER).exists() and any(folder.iterdir()):
        raise CarryError(
            f"{folder} exists and is not an index `carry index` wrote: name a new folder (it would be "
            "replaced as a whole); nothing was written"
        )
    candidates = dist_dir.glob("*") if dist_dir.is_dir() else iter(())
    found = sorted(p for p in candidates if p.is_file() and artifact_project(p.name))
    if not found:
        raise CarryError(f"{dist_dir} holds no wheel or sdist to index: run `carry build` first")
    tree: dict[str, bytes] = {}
    indexed: list[IndexedFile] = []
    for path in found:
        data = path.read_bytes()
        entry = IndexedFile(str(artifact_project(path.name)), path, hashlib.sha256(data).hexdigest())
        tree[f"{entry.project}/{path.name}"] = data
        indexed.append(entry)
    result = IndexResult(folder, tuple(indexed))
    for project in result.projects:
        links = [(f"{f.path.name}#sha256={f.sha256}", f.path.name) for f in indexed if f.project == project]
        tree[f"{project}/index.html"] = _page(f"Links for {project}", links)
    tree[MARKER] = b"written by `carry index`; rewritten as a whole by it\n"
    tree["index.html"] = _page("Simple index", [(f"{p}/", p) for p in result.projects])
    replace_folder(folder, tree)
    return result
