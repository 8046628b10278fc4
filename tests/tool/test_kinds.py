"""The artifact kinds: each file name goes to one kind, a file of no kind is refused where it is
pinned, and a new kind is one class in KINDS."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from packaging.version import Version

from sglang_carry import kinds
from sglang_carry.errors import CarryError
from sglang_carry.kinds import SDIST, WHEEL, kind_of
from sglang_carry.pins import PinnedFile, Release, load_upstream, select_file
from sglang_carry.progress import Reporter
from sglang_carry.registry import IndexFile, release_from_index
from sglang_carry.runner import Runner

SHA = "0" * 64
CP311 = "sglang-0.5.23-cp311-cp311-manylinux_2_34_x86_64.whl"


def test_each_file_name_has_one_kind() -> None:
    assert kind_of(CP311) is WHEEL and kind_of("kvcached-0.1.6.tar.gz") is SDIST
    assert (
        WHEEL.renamed(CP311, "0.5.23+carry.9")
        == "sglang-0.5.23+carry.9-cp311-cp311-manylinux_2_34_x86_64.whl"
    )
    assert SDIST.renamed("kvcached-0.1.6.tar.gz", "0.1.6+carry.3") == "kvcached-0.1.6+carry.3.tar.gz"
    assert WHEEL.parse(CP311) == ("sglang", Version("0.5.23"))
    with pytest.raises(CarryError, match=r"x-1.0.zip is none of the kinds of file the tool handles: wheel"):
        kind_of("x-1.0.zip")


def test_a_zip_sdist_is_refused_where_it_is_pinned(tmp_path: Path) -> None:
    """The registry used to pin a .zip sdist that neither extraction nor the repack could handle."""
    pin = tmp_path / "x.toml"
    pin.write_text(
        'name = "x"\n[[release]]\nversion = "1"\ngit_tag = "v1"\n'
        f'[[release.files]]\nfilename = "x-1.zip"\nsha256 = "{SHA}"\n'
    )
    with pytest.raises(CarryError, match=r"'x-1.zip' is none of the kinds of file the tool handles"):
        load_upstream(pin)


def test_a_new_release_is_pinned_file_by_file_by_each_kind() -> None:
    old = Release("sglang", "0.5.22", "v0.5.22", (PinnedFile(CP311.replace("0.5.23", "0.5.22"), SHA),))
    offered = [
        IndexFile("sglang-0.5.23.tar.gz", "https://x/a", SHA, False),
        IndexFile("sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", "https://x/b", SHA, False),
        IndexFile(CP311, "https://x/c", SHA, False),
    ]
    assert [f.filename for f in release_from_index(old, "0.5.23", offered, "https://x").files] == [CP311]


class Conda:
    """A kind the tool does not have: what adding one takes."""

    name = "conda"
    pattern = "*.conda"

    def matches(self, filename: str) -> bool:
        return filename.endswith(".conda")

    def parse(self, filename: str) -> tuple[str, Version]:
        name, version, _ = filename.removesuffix(".conda").split("-")
        return name, Version(version)

    def renamed(self, filename: str, local_version: str) -> str:
        name, _, build = filename.removesuffix(".conda").split("-")
        return f"{name}-{local_version}-{build}.conda"

    def fit_here(self, filename: str) -> int | None:
        return 0

    def download(self, wanted: kinds.Wanted, incoming: Path, runner: Runner, report: Reporter) -> None:
        raise NotImplementedError

    def extract(self, artifact: Path, root: Path) -> None:
        raise NotImplementedError

    def repack(self, source: Path, output: Path, repack: kinds.Repack) -> None:
        raise NotImplementedError

    def counterpart(self, pinned: str, candidates: Sequence[str]) -> str | None:
        return next((c for c in candidates if self.matches(c)), None)


def test_a_new_kind_is_one_class_in_kinds(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(kinds, "KINDS", (*kinds.KINDS, Conda()))
    pin = tmp_path / "x.toml"
    pin.write_text(
        'name = "x"\n[[release]]\nversion = "1"\ngit_tag = "v1"\n'
        f'[[release.files]]\nfilename = "x-1-py_0.conda"\nsha256 = "{SHA}"\n'
    )
    release = load_upstream(pin).release("1")
    assert select_file(release).kind.name == "conda"
    offered = [IndexFile("x-2-py_0.conda", "https://x/a", SHA, False)]
    assert release_from_index(release, "2", offered, "https://x").files[0].filename == "x-2-py_0.conda"
