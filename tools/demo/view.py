"""What the terminal shows: a live view while the run lasts, and the summary after it."""

from __future__ import annotations

import asyncio
import itertools
import shutil
from typing import TextIO

from batchpilot_tools.demo.options import INITIAL, DemoOptions
from batchpilot_tools.demo.recording import Recording, Sample
from batchpilot_tools.demo.waste import FINISHED, PADDING, SlotWaste
from batchpilot_tools.loadgen import LoadReport

VIEW_REFRESH_S = 1.0


def _ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:6.0f}"


def view_lines(recording: Recording) -> list[str]:
    options, last = recording.options, recording.last
    elapsed = min(recording.elapsed(), options.duration_s)
    lines = [
        f"batchpilot demo  {elapsed:5.0f}/{options.duration_s:.0f} s  "
        f"offered {options.offered_rate(elapsed):5.1f} req/s  "
        f"(x{options.step_factor:g} from {options.step_at_s:.0f} s, "
        f"x{options.surge_factor:g} from {options.surge_at_s:.0f} s, back at "
        f"{options.fall_at_s:.0f} s)  signals: {recording.signal_source}",
    ]
    if last is None:
        lines.append("waiting for the first tuner interval...")
        return lines
    kv = "n/a" if last.kv_usage is None else f"{last.kv_usage:.0%}"
    lines += [
        f"{slo_line(last, options)}  {_verdict(last, options)}",
        f"batch {last.max_batch_size:3d}  timeout {last.batch_timeout_ms:6.1f} ms  KV {kv}  "
        f"replicas {_replicas(last)} of {options.replicas}",
        f"last decision @{last.t_s:5.0f} s: {last.action}: {last.reason}",
    ]
    if options.replicas.autoscaled:
        lines.append(f"replicas @{last.t_s:5.0f} s: {last.scale_action}: {last.scale_reason}")
    return lines


TARGET_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "e2e"}


def slo_line(sample: Sample, options: DemoOptions) -> str:
    """Each target against its observed p99, and the attainment:
    `TTFT p99 812/3000 ms  TPOT p99 95/150 ms  e2e p99 4100/10000 ms  attainment 96%/90%`."""
    parts = [
        f"{TARGET_NAMES[name]} p99 {_ms(sample.p99s_ms[name]).strip()}/{target:g} ms"
        for name, target in options.targets_ms.items()
    ]
    attained = "n/a" if sample.attainment is None else f"{sample.attainment:.0%}"
    return "  ".join([*parts, f"attainment {attained}/{options.slo_attainment:.0%}"])


def _verdict(sample: Sample, options: DemoOptions) -> str:
    met = sample.met(options)
    return "n/a" if met is None else ("met" if met else "BREACH")


def _replicas(sample: Sample) -> str:
    """The count of record, and how many serve when that differs (starting, stopping)."""
    if sample.serving == sample.replicas:
        return str(sample.replicas)
    return f"{sample.replicas} ({sample.serving} serving)"


