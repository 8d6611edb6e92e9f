"""`batchpilot demo` as a user runs it: a real subprocess with real servers, Prometheus,
load and tuner; it must write its plot and summary and leave no process behind."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from batchpilot_tools.demo.capacity import Capacity
from batchpilot_tools.demo.cli import main as demo_main
from batchpilot_tools.demo.cli import options_from
from batchpilot_tools.demo.options import DEFAULT_REPLICAS, Replicas
from batchpilot_tools.demo.plot import write_plot
from batchpilot_tools.demo.recording import Recording, Sample
from batchpilot_tools.demo.view import slo_line
from batchpilot_tools.prometheus_local import find_binary

from tests.support.usage import refused_usage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
EXIT_DEADLINE_S = 60.0
PROMETHEUS = int(find_binary() is not None)
# the servers a demo starts with, plus Prometheus where it is installed
SERVERS = DEFAULT_REPLICAS.low
CHILDREN = SERVERS + PROMETHEUS


def children_of(pid: int) -> set[int]:
    """Live processes whose parent is `pid`, read from /proc."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class DemoRun:
    """The demo as a subprocess; tracks every child it ever had, always kills what is left."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.out = tmp_path / "demo.png"
        self.log = tmp_path / "demo.out"
        command = [
            sys.executable, "-m", "batchpilot_server.cli", "demo",
            "--out", str(self.out), *args,
        ]  # fmt: skip
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        self.children: set[int] = set()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def watch_until(self, done: object, timeout_s: float) -> None:
        """Record children while polling `done()` (a callable) until true or the demo exits."""
        assert callable(done)
        deadline = time.monotonic() + timeout_s
        while self.proc.poll() is None and not done():
            self.children |= children_of(self.proc.pid)
            assert time.monotonic() < deadline, f"timed out; output:\n{self.output()}"
            time.sleep(0.2)

    def run_to_exit(self) -> int:
        """The demo's exit code once it ends by itself; anything it left running is killed."""
        try:
            self.watch_until(lambda: False, EXIT_DEADLINE_S + 300)
            return self.proc.wait()
        finally:
            self.kill_leftovers()

    def kill_leftovers(self) -> None:
        for pid in [self.proc.pid, *self.children]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def assert_clean(run: DemoRun, expected_children: int) -> None:
    assert len(run.children) >= expected_children, (run.children, run.output())
    deadline = time.monotonic() + 5  # the kernel reaps reparented children asynchronously
    while any(alive(pid) for pid in run.children) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in run.children if alive(pid)]
    assert not left, f"processes left behind: {left}\n{run.output()}"


def assert_plot(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC)
    assert len(data) > 10_000  # a real figure, not an empty canvas


def interval_lines(output: str) -> list[str]:
    """Not a terminal: one plain line per tuner interval, before the summary."""
    return [line for line in output.splitlines() if line.startswith("t=")]


def test_short_demo_with_a_fixed_fleet_writes_plot_and_summary(tmp_path: Path) -> None:
    run = DemoRun(
        tmp_path, "--duration", "12", "--interval", "3", "--replicas", "2",
        "--slo-ttft-ms", "800", "--slo-tpot-ms", "90", "--slo-p99-ms", "1000",
    )  # fmt: skip
    code = run.run_to_exit()
    output = run.output()
    assert code == 0, output
    # no --rate: the load is sized from the first server's measured throughput
    assert re.search(r"one server carries \d+\.\d+ req/s at batch 8: the load is "
                     r"\d+\.\d+ req/s", output), output
    lines = interval_lines(output)
    assert len(lines) >= 3, output
    assert all(" replicas=2 serving=2 " in line for line in lines), output
    # each target against its observed p99, and the attainment against its target
    targets = re.compile(
        r"TTFT p99 \S+/800 ms  TPOT p99 \S+/90 ms  e2e p99 \S+/1000 ms  attainment \S+/90%"
    )
    assert all(targets.search(line) for line in lines), output
    assert "SLO (TTFT 800 ms, TPOT 90 ms, e2e p99 1000 ms (90% of requests)) met in" in output
    assert "batchpilot demo summary" in output
    assert re.search(r"replicas: 2 \(a fixed fleet\), \d+ replica-seconds over", output), output
    assert "\x1b[" not in output
    assert_slot_waste(output, servers=2)
    assert_plot(run.out)
    assert_clean(run, expected_children=2 + PROMETHEUS)


