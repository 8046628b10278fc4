from __future__ import annotations

import re
from typing import Any

import pytest

from sglang_carry.errors import CarryError
from sglang_carry.fetch import CheckoutState, fetch
from sglang_carry.progress import Recorder
from sglang_carry.runner import Completed

from .conftest import DEMO_FILES, DemoProject, git, make_wheel, sha256_file


def test_fetch_lays_a_pristine_checkout(demo: DemoProject) -> None:
    demo.fetch()
    assert (demo.checkout / "python" / "demo" / "core.py").read_text() == "def answer():\n    return 41\n"
    assert not list(demo.checkout.glob("python/*.dist-info"))
    assert git(demo.checkout, "rev-parse", "--abbrev-ref", "HEAD").stdout.strip() == "carry/1.0"
    assert git(demo.checkout, "rev-list", "--count", "upstream/1.0").stdout.strip() == "1"
    assert len(demo.pip.calls) == 1
    assert "--only-binary=:all:" in demo.pip.calls[0]


def test_fetch_twice_reuses_the_download_and_the_tag(demo: DemoProject) -> None:
    demo.fetch()
    first = git(demo.checkout, "rev-parse", "upstream/1.0").stdout
    demo.fetch()
    assert len(demo.pip.calls) == 1
    assert git(demo.checkout, "rev-parse", "upstream/1.0").stdout == first


def test_pristine_commit_is_reproducible(demo: DemoProject) -> None:
    demo.fetch()
    first = git(demo.checkout, "rev-parse", "upstream/1.0").stdout
    git(demo.root, "init", "-q", check=False)
    import shutil

    shutil.rmtree(demo.checkout)
    demo.fetch()
    assert git(demo.checkout, "rev-parse", "upstream/1.0").stdout == first


def test_download_hash_mismatch_names_both_hashes(demo: DemoProject) -> None:
    tampered = demo.artifacts / "tampered" / demo.wheel.name
    tampered.parent.mkdir()
    tampered.write_bytes(demo.wheel.read_bytes() + b"x")
    demo.pip.files["demo==1.0"] = tampered
    with pytest.raises(CarryError) as failure:
        fetch(demo.project, [demo.target()], demo.pip)
    message = str(failure.value)
    assert sha256_file(tampered) in message and sha256_file(demo.wheel) in message
    assert "\n" not in message
    assert not (demo.project.downloads_dir / demo.wheel.name).exists()
    assert not demo.checkout.exists()


def test_truncated_download_is_fetched_again(demo: DemoProject) -> None:
    demo.fetch()
    cached = demo.project.downloads_dir / demo.wheel.name
    cached.write_bytes(demo.wheel.read_bytes()[:100])
    report = Recorder()
    fetch(demo.project, [demo.target()], demo.pip, report)
    assert cached.read_bytes() == demo.wheel.read_bytes()
    assert len(demo.pip.calls) == 2
    assert "(an interrupted download?): downloading it again" in report.steps[0]


def test_bad_cached_download_is_kept_until_a_good_one_arrives(demo: DemoProject) -> None:
    demo.fetch()
    cached = demo.project.downloads_dir / demo.wheel.name
    cached.write_bytes(b"truncated")
    demo.pip.files.clear()
    with pytest.raises(CarryError, match=r"pip found no demo-1.0-py3-none-any.whl on its index"):
        fetch(demo.project, [demo.target()], demo.pip)
    assert cached.read_bytes() == b"truncated"


def test_pip_failure_is_one_line(demo: DemoProject) -> None:
    """A file the index does not have is not a network problem (it said "check the network")."""
    demo.pip.files.clear()
    with pytest.raises(CarryError) as refused:
        fetch(demo.project, [demo.target()], demo.pip)
    message = str(refused.value)
    assert "\n" not in message and "No matching distribution" in message
    assert "check the pin's version and file name in upstream/demo.toml" in message
    assert "network" not in message


def test_a_pip_that_cannot_reach_its_index_says_check_the_network(demo: DemoProject) -> None:
    def unreachable(args: Any, **kwargs: Any) -> Completed:
        return Completed(
            tuple(args), 1, "", "ERROR: Could not install packages due to an OSError: [Errno 101]"
        )

    with pytest.raises(
        CarryError, match=r"pip could not download .*Errno 101.*: check the network and the pin"
    ):
        fetch(demo.project, [demo.target()], unreachable)


def test_sdist_comes_from_its_pinned_url(demo: DemoProject) -> None:
    demo.fetch("tiny")
    tree = demo.root / "upstream" / "tiny"
    assert (tree / "tiny" / "__init__.py").read_text() == "X = 1\n"
    assert (tree / "PKG-INFO").exists()
    assert demo.pip.calls == []


def test_wheel_member_outside_the_tree_is_refused(demo: DemoProject) -> None:
    (demo.artifacts / "evil").mkdir()
    evil = make_wheel(demo.artifacts / "evil", "demo", "1.0", {**DEMO_FILES, "../../escaped.py": "X = 1\n"})
    demo.write_pin("demo", "python", "1.0", evil.name, sha256_file(evil))
    demo.pip.files["demo==1.0"] = evil
    with pytest.raises(CarryError, match=r"holds \.\./\.\./escaped\.py, which would unpack outside"):
        fetch(demo.project, [demo.target()], demo.pip)
    assert not list(demo.root.rglob("escaped.py"))
    assert git(demo.checkout, "tag").stdout == ""


def test_fetch_reports_each_long_step_with_its_duration(demo: DemoProject) -> None:
    report = Recorder()
    result = fetch(demo.project, [demo.target()], demo.pip, report)
    out = report.steps
    assert [checkout.state for checkout in result.checkouts] == [CheckoutState.LAID]
    assert re.fullmatch(
        r"fetch: demo-1\.0-py3-none-any\.whl: downloaded [\d.]+ MB, sha256 ok \([\d.]+ s\)", out[1]
    )
    assert re.fullmatch(
        r"fetch: demo 1\.0: laid upstream/1\.0 from demo-1\.0-py3-none-any\.whl \([\d.]+ s\)", out[3]
    )