class LiveView:
    """Redraws in place on a terminal; elsewhere prints one line per tuner interval."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._drawn = 0
        self._printed = 0

    def refresh(self, recording: Recording) -> None:
        if self.tty:
            self._redraw(view_lines(recording))
            return
        for sample in recording.samples[self._printed :]:
            self.stream.write(plain_line(sample, recording.options) + "\n")
        self._printed = len(recording.samples)
        self.stream.flush()

    def _redraw(self, lines: list[str]) -> None:
        # A wrapped line would break the cursor arithmetic below: cut to the width.
        width = shutil.get_terminal_size().columns
        lines = [line[: width - 1] for line in lines]
        # Up to the first line we drew, clear to the end of the screen, draw again.
        prefix = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        self.stream.write(prefix + "\n".join(lines) + "\n")
        self.stream.flush()
        self._drawn = len(lines)


def plain_line(sample: Sample, options: DemoOptions) -> str:
    kv = "n/a" if sample.kv_usage is None else f"{sample.kv_usage:.0%}"
    line = (
        f"t={sample.t_s:5.0f}s offered={sample.offered_rps:5.1f}/s "
        f"{slo_line(sample, options)} {_verdict(sample, options)} "
        f"batch={sample.max_batch_size} timeout={sample.batch_timeout_ms:.1f}ms kv={kv} "
        f"replicas={sample.replicas} serving={sample.serving} "
        f"{sample.action}: {sample.reason}"
    )
    if sample.scale_action != "hold":
        line += f" | {sample.scale_action}: {sample.scale_reason}"
    return line


async def keep_view_fresh(view: LiveView, recording: Recording) -> None:
    while True:
        view.refresh(recording)
        await asyncio.sleep(VIEW_REFRESH_S)


def summary_lines(recording: Recording, report: LoadReport | None, interrupted: bool) -> list[str]:
    options, samples = recording.options, recording.samples
    judged = [s for s in samples if s.met(options) is not None]
    met = [s for s in judged if s.met(options)]
    changes = [s for s in samples if s.action not in ("hold",)]
    lines = ["", "batchpilot demo summary" + (" (interrupted)" if interrupted else "")]
    if report is not None:
        lines.append(
            f"  load: {report.sent} requests sent, {report.ok} ok, "
            f"errors {report.errors_by_status or 'none'}, "
            f"{report.requests_per_s:.1f} req/s, {report.tokens_per_s:.0f} tokens/s"
        )
    lines += [
        f"  tuner: {len(samples)} intervals, {len(changes)} changes "
        f"({undone_next_interval(recording)} undone by the next interval), "
        f"SLO ({options.slo_label()}) met in {len(met)}/{len(judged)} judged intervals",
        f"  config: batch {INITIAL.max_batch_size} -> {recording.config.max_batch_size}, "
        f"timeout {INITIAL.batch_timeout_ms:g} -> {recording.config.batch_timeout_ms:g} ms",
        replicas_line(recording),
    ]
    if samples:
        lines += [recovery_line(recording, *phase) for phase in options.phases()]
    if recording.slot_waste is not None:
        lines += slot_waste_lines(recording.slot_waste)
    if samples:
        lines.append(f"  plot: {options.out}")
    return lines


def replicas_line(recording: Recording) -> str:
    """Each change of the replica count, and the servers' cost in replica-seconds."""
    options = recording.options
    cost = f"{recording.replica_seconds():.0f} replica-seconds over {recording.covered_s:.0f} s"
    if not options.replicas.autoscaled:
        return f"  replicas: {options.replicas} (a fixed fleet), {cost}"
    scaled = [s for s in recording.samples if s.scale_action != "hold"]
    moves = ", ".join(
        f"{s.scale_action.replace('_', ' ')} to {s.replicas} at {s.t_s:.0f} s" for s in scaled
    )
    return (
        f"  replicas: {options.replicas}, {moves or 'never scaled'}; "
        f"{reversals_within_a_phase(recording)} reversals within a load phase; {cost}"
    )


def undone_next_interval(recording: Recording) -> int:
    """Batch changes that the next interval moved back: overshoot."""
    batches = [INITIAL.max_batch_size, *(s.max_batch_size for s in recording.samples)]
    moves = [after - before for before, after in itertools.pairwise(batches)]
    return sum(1 for move, next_move in itertools.pairwise(moves) if move * next_move < 0)


def reversals_within_a_phase(recording: Recording) -> int:
    """Replica changes opposite to the previous one while the offered load stayed the
    same: flapping."""
    options, reversals = recording.options, 0
    previous: tuple[float, str] | None = None  # (offered rate, action) of the last change
    for sample in recording.samples:
        if sample.scale_action == "hold":
            continue
        rate = options.offered_rate(sample.t_s)
        if previous is not None and previous[0] == rate and previous[1] != sample.scale_action:
            reversals += 1
        previous = (rate, sample.scale_action)
    return reversals


def recovery_line(recording: Recording, start_s: float, end_s: float, label: str) -> str:
    """How many intervals after a phase's start the SLO was met again."""
    options = recording.options
    after = [s for s in recording.samples if start_s <= s.t_s < end_s]
    head = f"  after the {label} at {start_s:.0f} s:"
    breached = next((i for i, s in enumerate(after) if s.met(options) is False), None)
    if breached is None:
        return f"{head} the SLO was never breached in {len(after)} intervals"
    met = next((i for i, s in enumerate(after) if i > breached and s.met(options)), None)
    if met is None:
        return f"{head} the SLO was breached and not met again before the phase ended"
    return (
        f"{head} the SLO was met again in interval {met + 1} after it "
        f"({after[met].t_s:.0f} s: {slo_line(after[met], options)})"
    )


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def slot_waste_lines(waste: SlotWaste) -> list[str]:
    """Shares of the run's batch slot-steps held by finished rows or spent on padding."""
    overall = waste.overall
    if overall.total == 0:
        return ["  slot waste: n/a (no batch slot-steps were read from the servers)"]
    per_server = ", ".join(
        f"{name} {_share(None if steps is None else steps.waste)}"
        for name, steps in waste.per_server.items()
    )
    lines = [
        f"  slot waste: {_share(overall.share(FINISHED))} finished-but-held + "
        f"{_share(overall.share(PADDING))} padding = {_share(overall.waste)} of "
        f"{overall.total:.0f} batch slot-steps ({per_server})"
    ]
    if overall.modes == {"continuous"}:
        lines.append(
            "    (continuous batching frees a finished row at once, so finished-but-held "
            "is 0 by construction)"
        )
    return lines


def say(stream: TextIO, message: str) -> None:
    stream.write(f"batchpilot demo: {message}\n")
    stream.flush()