def test_the_tuner_starts_a_second_server_once_the_batch_is_spent(tmp_path: Path) -> None:
    # Batch 1 is both the start and the bound, and 16 req/s is far more than one server
    # serves at batch 1: the first judged window breaks the SLO by queueing with the
    # knobs spent, whatever the machine's speed. Two servers at batch 1 do not carry it
    # either: after the load the tuner runs on while the queues drain or time out (up to
    # the servers' 30 s queue timeout), so a short load leaves it rounds to spare.
    run = DemoRun(
        tmp_path, "--duration", "20", "--interval", "5", "--max-batch", "1", "--rate", "16",
        "--step-factor", "1", "--surge-factor", "1",
    )  # fmt: skip
    code = run.run_to_exit()
    output = run.output()
    assert code == 0, output
    lines = interval_lines(output)
    scaled = [index for index, line in enumerate(lines) if "| scale_out:" in line]
    assert len(scaled) == 1, output  # one step to the maximum, never back: no flapping
    scale_out = lines[scaled[0]]
    assert "scale_out: 1 -> 2 replicas" in scale_out and "the batch is spent" in scale_out
    assert " replicas=2 serving=1 " in scale_out  # counted at once, serving once ready
    assert all(" replicas=1 serving=1 " in line for line in lines[: scaled[0]]), output
    serving = [line for line in lines[scaled[0] :] if " replicas=2 serving=2 " in line]
    assert serving, output  # the new server joined while the run lasted
    assert all("batch=1 " in line for line in lines), output
    assert re.search(
        r"replicas: 1\.\.2, scale out to 2 at \d+ s; 0 reversals within a load phase; "
        r"\d+ replica-seconds over \d+ s", output,
    ), output  # fmt: skip
    # the one knob left to move: the queue fills any batch, so no wait to fill it
    assert "tuner: " in output and " 1 changes (0 undone by the next interval)" in output
    assert "config: batch 1 -> 1, timeout 100 -> 0 ms" in output
    assert_slot_waste(output, servers=2)  # the second server's counters are in the summary
    assert_plot(run.out)
    assert_clean(run, expected_children=2 + PROMETHEUS)


def assert_slot_waste(output: str, servers: int) -> None:
    """The summary's slot waste: shares of the servers' own slot-step counters, whose
    finished part is 0 because the demo's servers batch continuously."""
    line = next((line for line in output.splitlines() if "slot waste:" in line), None)
    assert line is not None, output
    share = r"(\d+\.\d+)"
    names = ", ".join(rf"server-{index} {share}" for index in range(servers))
    match = re.search(
        rf"{share} finished-but-held \+ {share} padding = {share} of (\d+) batch slot-steps "
        rf"\({names}\)",
        line,
    )
    assert match, line
    groups = match.groups()
    finished, padding, waste = (float(value) for value in groups[:3])
    per_server = [float(value) for value in groups[4:]]
    assert int(groups[3]) > 0, line
    assert all(0.0 <= value <= 1.0 for value in (finished, padding, waste, *per_server)), line
    assert finished == 0.0, line
    assert waste == pytest.approx(finished + padding, abs=0.0015), line  # each rounded to 0.001
    assert "0 by construction" in output, output


