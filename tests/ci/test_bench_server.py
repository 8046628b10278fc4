"""ci/bench/server.py: its statistics, its targets and its streamed request, against a stand-in."""

from __future__ import annotations

import json
import sys
import threading
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ci" / "e2e"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ci" / "bench"))
import server as bench
from e2e_harness.traffic import Request
from interrupted_driver import INTERRUPTS, assert_an_interrupt_kills_its_servers


def test_percentiles_and_summary() -> None:
    assert bench.percentile([5.0, 1.0, 3.0], 0.5) == 3.0
    assert bench.percentile([float(i) for i in range(100)], 0.99) == 98.0
    served = bench.Served("patched", 2.0, 4, 40, [0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 2.0, 3.0])
    numbers = bench.summary(served)
    assert numbers["requests_per_s"] == 2.0 and numbers["output_tokens_per_s"] == 20.0
    assert numbers["ttft_p99_ms"] == pytest.approx(400.0) and numbers["latency_median_ms"] == pytest.approx(
        1500.0
    )
    # No agreement (pristine, or a plain pool): no time in it, and no division by zero.
    assert numbers["agreement_us_per_all_reduce"] == 0.0 and numbers["agreement_share_of_pass"] == 0.0


def test_the_agreements_time_per_all_reduce_and_its_share_of_the_pass_are_printed() -> None:
    pristine = bench.Served("pristine", 2.0, 4, 40, [0.1], [1.0])
    patched = bench.Served("patched", 2.0, 4, 40, [0.1], [1.0], agreement_all_reduces=4, agreement_us=100_000)
    medians = {"pristine": bench.summary(pristine), "patched": bench.summary(patched)}
    assert medians["patched"]["agreement_us_per_all_reduce"] == 25_000.0
    assert medians["patched"]["agreement_share_of_pass"] == pytest.approx(0.05)
    ratios = dict.fromkeys(bench.TIMED, 1.0)
    rows = bench.table_lines(medians, ratios)
    assert any(row.split() == ["agreement", "us", "each", "0", "25000"] for row in rows), rows
    assert any(row.split() == ["agreement", "%", "of", "pass", "0.0%", "5.0%"] for row in rows), rows


def test_over_target_names_each_ratio_past_its_target() -> None:
    assert bench.over_target("tp1", {"requests_per_s": 0.98, "ttft_p99_ms": 1.05}) == []
    assert bench.over_target("tp2", {"requests_per_s": 0.97, "ttft_p99_ms": 1.06}) == [
        "tp2: throughput ratio 0.9700 < 0.98",
        "tp2: p99 TTFT ratio 1.0600 > 1.05",
    ]


def test_the_in_run_judgement_reads_each_patched_pass_share_of_the_agreement() -> None:
    """With a rank-local pool each pass's time inside the agreement (rank 0) must be at most 1 % of
    the pass; with a plain pool or one rank the patched server must make no collective at all."""
    at_target = bench.Served("patched", 10.0, 4, 40, agreement_all_reduces=200, agreement_us=100_000)
    over = bench.Served("patched", 10.0, 4, 40, agreement_all_reduces=200, agreement_us=101_000)
    assert bench.agreement_shares([at_target, over]) == pytest.approx([0.01, 0.0101])
    assert bench.over_in_run_target("tp2", True, [at_target, over]) == [
        "tp2: pass 2: the agreement took 1.01 % of the pass > 1 %"
    ]
    none = bench.Served("patched", 10.0, 4, 40)
    assert bench.over_in_run_target("tp2-plain", False, [none, none]) == []
    assert bench.over_in_run_target("tp2-plain", False, [none, at_target]) == [
        "tp2-plain: pass 2: 200 agreement all-reduce(s) without a rank-local pool (none expected)"
    ]
    line = "agreement % per pass    1.00 0.00; spread 0.00-1.00 %, stdev 0.50"
    assert bench.share_line([at_target, none]) == "  " + line


