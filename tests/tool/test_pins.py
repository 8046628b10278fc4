from __future__ import annotations

from pathlib import Path

import pytest

from sglang_carry.errors import CarryError
from sglang_carry.pins import load_upstream, select_file
from sglang_carry.project import select_targets

from .conftest import DemoProject


def test_newest_line_is_the_default(demo: DemoProject) -> None:
    path = demo.root / "upstream" / "demo.toml"
    path.write_text(
        path.read_text()
        + '\n[[release]]\nversion = "1.10"\ngit_tag = "v1.10"\n\n[[release.files]]\n'
        + f'filename = "demo-1.10-py3-none-any.whl"\nsha256 = "{"a" * 64}"\n'
    )
    assert select_targets(demo.project, ["demo"], None)[0].version == "1.10"
    assert select_targets(demo.project, ["demo"], "1.0")[0].version == "1.0"


def test_unknown_version_names_the_pins(demo: DemoProject) -> None:
    with pytest.raises(CarryError, match=r"demo 9\.9 is not pinned \(pinned: 1\.0\)"):
        select_targets(demo.project, ["demo"], "9.9")
    with pytest.raises(CarryError, match=r"no upstream has version 9.9 pinned"):
        select_targets(demo.project, [], "9.9")


def test_unknown_package(demo: DemoProject) -> None:
    with pytest.raises(CarryError, match=r"unknown upstream 'nope'"):
        select_targets(demo.project, ["nope"], None)


def test_bad_hash_in_pin_is_refused(tmp_path: Path) -> None:
    pin = tmp_path / "x.toml"
    pin.write_text(
        'name = "x"\n[[release]]\nversion = "1"\ngit_tag = "v1"\n'
        '[[release.files]]\nfilename = "x-1.tar.gz"\nsha256 = "abc"\n'
    )
    with pytest.raises(CarryError, match=r"not 64 hex digits"):
        load_upstream(pin)


def test_wheel_for_this_interpreter_is_selected(demo: DemoProject) -> None:
    assert select_file(demo.target().release).filename == demo.wheel.name