@pytest.mark.parametrize(
    ("sig", "extra", "children"),
    [
        (signal.SIGINT, [], CHILDREN),
        # SIGTERM on the direct-scrape path, so that path runs too
        (signal.SIGTERM, ["--no-prometheus"], SERVERS),
    ],
    ids=["sigint-prometheus", "sigterm-direct-scrape"],
)
def test_signal_midway_stops_everything(
    tmp_path: Path, sig: signal.Signals, extra: list[str], children: int
) -> None:
    run = DemoRun(tmp_path, "--duration", "120", "--interval", "3", *extra)
    try:
        run.watch_until(lambda: "t=" in run.output(), timeout_s=90)
        assert run.proc.poll() is None, run.output()
        run.proc.send_signal(sig)
        code = run.proc.wait(timeout=EXIT_DEADLINE_S)
    finally:
        run.kill_leftovers()
    output = run.output()
    assert code == 128 + sig, output
    assert "summary (interrupted)" in output
    assert "Traceback" not in output
    assert_plot(run.out)
    assert_clean(run, expected_children=children)


def test_sigint_while_starting_stops_the_servers(tmp_path: Path) -> None:
    run = DemoRun(tmp_path, "--duration", "60")
    try:
        # the servers are being started: interrupt before anything is ready
        run.watch_until(lambda: len(run.children) >= SERVERS, timeout_s=30)
        run.proc.send_signal(signal.SIGINT)
        code = run.proc.wait(timeout=EXIT_DEADLINE_S)
    finally:
        run.kill_leftovers()
    output = run.output()
    assert code == 128 + signal.SIGINT, output
    assert "interrupted while starting" in output
    assert "Traceback" not in output
    assert not run.out.exists()
    assert_clean(run, expected_children=SERVERS)


def test_broken_prometheus_is_reported_and_servers_stopped(tmp_path: Path) -> None:
    run = DemoRun(tmp_path, "--duration", "60", env={"PROMETHEUS_BIN": "/bin/false"})
    code = run.run_to_exit()
    output = run.output()
    assert code == 1, output
    assert "batchpilot demo: prometheus exited during start" in output
    assert "Traceback" not in output
    assert_clean(run, expected_children=SERVERS)


def test_the_servers_serve_the_model_the_demo_is_given(tmp_path: Path) -> None:
    # A model path that does not exist: the servers get it and refuse it at once,
    # which shows it reached them without loading a real model for minutes.
    missing = tmp_path / "no-such-model.gguf"
    run = DemoRun(
        tmp_path, "--model", str(missing), "--duration", "20", "--interval", "4", "--no-prometheus"
    )
    code = run.run_to_exit()
    output = run.output()
    assert code == 1, output
    assert f"1 server of {missing}" in output
    assert "exited with" in output and str(missing) in output.split("exited with", 1)[1]
    assert not run.out.exists()
    assert_clean(run, expected_children=SERVERS)


def test_the_default_demo_scales_one_to_two_servers_and_the_load_falls_back() -> None:
    options = options_from([])
    assert options.replicas == DEFAULT_REPLICAS == Replicas(1, 2)
    bounds = options.replica_bounds
    assert bounds is not None and (bounds.min_replicas, bounds.max_replicas) == (1, 2)
    # scale-down patience of a few intervals, not HPA's 300 s: the fall lasts 45 s
    assert bounds.scale_down_stabilization_s == 3 * options.interval_s
    assert options.base_rate is None  # sized from the first server at the start
    with pytest.raises(ValueError, match="not sized yet"):
        options.offered_rate(0)
    capacity = Capacity(requests_per_s=2.0, batch=options.max_batch, seconds=10.0)
    options = dataclasses.replace(options, base_rate=capacity.base_rate(options.surge_factor))
    base = options.base_rate
    step, surge = base * options.step_factor, base * options.surge_factor
    # one server carries the step at its batch ceiling; the surge needs a second
    assert base < step < capacity.requests_per_s <= surge < 2 * capacity.requests_per_s
    times = (0, options.step_at_s, options.surge_at_s - 1, options.surge_at_s,
             options.fall_at_s - 1, options.fall_at_s, options.duration_s)  # fmt: skip
    assert [options.offered_rate(t) for t in times] == [base, step, step, surge, surge, base,
                                                        base]  # fmt: skip
    assert options_from(["--replicas", "2"]).replica_bounds is None  # a fixed fleet


