"""What the terminal shows: a live view while the run lasts, and the summary after it."""

from __future__ import annotations

import asyncio
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
        f"(x{options.step_factor:g} step at {options.step_at_s:.0f} s)  "
        f"signals: {recording.signal_source}",
    ]
    if last is None:
        lines.append("waiting for the first tuner interval...")
        return lines
    met = last.p99_ms is not None and last.p99_ms <= options.slo_p99_ms
    verdict = "n/a" if last.p99_ms is None else ("met" if met else "BREACH")
    kv = "n/a" if last.kv_usage is None else f"{last.kv_usage:.0%}"
    lines += [
        f"p99 {_ms(last.p99_ms)} ms  SLO {options.slo_p99_ms:.0f} ms  {verdict:<6}  "
        f"batch {last.max_batch_size:3d}  timeout {last.batch_timeout_ms:6.1f} ms  KV {kv}",
        f"last decision @{last.t_s:5.0f} s: {last.action}: {last.reason}",
    ]
    return lines


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
    return (
        f"t={sample.t_s:5.0f}s offered={sample.offered_rps:5.1f}/s "
        f"p99={_ms(sample.p99_ms).strip()}ms slo={options.slo_p99_ms:.0f}ms "
        f"batch={sample.max_batch_size} timeout={sample.batch_timeout_ms:.1f}ms kv={kv} "
        f"{sample.action}: {sample.reason}"
    )


async def keep_view_fresh(view: LiveView, recording: Recording) -> None:
    while True:
        view.refresh(recording)
        await asyncio.sleep(VIEW_REFRESH_S)


def summary_lines(recording: Recording, report: LoadReport | None, interrupted: bool) -> list[str]:
    options, samples = recording.options, recording.samples
    judged = [s for s in samples if s.p99_ms is not None]
    met = [s for s in judged if s.p99_ms is not None and s.p99_ms <= options.slo_p99_ms]
    changes = [s for s in samples if s.action not in ("hold",)]
    lines = ["", "batchpilot demo summary" + (" (interrupted)" if interrupted else "")]
    if report is not None:
        lines.append(
            f"  load: {report.sent} requests sent, {report.ok} ok, "
            f"{report.requests_per_s:.1f} req/s, {report.tokens_per_s:.0f} tokens/s"
        )
    lines += [
        f"  tuner: {len(samples)} intervals, {len(changes)} changes, "
        f"p99 within the {options.slo_p99_ms:.0f} ms SLO in {len(met)}/{len(judged)} judged",
        f"  config: batch {INITIAL.max_batch_size} -> {recording.config.max_batch_size}, "
        f"timeout {INITIAL.batch_timeout_ms:g} -> {recording.config.batch_timeout_ms:g} ms",
    ]
    if recording.slot_waste is not None:
        lines += slot_waste_lines(recording.slot_waste)
    if samples:
        lines.append(f"  plot: {options.out}")
    return lines


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
