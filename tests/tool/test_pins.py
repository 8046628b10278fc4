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


# How a pin file goes wrong -> what its one error line must say.
BROKEN_PINS: dict[str, tuple[str, str]] = {
    "files is a string": ('files = "x"', "'files' must be [[release.files]] tables, not str 'x'"),
    "url is a number": ("url = 42", "'url' must be a string, not a number (42)"),
    "version is a float": ("version = 1.5", "'version' must be a string, not a number (1.5) (quote it"),
    "sha265 typo": ('sha265 = "x"', "unknown field 'sha265' (the fields here are: filename, sha256, url)"),
}


@pytest.mark.parametrize("case", BROKEN_PINS)
def test_a_wrong_field_is_one_line_naming_file_release_and_field(
    demo: DemoProject, case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    pin = demo.root / "upstream" / "demo.toml"
    line, expected = BROKEN_PINS[case]
    text = pin.read_text()
    if line.startswith("version"):
        text = text.replace('version = "1.0"', line)
    elif line.startswith("files"):
        text = f'name = "demo"\n\n[[release]]\nversion = "1.0"\ngit_tag = "v1.0"\n{line}\n'
    else:
        text = text.replace("[[release.files]]\n", f"[[release.files]]\n{line}\n", 1)
    pin.write_text(text)
    assert demo.carry("status", "demo") == 1
    [error] = capsys.readouterr().err.strip().splitlines()
    assert error.startswith(f"carry status: error: {pin} ([[release]] 1")
    assert expected in error


def test_a_list_of_versions_instead_of_release_tables(tmp_path: Path) -> None:
    pin = tmp_path / "x.toml"
    pin.write_text('name = "x"\nrelease = ["0.1.6"]\n')
    with pytest.raises(
        CarryError, match=r"'release' must be \[\[release\]\] tables, not a list holding str '0.1.6'"
    ):
        load_upstream(pin)


def test_a_name_that_is_not_the_files_is_refused_not_dropped(demo: DemoProject) -> None:
    """`name = "sglang"` inside upstream/kvcached.toml made kvcached vanish from status and build."""
    pin = demo.root / "upstream" / "demo.toml"
    pin.write_text(pin.read_text().replace('name = "demo"', 'name = "other"'))
    with pytest.raises(CarryError, match=r"says name = 'other', but a pin file is named after its package"):
        select_targets(demo.project, [], None)


def test_a_release_pinned_twice_is_refused(demo: DemoProject) -> None:
    pin = demo.root / "upstream" / "demo.toml"
    first = pin.read_text()
    pin.write_text(first + "\n" + first[first.index("[[release]]") :])
    with pytest.raises(
        CarryError, match=r'pins demo 1.0 twice: keep one \[\[release\]\] with version = "1.0"'
    ):
        load_upstream(pin)


def test_a_pin_file_that_is_not_utf8(tmp_path: Path) -> None:
    pin = tmp_path / "x.toml"
    pin.write_bytes(b'name = "x\xff"\n')
    with pytest.raises(CarryError, match=r"x.toml: is not UTF-8 \(byte 9\): save it as UTF-8"):
        load_upstream(pin)
