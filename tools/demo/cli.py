"""`batchpilot demo` (what `make demo` runs): watch the tuner work, with no cluster.

`batchpilot serve` processes (continuous batching, a deliberately poor start
config) form one local "policy"; Prometheus scrapes them when its binary is
installed (otherwise the tuner scrapes `/metrics` itself); the first server's
throughput at the batch ceiling is measured (demo/capacity.py) and the load sized from
it; the load generator offers a steady rate, a quarter of the run each: the base rate,
a step up that
one server carries at a larger batch, a surge beyond it, and the base rate
again; the local tuning loop moves both knobs and, with a range of replicas,
the number of servers: it sizes the batch for the step, starts a second server
once the batch is spent in the surge, and stops it when the load has fallen. A live view shows
what happens; at the end the run is plotted to `batchpilot-demo.png`
(untracked: `make demo` changes no file of the repository; the README's figure
is a run with `--out docs/demo.png`) and summarised.

`--model DIR|FILE.gguf` runs it on a real model instead of `tiny`, with a load
sized the same way and LLM targets (time to
first token, time per output token) beside the end-to-end one. `--slo-ttft-ms` and
`--slo-tpot-ms` state those targets for any model; the view and the plot show each
target against its observed p99, and the attainment.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path
from typing import TextIO

from batchpilot_operator.tune_local import TuneError
from batchpilot_tools.demo.options import (
    DEFAULT_REPLICAS,
    DEMO_ATTAINMENT,
    DEMO_MAX_BATCH,
    REAL_MODEL_PROFILE,
    SCALE_DOWN_INTERVALS,
    TINY_PROFILE,
    DemoOptions,
    LoadProfile,
    Replicas,
    profile_for,
)
from batchpilot_tools.demo.plot import write_plot
from batchpilot_tools.demo.run import run_demo
from batchpilot_tools.demo.supervisor import DemoError, Stopped
from batchpilot_tools.demo.view import say, summary_lines
from batchpilot_tools.prometheus_local import PrometheusError

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchpilot demo", description=__doc__.splitlines()[0])
    tiny, real = TINY_PROFILE, REAL_MODEL_PROFILE
    p.add_argument(
        "--duration", type=float,
        help=f"seconds of load (default {tiny.duration_s:g}, {real.duration_s:g} for a real model)",
    )  # fmt: skip
    p.add_argument(
        "--model",
        default="tiny",
        help="what the servers serve: a preset, a Hugging Face model directory or a .gguf "
        "file (default tiny; a real model gets the smaller load and longer SLO below)",
    )
    p.add_argument(
        "--slo-p99-ms", "--slo-e2e-ms", dest="slo_p99_ms", type=float,
        help=f"end-to-end latency target (ms; default {tiny.slo_p99_ms:g}, {real.slo_p99_ms:g} "
        "for a real model; with --slo-ttft-ms or --slo-tpot-ms: only if given)",
    )  # fmt: skip
    p.add_argument(
        "--slo-ttft-ms", type=float,
        help=f"time-to-first-token target (ms; default none, {real.slo_ttft_ms:g} for a real "
        "model)",
    )  # fmt: skip
    p.add_argument(
        "--slo-tpot-ms", type=float,
        help=f"time-per-output-token target, each request's mean after the first (ms; default "
        f"none, {real.slo_tpot_ms:g} for a real model)",
    )  # fmt: skip
    p.add_argument(
        "--slo-attainment", type=float, default=DEMO_ATTAINMENT,
        help=f"share of requests per interval that must meet every stated target (default "
        f"{DEMO_ATTAINMENT:g})",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("batchpilot-demo.png"), help="plot to write")
    p.add_argument(
        "--interval", type=float,
        help=f"seconds between tuner decisions (default {tiny.interval_s:g}, "
        f"{real.interval_s:g} for a real model)",
    )  # fmt: skip
    p.add_argument(
        "--rate", type=float,
        help="requests/s before the load step (default: sized from the first server's "
        "throughput at the batch ceiling, measured at the start, so that the surge "
        "needs a second server on any CPU)",
    )  # fmt: skip
    p.add_argument(
        "--step-factor", type=float,
        help=f"load multiplier in the second quarter, the step (default "
        f"{tiny.step_factor:g}, {real.step_factor:g} for a real model)",
    )  # fmt: skip
    p.add_argument(
        "--surge-factor", type=float,
        help=f"load multiplier in the third quarter, the surge (default "
        f"{tiny.surge_factor:g}, {real.surge_factor:g} for a real model)",
    )  # fmt: skip
    p.add_argument(
        "--replicas", default=str(DEFAULT_REPLICAS), metavar="N|MIN..MAX",
        help=f"servers: N for a fixed fleet, or MIN..MAX for the tuner to scale, starting "
        f"at MIN; it scales out only once the batch is spent and in after "
        f"{SCALE_DOWN_INTERVALS} quiet intervals (default {DEFAULT_REPLICAS})",
    )  # fmt: skip
    p.add_argument(
        "--max-batch", type=int, default=DEMO_MAX_BATCH,
        help=f"the largest batch the tuner may set (default {DEMO_MAX_BATCH}); a small "
        "one spends the batch sooner",
    )  # fmt: skip
    p.add_argument(
        "--no-prometheus",
        action="store_true",
        help="scrape the servers directly even when a prometheus binary is installed",
    )
    return p


def options_from(argv: list[str]) -> DemoOptions:
    p = parser()
    args = p.parse_args(argv)
    profile = profile_for(args.model)
    targets = slo_targets(args, profile)
    rate = args.rate
    duration = profile.duration_s if args.duration is None else args.duration
    interval = profile.interval_s if args.interval is None else args.interval
    step_factor = profile.step_factor if args.step_factor is None else args.step_factor
    surge_factor = profile.surge_factor if args.surge_factor is None else args.surge_factor
    for flag, value in (
        ("--duration", duration),
        *((SLO_FLAGS[name], ms) for name, ms in targets.items() if ms is not None),
        ("--interval", interval),
        *((("--rate", rate),) if rate is not None else ()),
        ("--step-factor", step_factor),
        ("--surge-factor", surge_factor),
    ):
        if value <= 0:
            p.error(f"{flag} must be positive, got {value:g}")
    if duration < 4 * interval:
        p.error(
            f"--duration {duration:g} is too short for --interval {interval:g}: "
            "the tuner needs at least 4 intervals"
        )
    if args.max_batch < 1:
        p.error(f"--max-batch must be at least 1, got {args.max_batch}")
    if not 0 < args.slo_attainment < 1:
        p.error(f"--slo-attainment must be in (0, 1), got {args.slo_attainment:g}")
    try:
        replicas = Replicas.parse(args.replicas)
    except ValueError as exc:
        p.error(str(exc))
    return DemoOptions(
        duration_s=duration,
        slo_p99_ms=targets["e2e"],
        slo_ttft_ms=targets["ttft"],
        slo_tpot_ms=targets["tpot"],
        slo_attainment=args.slo_attainment,
        min_requests=profile.min_requests,
        out=args.out,
        interval_s=interval,
        base_rate=rate,
        step_factor=step_factor,
        surge_factor=surge_factor,
        use_prometheus=not args.no_prometheus,
        model=args.model,
        replicas=replicas,
        max_batch=args.max_batch,
    )


SLO_FLAGS = {"ttft": "--slo-ttft-ms", "tpot": "--slo-tpot-ms", "e2e": "--slo-p99-ms"}


def slo_targets(args: argparse.Namespace, profile: LoadProfile) -> dict[str, float | None]:
    """The targets in ms: the flags given; none given, the model's profile. A TTFT or
    TPOT flag alone states no end-to-end target (answers' lengths vary)."""
    given = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms, "e2e": args.slo_p99_ms}
    if any(ms is not None for ms in given.values()):
        return given
    return {"ttft": profile.slo_ttft_ms, "tpot": profile.slo_tpot_ms, "e2e": profile.slo_p99_ms}


def main(argv: list[str]) -> int:
    return asyncio.run(demo(options_from(argv), sys.stdout))


async def demo(options: DemoOptions, stream: TextIO) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in EXIT_CODES:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        recording, report = await run_demo(options, stop, stream)
    except Stopped:
        say(stream, "interrupted while starting; everything it started is stopped")
        return EXIT_CODES[received[0]]
    except (DemoError, PrometheusError, TuneError) as exc:
        print(f"batchpilot demo: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in EXIT_CODES:
            loop.remove_signal_handler(sig)
    if recording.samples:
        write_plot(recording, options.out)
    else:
        say(stream, f"no tuner interval completed, so no plot was written to {options.out}")
    for line in summary_lines(recording, report, interrupted=bool(received)):
        stream.write(line + "\n")
    stream.flush()
    return EXIT_CODES[received[0]] if received else 0
