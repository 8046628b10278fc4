from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from installer.exceptions import InstallerError
from installer.sources import WheelFile

from sglang_carry import build as wheel_build
from sglang_carry.build import PROVENANCE_FILE, build
from sglang_carry.errors import CarryError
from sglang_carry.kinds import wheel as wheel_kind
from sglang_carry.kinds.wheel import verify_wheel_record
from sglang_carry.patching import apply, export

from .conftest import DemoProject, git, patch_message

CORE = "python/demo/core.py"


def carry_fix(demo: DemoProject) -> None:
    demo.fetch()
    demo.commit_change(CORE, "def answer():\n    return 42\n", patch_message("Fix the answer"))
    demo.commit_change("python/demo/extra.py", "EXTRA = True\n", patch_message("Add extra"))
    export(demo.project, demo.target())


def test_wheel_has_local_version_provenance_and_record(demo: DemoProject) -> None:
    carry_fix(demo)
    path = build(demo.project, demo.target())
    assert path.name == "demo-1.0+carry.1-py3-none-any.whl"
    assert path.parent == demo.root / "dist"
    with zipfile.ZipFile(path) as built:
        names = built.namelist()
        assert "demo-1.0+carry.1.dist-info/METADATA" in names
        assert not any(name.startswith("demo-1.0.dist-info/") for name in names)
        assert b"Version: 1.0+carry.1\n" in built.read("demo-1.0+carry.1.dist-info/METADATA")
        assert built.read("demo/core.py") == b"def answer():\n    return 42\n"
        assert built.read("demo/extra.py") == b"EXTRA = True\n"
        assert built.read("demo/native.so") == b"\x7fELF not really\n"
        record = json.loads(built.read(f"demo-1.0+carry.1.dist-info/{PROVENANCE_FILE}"))
    assert record["version"] == "1.0+carry.1"
    assert record["upstream"]["file"] == demo.wheel.name
    assert record["upstream"]["sha256"] == hashlib.sha256(demo.wheel.read_bytes()).hexdigest()
    assert [p["file"] for p in record["series"]["patches"]] == [
        "0001-Fix-the-answer.patch",
        "0002-Add-extra.patch",
    ]
    assert [p["upstream_status"] for p in record["series"]["patches"]] == ["Pending", "Pending"]
    assert record["changed_files"] == ["demo/core.py", "demo/extra.py"]
    assert verify_wheel_record(path) == len(names)


def test_installed_wheel_reports_the_local_version(demo: DemoProject, tmp_path: Path) -> None:
    carry_fix(demo)
    path = build(demo.project, demo.target())
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(path),
        ],
        check=True,
    )
    probe = "import importlib.metadata as m, demo.core as c; print(m.version('demo'), c.answer())"
    result = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert result.stdout.split() == ["1.0+carry.1", "42"]


def test_two_builds_are_byte_identical(demo: DemoProject) -> None:
    carry_fix(demo)
    first = build(demo.project, demo.target()).read_bytes()
    git(demo.checkout, "checkout", "-q", "--detach")
    git(demo.checkout, "branch", "-D", "carry/1.0")
    apply(demo.project, demo.target())
    assert build(demo.project, demo.target()).read_bytes() == first


def test_line_that_carries_nothing_on_purpose_builds_revision_zero(demo: DemoProject) -> None:
    demo.fetch()
    demo.series_dir.mkdir(parents=True)
    (demo.series_dir / "carries-nothing").write_text("upstream 1.0 has every fix\n")
    path = build(demo.project, demo.target())
    assert path.name == "demo-1.0+carry.0-py3-none-any.whl"
    verify_wheel_record(path)


def test_failed_build_leaves_no_partial_file(demo: DemoProject, monkeypatch: pytest.MonkeyPatch) -> None:
    carry_fix(demo)

    def broken(source: Path, output: Path, *args: object) -> None:
        output.write_bytes(b"half a wheel")
        raise OSError("disk full")

    monkeypatch.setattr(wheel_kind, "write_wheel", broken)
    with pytest.raises(OSError, match=r"disk full"):
        build(demo.project, demo.target())
    assert not (demo.root / "dist").exists() or list((demo.root / "dist").iterdir()) == []
    assert list((demo.root / "build").glob("*.partial")) == []


def test_build_refuses_a_branch_that_differs_from_patches(demo: DemoProject) -> None:
    carry_fix(demo)
    demo.commit_change(CORE, "def answer():\n    return 0\n", patch_message("Not exported"))
    with pytest.raises(CarryError, match=r"carry/1.0 in upstream/demo differs from patches/demo/1.0"):
        build(demo.project, demo.target())


def test_build_refuses_a_series_changed_since_its_revision(demo: DemoProject) -> None:
    carry_fix(demo)
    patch = demo.series_dir / "0002-Add-extra.patch"
    patch.write_text(patch.read_text().replace("Why this change", "Why that change"))
    with pytest.raises(CarryError, match=r"edited by hand since revision 1 was recorded: `carry apply"):
        build(demo.project, demo.target())


