"""Pin a new upstream release from the package index: its files and sha256 read from the index's
PEP 691 JSON API, chosen to be the same kinds of file the previous line pins, and appended to
``upstream/<name>.toml`` in that file's own style for the user to review and commit."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import (
    canonicalize_name,
)
from packaging.version import Version

from .errors import CarryError
from .files import write_atomically
from .kinds import parse_or_none
from .pins import PinnedFile, Release

DEFAULT_INDEX = "https://pypi.org/simple"
# The index `carry rebase` reads; a file:// index (a folder with <name>/index.json) works offline.
INDEX_ENV = "CARRY_INDEX_URL"
SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
INDEX_FILE = "index.json"

# url -> the response body; raises CarryError. Tests pass their own.
Fetcher = Callable[[str], bytes]


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str
    yanked: bool


INDEX_SCHEMES = ("https", "http", "file")


def index_url(option: str | None) -> str:
    url = (option or os.environ.get(INDEX_ENV) or DEFAULT_INDEX).rstrip("/")
    if urllib.parse.urlparse(url).scheme not in INDEX_SCHEMES:
        source = "--index-url" if option else f"${INDEX_ENV}"
        raise CarryError(
            f"{source} '{url}' is not an index URL: give an https:// (or http://) simple index, or "
            "file:///a/folder holding <name>/index.json"
        )
    return url


def fetch_url(url: str) -> bytes:
    """GET ``url`` asking for the simple JSON API; a file:// folder is read as its index.json."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = Path(urllib.request.url2pathname(parsed.path))
        root = path.parent  # the index: a folder with <name>/index.json
        if not root.is_dir():
            raise CarryError(
                f"the index folder {root} does not exist: check --index-url (a file:// index is a "
                f"folder holding <name>/{INDEX_FILE})"
            )
        if not path.is_file():
            path = path / INDEX_FILE
        if not path.exists():
            raise CarryError(
                f"the index {root} has no {path.relative_to(root)}: add it (the package's PEP 691 "
                "page), or check --index-url"
            )
        try:
            return path.read_bytes()
        except OSError as exc:
            raise CarryError(f"cannot read the index file {path} ({exc.strerror or exc})") from exc
    request = urllib.request.Request(url, headers={"Accept": SIMPLE_JSON})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            body: bytes = response.read()
            return body
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise CarryError(
                f"{url} does not exist (HTTP 404): check the package name and the index"
            ) from exc
        raise CarryError(
            f"{url} answered HTTP {exc.code}: try again later or pass another --index-url"
        ) from exc
    except OSError as exc:
        raise CarryError(f"cannot read {url} ({exc}): check the network or pass --index-url") from exc


def index_files(name: str, index: str, fetch: Fetcher = fetch_url) -> list[IndexFile]:
    url = f"{index}/{canonicalize_name(name)}/"
    try:
        data = json.loads(fetch(url))
        files = [
            IndexFile(
                filename=str(raw["filename"]),
                url=urllib.parse.urljoin(url, str(raw["url"])),
                sha256=str(raw["hashes"]["sha256"]).lower(),
                yanked=bool(raw.get("yanked", False)),
            )
            for raw in data["files"]
            if "sha256" in raw.get("hashes", {})
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise CarryError(f"{url} is not a PEP 691 JSON index page ({exc!r}): check --index-url") from exc
    return files


def file_version(filename: str) -> Version | None:
    parsed = parse_or_none(filename)
    return None if parsed is None else parsed[1]


def newest_version(name: str, files: Sequence[IndexFile]) -> Version | None:
    """The newest final release on the index (what the nightly canary rebases onto)."""
    versions = {
        v
        for f in files
        if not f.yanked and (v := file_version(f.filename)) is not None and not v.is_prerelease
    }
    return max(versions) if versions else None


def _matching(old: PinnedFile, candidates: Sequence[IndexFile]) -> IndexFile | None:
    """The new release's file of the same kind as ``old`` (kinds/: the same tags for a wheel)."""
    by_name = {candidate.filename: candidate for candidate in candidates}
    match = old.kind.counterpart(old.filename, list(by_name))
    return None if match is None else by_name[match]


def release_from_index(old: Release, version: str, files: Sequence[IndexFile], index: str) -> Release:
    """The pin of ``version``: for each file ``old`` pins, the same kind of file of the new release
    with the index's sha256 (and its url where ``old`` pins one)."""
    wanted = Version(version)
    candidates = [f for f in files if file_version(f.filename) == wanted]
    if not candidates:
        newest = newest_version(old.name, files)
        newest_text = f" (newest there: {newest})" if newest else ""
        raise CarryError(
            f"{old.name} {version} is not on {index}{newest_text}: check the version, or pass "
            "another --index-url"
        )
    live = [f for f in candidates if not f.yanked]
    if not live:
        raise CarryError(f"{old.name} {version} is yanked on {index}: pick another release")
    pinned = []
    for old_file in old.files:
        match = _matching(old_file, live)
        if match is None:
            raise CarryError(
                f"{old.name} {version} on {index} has no file of the kind {old.version} pins as "
                f"{old_file.filename} ({len(live)} file(s) there): pin the release by hand in "
                f"upstream/{old.name}.toml"
            )
        pinned.append(PinnedFile(match.filename, match.sha256, match.url if old_file.url else None))
    git_tag = old.git_tag.replace(old.version, version) if old.version in old.git_tag else f"v{version}"
    # The new release starts in the old line's test environment; a release whose own pins need
    # another one says so with test_env when the pin is reviewed.
    return Release(old.name, version, git_tag, tuple(pinned), test_env=old.test_env)


def render_release(release: Release) -> str:
    """A [[release]] table in the style of the committed pin files."""
    lines = ["", "[[release]]", f'version = "{release.version}"', f'git_tag = "{release.git_tag}"']
    if release.test_env is not None:
        lines.append(f'test_env = "{release.test_env}"')
    for pinned in release.files:
        lines += ["", "[[release.files]]", f'filename = "{pinned.filename}"', f'sha256 = "{pinned.sha256}"']
        if pinned.url:
            lines.append(f'url = "{pinned.url}"')
    return "\n".join(lines) + "\n"


def append_release(pin_file: Path, release: Release) -> None:
    data = pin_file.read_bytes()
    newline = b"\r\n" if b"\r\n" in data else b"\n"
    if data and not data.endswith(b"\n"):
        data += newline
    addition = render_release(release).encode("utf-8").replace(b"\n", newline)
    write_atomically(pin_file, data + addition, pin_file.stat().st_mode & 0o777)