class Streamer(BaseHTTPRequestHandler):
    """Streams as sglang's /generate does (cumulative output ids, then [DONE]); a `last_finish`
    of None ends the stream unfinished."""

    last_finish: ClassVar[dict[str, Any] | None] = {"type": "length"}

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert request["stream"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        n = request["sampling_params"]["max_new_tokens"]
        for i in range(1, n + 1):
            finish = type(self).last_finish if i == n else None
            chunk = {
                "output_ids": list(range(i)),
                "meta_info": {"completion_tokens": i, "finish_reason": finish},
            }
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def port() -> Iterator[int]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Streamer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(httpd.server_address[1])
    finally:
        httpd.shutdown()
        Streamer.last_finish = {"type": "length"}


def test_a_streamed_request_reports_its_first_token_and_its_tokens(port: int) -> None:
    request = Request("a", [5, 6, 7])
    ttft, latency, tokens = bench.stream(port, request, 4)
    assert 0 < ttft <= latency and tokens == 4
    served = bench.serve_traffic("pristine", port, [request] * 3, 4, 2)
    assert served.failed == 0 and served.output_tokens == 12 and len(served.ttft_s) == 3


def test_an_unfinished_stream_is_a_failed_request(port: int) -> None:
    Streamer.last_finish = None
    with pytest.raises(ValueError, match="unfinished"):
        bench.stream(port, Request("a", [5]), 2)
    assert bench.serve_traffic("patched", port, [Request("a", [5])], 2, 1).failed == 1


def test_passes_alternate_in_abba_order_so_a_drift_weighs_on_both_wheels() -> None:
    assert bench.pass_order(3) == [
        (0, "pristine"),
        (0, "patched"),
        (1, "patched"),
        (1, "pristine"),
        (2, "pristine"),
        (2, "patched"),
    ]


def test_every_pass_sends_prompts_of_its_own() -> None:
    passes = [bench.plan_bench_traffic(seed) for seed in range(3)]
    prompts = [tuple(request.input_ids) for traffic in passes for request in traffic]
    assert len(passes[0]) == bench.PASS_REQUESTS and len(set(prompts)) == len(prompts)
    assert bench.plan_bench_traffic(1) == passes[1]
    assert len(bench.plan_bench_traffic(1, bench.ONE_RANK_PASS_REQUESTS)) == 4 * bench.PASS_REQUESTS


def test_a_wheels_passes_pool_into_one_and_each_pair_gives_a_ratio() -> None:
    first = bench.Served(
        "patched", 2.0, 4, 40, [0.1, 0.2], [1.0, 1.0], decode_steps=3, agreement_all_reduces=2
    )
    second = bench.Served(
        "patched", 6.0, 4, 40, [0.3, 0.9], [2.0, 3.0], decode_steps=5, agreement_all_reduces=1
    )
    whole = bench.pooled([first, second])
    assert (whole.seconds, whole.requests, whole.output_tokens) == (8.0, 8, 80)
    assert whole.ttft_s == [0.1, 0.2, 0.3, 0.9] and whole.latency_s == [1.0, 1.0, 2.0, 3.0]
    assert (whole.decode_steps, whole.agreement_all_reduces) == (8, 3)
    assert bench.summary(whole)["requests_per_s"] == 1.0
    pristine = [bench.Served("pristine", 2.0, 4, 40), bench.Served("pristine", 4.0, 4, 40)]
    assert bench.pair_throughput_ratios({"pristine": pristine, "patched": [first, second]}) == [
        1.0,
        4 / 6 / 1.0,
    ]


def test_the_control_serves_the_pristine_wheel_twice_and_its_pairs_are_its_second_over_its_first() -> None:
    (control,) = [case for case in bench.CASES if case[0] == "tp2-control"]
    assert control[3] == ("pristine", "pristine") and bench.SECOND["pristine"] == "pristine again"
    assert bench.pass_order(2, "pristine", "pristine again") == [
        (0, "pristine"),
        (0, "pristine again"),
        (1, "pristine again"),
        (1, "pristine"),
    ]
    first = [bench.Served("pristine", 2.0, 4, 40)]
    second = [bench.Served("pristine again", 4.0, 4, 40)]
    assert bench.pair_throughput_ratios({"pristine": first, "pristine again": second}) == [0.5]


def test_the_controls_misses_are_noise_and_a_cases_fail_the_run() -> None:
    over = {"requests_per_s": 0.9, "ttft_p99_ms": 1.0}
    noise_only = bench.misses_by_kind("tp2-control", ("pristine", "pristine"), over)
    assert noise_only == ([], ["tp2-control: throughput ratio 0.9000 < 0.98"])
    assert bench.misses_by_kind("tp2", ("pristine", "patched"), over) == (
        ["tp2: throughput ratio 0.9000 < 0.98"],
        [],
    )


def test_a_server_that_found_its_port_taken_starts_again_on_another(monkeypatch: pytest.MonkeyPatch) -> None:
    """The port is picked free before the server binds it, and the server beside it binds ports
    meanwhile: a start that lost its port is retried; any other failure, or the last attempt,
    stops the bench with the server's log named."""

    class FakeServer:
        def __init__(self, healthy: bool, taken: bool) -> None:
            self.healthy, self.taken, self.stopped, self.log = healthy, taken, False, Path("server.log")

        def wait_healthy(self, timeout_s: float) -> bool:
            return self.healthy

        def port_taken(self) -> bool:
            return self.taken

        def stop(self) -> None:
            self.stopped = True

    def starts(*outcomes: tuple[bool, bool]) -> list[FakeServer]:
        servers = [FakeServer(*outcome) for outcome in outcomes]
        queue = iter(servers)

        def launch(case: bench.Case, tree: str, site: Path, *where: Any) -> bench.Running:
            return bench.Running(case, tree, next(queue), 0, Path())  # type: ignore[arg-type]

        monkeypatch.setattr(bench, "launch", launch)
        return servers

    case = bench.Case("tp2", 2, True, (), (), 32, 8)
    servers = starts((False, True), (True, False))
    assert bench.start_healthy(case, "patched", Path()).server is servers[1]  # type: ignore[comparison-overlap]
    assert servers[0].stopped and not servers[1].stopped
    for outcomes in (((False, False),), ((False, True),) * bench.PORT_ATTEMPTS):
        servers = starts(*outcomes)
        with pytest.raises(RuntimeError, match="never became healthy"):
            bench.start_healthy(case, "patched", Path())
        assert all(server.stopped for server in servers)


_BENCH_MAIN = """
from types import SimpleNamespace
sys.path.insert(0, {bench!r})
import server as bench
line = SimpleNamespace(
    version="0.0", pristine_wheel=None, patched_wheel=None, python=sys.executable, server_deps=None
)
bench.cpu_line.prepare = lambda *args: line
bench.unpack_wheel = lambda wheel, site, python: site
bench.write_models = lambda folder, names: {{"dense": folder}}
bench.side_by_side = one_run_that_hangs
sys.exit(bench.main(["--cases", "tp1", "--out", {out!r}]))
"""


@INTERRUPTS
def test_an_interrupted_bench_kills_the_servers_of_the_case_in_progress(
    tmp_path: Path, signum: int, code: int, name: str
) -> None:
    """As the e2e's driver (test_e2e.py): a cancelled job must not leave the bench's servers on
    both cores under the next one."""
    main = _BENCH_MAIN.format(bench=str(Path(bench.__file__).parent), out=str(tmp_path))
    error_line = f"bench: error: stopped by {name}; its servers were killed, no report was written"
    assert_an_interrupt_kills_its_servers(main, tmp_path, signum, code, error_line)


class _StartedServer:
    """Server.start's stand-in: what a launch would run."""

    started: ClassVar[list[tuple[list[str], dict[str, str]]]] = []

    @classmethod
    def start(cls, command: list[str], env: dict[str, str], log: Path, port: int) -> str:
        cls.started.append((command, env))
        return "server"


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_server_is_started_with_its_devices_flags(
    device: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bench, "Server", _StartedServer)
    _StartedServer.started.clear()
    case = bench.Case("tp2", 2, True, bench.SIDE_BY_SIDE_FLAGS, (), 4, 2, device=device)
    bench.launch(case, "patched", tmp_path / "site", Path("/venv/bin/python"), [], tmp_path, tmp_path, {})
    ((command, env),) = _StartedServer.started
    assert command[0] == "/venv/bin/python" and command[command.index("--tp-size") + 1] == "2"
    assert env["CARRY_E2E_RANK_LOCAL"] == "1"
    if device == "cpu":
        assert command[command.index("--device") + 1] == "cpu" and env["SGLANG_CPU_OMP_THREADS_BIND"] == "0|1"
    else:
        # Nothing of the CPU engine; both servers of a case share the GPU(s), 0.3 of its memory each.
        assert "--device" not in command and "SGLANG_CPU_OMP_THREADS_BIND" not in env
        assert command[command.index("--mem-fraction-static") + 1] == "0.3"


def _passes(tree: str, requests_per_s: float) -> list[Any]:
    return [bench.Served(tree, 10.0, int(10 * requests_per_s), 100, [0.1] * 4, [1.0] * 4) for _ in range(2)]


@pytest.mark.parametrize(
    ("device", "code"),
    [("cpu", 0), ("cuda", 1)],
    ids=["cpu-judges-in-run", "cuda-judges-the-wall-clock"],
)
def test_the_judge_by_device_and_the_cases_the_gpus_allow(
    device: str,
    code: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The patched wheel serves 10 % slower and makes no collective: on CPU (in-run) that is printed,
    not failed; on a GPU the wall clock decides. One GPU runs only the one-rank case."""
    prepared = bench.Prepared(
        "0.5.23", {"pristine": tmp_path, "patched": tmp_path}, Path("python"), [], {}, None
    )
    monkeypatch.setattr(bench, "prepare_cpu", lambda *args: prepared)
    monkeypatch.setattr(
        bench, "prepare_gpu", lambda *args: bench.Prepared(**{**prepared.__dict__, "gpus": 1})
    )
    monkeypatch.setattr(bench, "write_models", lambda folder, names: {"dense": folder})
    ran: list[str] = []

    def side_by_side(case: Any, pairs: int, sites: dict[str, Path], *where: Any) -> dict[str, list[Any]]:
        ran.append(case.name)
        assert case.device == device
        return {"pristine": _passes("pristine", 2.0), "patched": _passes("patched", 1.8)}

    monkeypatch.setattr(bench, "side_by_side", side_by_side)
    argv = ["--device", device, "--cases", "tp1,tp2,tp2-plain", "--out", str(tmp_path / "out")]
    wheel = tmp_path / "sglang-0.5.23+carry.36-py3-none-any.whl"
    assert bench.main([*argv, *(["--wheel", str(wheel)] if device == "cuda" else [])]) == code
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    printed = capsys.readouterr().out
    assert "tp1: throughput ratio 0.9000 < 0.98" in printed
    if device == "cpu":
        assert ran == ["tp1", "tp2", "tp2-plain"] and report["judge"] == "in-run"
        assert "bench: wall clock over target (printed; judged by --judge wall-clock): tp1" in printed
    else:
        assert ran == ["tp1"] and report["judge"] == "wall-clock"
        assert report["cases"]["tp2"] == {"skipped": "2 GPUs needed, 1 present"}
        assert (
            "tp2 (two ranks, rank-local pool: the agreement's cost): skipped, 2 GPUs needed, 1 present"
            in printed
        )
        assert "bench: over target: tp1: throughput ratio 0.9000 < 0.98" in printed


def test_a_gpu_run_needs_the_patched_wheel(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        bench.main(["--device", "cuda"])
    assert exited.value.code == 2
    assert "--wheel is required with --device cuda" in capsys.readouterr().err


def test_a_gpu_run_whose_official_wheel_is_missing_says_what_to_fetch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    wheel = tmp_path / "sglang-0.5.23+carry.36-py3-none-any.whl"
    provenance = {"upstream": {"file": "sglang-0.0.0-py3-none-any.whl"}}
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("sglang/sglang_carry_provenance.json", json.dumps(provenance))
    assert bench.main(["--device", "cuda", "--wheel", str(wheel), "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("bench: error: the line cannot be prepared: ")
    assert line.endswith(
        "upstream/.downloads/sglang-0.0.0-py3-none-any.whl (the official wheel"
        " sglang-0.5.23+carry.36-py3-none-any.whl was built from): run `carry fetch sglang`"
    )


def test_a_gpu_line_is_the_official_wheel_and_the_patched_one_unpacked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheels = {"pristine": tmp_path / "sglang-0.5.23-py3-none-any.whl"}
    wheels["patched"] = tmp_path / "sglang-0.5.23+carry.36-py3-none-any.whl"
    for tree, wheel in wheels.items():
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr("sglang/which.py", f"TREE = {tree!r}\n")
    monkeypatch.setattr(bench, "official_wheel_of", lambda patched: wheels["pristine"])
    monkeypatch.setattr(bench, "gpu_count", lambda: 2)
    out = tmp_path / "out"
    python = Path(sys.executable)  # the GPU venv's interpreter, which compiles what it serves
    line = bench.prepare_gpu(wheels["patched"], python, out, {"PATH": "/bin"})
    assert line.version == "0.5.23" and line.gpus == 2 and line.python == python
    for tree, site in line.sites.items():
        assert (site / "sglang" / "which.py").read_text() == f"TREE = {tree!r}\n"
        assert list((site / "sglang" / "__pycache__").glob("which.*.pyc")), "not byte-compiled"
    # Nothing of the CPU engine; the venv serves its own requirements.
    assert line.pythonpath == [] and "SGLANG_USE_CPU_ENGINE" not in line.env
    assert line.env == {"PATH": "/bin", "TORCH_EXTENSIONS_DIR": str(out / "torch-extensions")}