REVISIONS_REFUSED = {
    "-5": "a revision is a positive integer",
    "0": "a revision is a positive integer",
    "true": "wrong field types",
    '"2"': "wrong field types",
    "1.5": "wrong field types",
}


@pytest.mark.parametrize("value", REVISIONS_REFUSED)
def test_a_revision_that_is_not_a_positive_integer_is_refused(demo: DemoProject, value: str) -> None:
    """`revision = -5` would build `+carry.-5` (not PEP 440), `true` `+carry.True`: one line that
    names the file, what is wrong and the way back, and nothing is built."""
    carry_fix(demo)
    revision = demo.series_dir / "revision"
    revision.write_text(revision.read_text().replace("revision = 1", f"revision = {value}"))
    with pytest.raises(CarryError) as refused:
        build(demo.project, demo.target())
    message = str(refused.value)
    assert message.startswith("patches/demo/1.0/revision ") and "\n" not in message
    assert REVISIONS_REFUSED[value] in message
    assert "git checkout -- patches/demo/1.0/revision" in message
    assert not list((demo.root / "dist").glob("*.whl"))


def test_a_revision_changed_by_hand_is_refused_by_its_recorded_number(demo: DemoProject) -> None:
    """The recorded digest covers the revision: a revision 2 series set back to 1 would build a
    second, different `+carry.1`. Build names both numbers; status shows it and fails."""
    carry_fix(demo)
    demo.commit_change(CORE, "def answer():\n    return 43\n", patch_message("Fix it again"))
    export(demo.project, demo.target())
    assert build(demo.project, demo.target()).name == "demo-1.0+carry.2-py3-none-any.whl"
    revision = demo.series_dir / "revision"
    revision.write_text(revision.read_text().replace("revision = 2", "revision = 1"))
    with pytest.raises(
        CarryError,
        match=r"revision says revision 1, but `carry export` recorded these patches as revision 2",
    ):
        build(demo.project, demo.target())


def test_build_refuses_uncommitted_edits_it_would_leave_out(demo: DemoProject) -> None:
    """The wheel is built from the branch: an edit not committed there would be missing from it."""
    carry_fix(demo)
    (demo.checkout / CORE).write_text("def answer():\n    return 44\n")
    with pytest.raises(CarryError, match=r"upstream/demo has uncommitted changes \(python/demo/core.py\)"):
        build(demo.project, demo.target())
    assert not list((demo.root / "dist").glob("*.whl"))


def test_record_check_catches_tampering(demo: DemoProject, tmp_path: Path) -> None:
    carry_fix(demo)
    path = build(demo.project, demo.target())
    tampered = tmp_path / path.name
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tampered, "w") as out:
        for info in src.infolist():
            data = src.read(info)
            out.writestr(info, b"def answer():\n    return 0\n" if info.filename == "demo/core.py" else data)
    with pytest.raises(CarryError, match=r"RECORD hash of demo/core.py does not match"):
        verify_wheel_record(tampered)
    # installer, which checks RECORD with its own code, agrees on both wheels.
    with zipfile.ZipFile(path) as built:
        WheelFile(built).validate_record()
    with zipfile.ZipFile(tampered) as bad, pytest.raises(InstallerError, match=r"demo/core.py"):
        WheelFile(bad).validate_record()


def test_sdist_build_is_versioned_and_reproducible(demo: DemoProject) -> None:
    demo.fetch("tiny")
    tree = demo.root / "upstream" / "tiny"
    demo.commit_change("tiny/__init__.py", "X = 2\n", patch_message("Fix X"), repo=tree)
    export(demo.project, demo.target("tiny"))
    path = build(demo.project, demo.target("tiny"))
    assert path.name == "tiny-0.3+carry.1.tar.gz"
    first = path.read_bytes()
    assert build(demo.project, demo.target("tiny")).read_bytes() == first
    with tarfile.open(path) as sdist:
        names = sdist.getnames()
        assert all(name.startswith("tiny-0.3+carry.1/") for name in names)

        def read(relative: str) -> bytes:
            handle = sdist.extractfile(f"tiny-0.3+carry.1/{relative}")
            assert handle is not None
            return handle.read()

        assert read("tiny/__init__.py") == b"X = 2\n"
        assert b"Version: 0.3+carry.1" in read("PKG-INFO")
        assert b'version = "0.3+carry.1"' in read("pyproject.toml")
        assert json.loads(read(PROVENANCE_FILE))["series"]["revision"] == 1


def test_read_only_dist_is_one_line(
    demo: DemoProject, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    carry_fix(demo)
    dist = demo.root / "dist"
    real_copyfile = shutil.copyfile

    # The tests run as root, which chmod cannot stop, so the read-only filesystem is simulated
    # where the build first writes into dist/.
    def read_only_dist(src: Any, dst: Any, **kwargs: Any) -> Any:
        if Path(dst).parent == dist:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(dst))
        return real_copyfile(src, dst, **kwargs)

    monkeypatch.setattr(shutil, "copyfile", read_only_dist)
    capsys.readouterr()
    assert demo.carry("build", "demo") == 1
    captured = capsys.readouterr()
    assert captured.err == (
        "carry build: error: cannot write dist/demo-1.0+carry.1-py3-none-any.whl (Read-only file system): "
        f"make {dist} writable (or remove it) and run `carry build` again\n"
    )
    assert list(dist.iterdir()) == []
    assert list((demo.root / "build").glob("*.partial")) == []