def test_a_real_model_gets_a_longer_slo_and_longer_intervals_unless_told_otherwise() -> None:
    tiny, real = options_from([]), options_from(["--model", "SmolLM2.gguf"])
    assert tiny.model == "tiny" and real.model == "SmolLM2.gguf"
    assert real.slo_p99_ms > tiny.slo_p99_ms
    # a slow model finishes few requests an interval: longer intervals, a smaller sample
    assert real.interval_s > tiny.interval_s and real.min_requests < tiny.min_requests
    assert options_from(["--model", "SmolLM2.gguf", "--interval", "5"]).interval_s == 5.0
    told = options_from(["--model", "SmolLM2.gguf", "--rate", "3", "--slo-p99-ms", "700"])
    assert (told.base_rate, told.slo_p99_ms) == (3.0, 700.0)
    assert told.targets_ms == {"e2e": 700.0}  # a target given replaces the profile's


def test_the_llm_targets_are_stated_for_a_real_model_and_on_request() -> None:
    real = options_from(["--model", "SmolLM2.gguf"])
    assert set(real.targets_ms) == {"ttft", "tpot", "e2e"}
    assert options_from([]).targets_ms == {"e2e": 1000.0}
    llm = options_from(["--slo-ttft-ms", "500", "--slo-tpot-ms", "40", "--slo-attainment", "0.8"])
    assert llm.targets_ms == {"ttft": 500.0, "tpot": 40.0}  # no end-to-end target
    assert (llm.slo.ttft_s, llm.slo.tpot_s, llm.slo.e2e_s) == (0.5, 0.04, None)
    assert llm.slo.attainment == 0.8


def sample(t_s: float, **signals: float | None) -> Sample:
    return Sample(
        t_s=t_s, offered_rps=4.0, p99_ms=signals.get("e2e"), kv_usage=0.1, max_batch_size=8,
        batch_timeout_ms=10.0, action="hold", reason="", replicas=1, serving=1,
        ttft_p99_ms=signals.get("ttft"), tpot_p99_ms=signals.get("tpot"),
        attainment=signals.get("attainment"),
    )  # fmt: skip


def test_an_interval_is_judged_by_attainment_else_by_each_targets_p99(tmp_path: Path) -> None:
    options = options_from(["--slo-ttft-ms", "500", "--slo-tpot-ms", "40", "--rate", "4",
                            "--out", str(tmp_path / "demo.png")])  # fmt: skip
    judged = sample(5.0, ttft=900.0, tpot=30.0, attainment=0.95)
    assert judged.met(options) is True  # the pods' judgement wins over the p99s
    assert sample(5.0, ttft=400.0, tpot=30.0, attainment=0.5).met(options) is False
    assert sample(5.0, ttft=400.0, tpot=30.0).met(options) is True
    assert sample(5.0, ttft=400.0, tpot=50.0).met(options) is False
    assert sample(5.0, e2e=100.0).met(options) is None  # no stated target observed
    assert slo_line(judged, options) == "TTFT p99 900/500 ms  TPOT p99 30/40 ms  attainment 95%/90%"
    recording = Recording(options, samples=[judged, sample(10.0, ttft=450.0, tpot=35.0)])
    write_plot(recording, options.out)
    assert_plot(options.out)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--duration", "0"], "--duration must be positive"),
        (["--surge-factor", "-1"], "--surge-factor must be positive"),
        (["--duration", "10", "--interval", "5"], "too short for --interval"),
        (["--replicas", "0"], "1 <= MIN <= MAX"),
        (["--replicas", "3..1"], "1 <= MIN <= MAX"),
        (["--replicas", "one"], "takes N or MIN..MAX"),
        (["--max-batch", "0"], "--max-batch must be at least 1"),
        (["--slo-ttft-ms", "0"], "--slo-ttft-ms must be positive"),
        (["--slo-tpot-ms", "-5"], "--slo-tpot-ms must be positive"),
        (["--slo-attainment", "1"], "--slo-attainment must be in (0, 1)"),
    ],
)
def test_bad_flags_are_explained(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert message in refused_usage(demo_main, argv, capsys)