def test_dist_on_another_filesystem(demo: DemoProject, monkeypatch: pytest.MonkeyPatch) -> None:
    carry_fix(demo)
    real_replace = os.replace

    def no_cross_device_rename(src: Any, dst: Any) -> None:
        if Path(src).parent != Path(dst).parent:
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), str(src), None, str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", no_cross_device_rename)
    path = build(demo.project, demo.target())
    assert verify_wheel_record(path) > 0
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_non_ascii_subject_is_decoded_in_the_provenance_record(demo: DemoProject) -> None:
    demo.fetch()
    demo.commit_change(
        CORE, "def answer():\n    return 42\n", patch_message("Fix the naïve cache — für alle")
    )
    demo.commit_empty(patch_message("Upstream hat es schon (grüß dich)", status="Applied-Upstream"))
    export(demo.project, demo.target())
    assert "=?UTF-8?q?" in next(demo.series_dir.glob("0001-*.patch")).read_text()
    with zipfile.ZipFile(build(demo.project, demo.target())) as built:
        record = json.loads(built.read(f"demo-1.0+carry.1.dist-info/{PROVENANCE_FILE}"))
    subjects = [p["subject"] for p in record["series"]["patches"]]
    assert subjects == ["Fix the naïve cache — für alle", "Upstream hat es schon (grüß dich)"]
    exported = demo.snapshot(demo.series_dir)
    git(demo.checkout, "checkout", "-q", "--detach")
    git(demo.checkout, "branch", "-D", "carry/1.0")
    apply(demo.project, demo.target())
    export(demo.project, demo.target())
    assert demo.snapshot(demo.series_dir) == exported


def test_artifact_name_comes_from_the_file_name(tmp_path: Path) -> None:
    wheel_path = tmp_path / "sgl_kernel-0.5.20-cp311-cp311-manylinux_2_34_x86_64.whl"
    assert (
        wheel_build.artifact_name(wheel_path, "0.5.20", "0.5.20+carry.2")
        == "sgl_kernel-0.5.20+carry.2-cp311-cp311-manylinux_2_34_x86_64.whl"
    )
    assert wheel_build.artifact_name(tmp_path / "kvcached-0.1.6.tar.gz", "0.1.6", "0.1.6+carry.1") == (
        "kvcached-0.1.6+carry.1.tar.gz"
    )
    with pytest.raises(CarryError, match=r"is version 0.1.7, not the pinned 0.1.6"):
        wheel_build.artifact_name(tmp_path / "kvcached-0.1.7.tar.gz", "0.1.6", "0.1.6+carry.1")


def test_all_platforms_builds_every_pinned_file_downloading_only_the_pins(demo: DemoProject) -> None:
    """A line pins a wheel per Python and platform; --all-platforms builds each (their tags kept,
    only the pure-Python files the series changes replaced), downloading the pinned ones."""
    carry_fix(demo)
    other = demo.artifacts / "other" / "demo-1.0-cp312-cp312-manylinux_2_34_aarch64.whl"
    other.parent.mkdir()
    shutil.copyfile(demo.wheel, other)
    digest = hashlib.sha256(other.read_bytes()).hexdigest()
    pin = demo.root / "upstream" / "demo.toml"
    pin.write_text(pin.read_text() + f'\n[[release.files]]\nfilename = "{other.name}"\nsha256 = "{digest}"\n')
    demo.pip.files["demo==1.0 manylinux_2_34_aarch64"] = other
    assert wheel_build.build_all(demo.project, [demo.target()], demo.pip, all_platforms=True).exit_code == 0
    names = sorted(p.name for p in (demo.root / "dist").glob("*.whl"))
    assert names == [
        "demo-1.0+carry.1-cp312-cp312-manylinux_2_34_aarch64.whl",
        "demo-1.0+carry.1-py3-none-any.whl",
    ]
    downloads = [call[-1] for call in demo.pip.calls]
    assert downloads.count("demo==1.0") == 2  # the fetch's, and the other platform's: nothing else
    with zipfile.ZipFile(demo.root / "dist" / names[0]) as built:
        assert built.read("demo/core.py").decode() == "def answer():\n    return 42\n"


def test_a_full_build_folder_names_the_file(
    demo: DemoProject, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The disk fills while the wheel is written: the one line named "a file"; now the wheel in
    progress, and dist/ is left without it."""
    carry_fix(demo)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(wheel_kind, "write_wheel", full)
    assert demo.carry("build", "demo") == 1
    [line] = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith(f"carry build: error: {demo.root / 'build'}/tmp")
        and ".partial: No space left" in line
    )
    assert not list((demo.root / "dist").glob("*.whl"))
