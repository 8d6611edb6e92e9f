"""The run as a PNG: the end-to-end p99, the TTFT and TPOT p99s against their targets and
the attainment, both knobs and the replicas, over time; the load steps and the fall
marked."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from batchpilot_tools.demo.options import INITIAL, DemoOptions
from batchpilot_tools.demo.recording import Recording, Sample

LOG_SCALE_BEYOND = 5.0  # p99 axis in log scale once a p99 passes this many SLOs


def write_plot(recording: Recording, path: Path) -> None:
    # imported only when a run has something to plot: the other commands never load it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options, samples = recording.options, recording.samples
    times = [s.t_s for s in samples]
    # The knobs and the fleet start as configured, before the first decision.
    knob_times = [0.0, *times]
    batches = [INITIAL.max_batch_size, *(s.max_batch_size for s in samples)]
    timeouts = [INITIAL.batch_timeout_ms, *(s.batch_timeout_ms for s in samples)]
    replicas = [options.replicas.low, *(s.replicas for s in samples)]
    serving = [options.replicas.low, *(s.serving for s in samples)]
    fig, (ax_p99, ax_llm, ax_replicas, ax_batch, ax_timeout) = plt.subplots(
        5, 1, figsize=(10, 11.5), sharex=True, height_ratios=(2, 2, 1, 1, 1)
    )
    ax_p99.plot(
        times, [_nan(s.p99_ms) for s in samples], marker="o", markersize=3,
        label="p99 latency",
    )  # fmt: skip
    judged = [s.p99_ms for s in samples if s.p99_ms is not None]
    e2e = options.slo_p99_ms
    if e2e is not None:
        ax_p99.axhline(e2e, color="tab:red", linestyle="--", label="e2e target")
    ax_p99.set_ylabel("p99 latency (ms)")
    if judged and max(judged) > LOG_SCALE_BEYOND * (e2e or min(judged)):
        # An overload's minute-long p99 would flatten the SLO line into the axis.
        ax_p99.set_yscale("log")
    else:
        ax_p99.set_ylim(bottom=0)
    llm_panel(ax_llm, times, samples, options)
    ax_load = ax_p99.twinx()
    step, surge, fall = options.step_at_s, options.surge_at_s, options.fall_at_s
    edges = [0.0, step, surge, fall, options.duration_s]
    load_t = [t for start, end in itertools.pairwise(edges) for t in (start, end)]
    load_r = [options.offered_rate(start) for start in edges[:-1] for _ in range(2)]
    ax_load.plot(load_t, load_r, color="tab:gray", alpha=0.6, label="offered load")
    ax_load.set_ylabel("offered load (req/s)")
    ax_load.set_ylim(bottom=0)
    handles = ax_p99.get_legend_handles_labels()[0] + ax_load.get_legend_handles_labels()[0]
    ax_p99.legend(handles=handles, loc="upper left", fontsize=8)

    ax_replicas.step(knob_times, replicas, where="post", color="tab:orange", label="replicas")
    ax_replicas.step(
        knob_times, serving, where="post", color="tab:brown", linestyle=":", label="serving"
    )
    ax_replicas.set_ylabel(f"servers ({options.replicas})")
    ax_replicas.set_ylim(0, options.replicas.high + 0.5)
    ax_replicas.yaxis.get_major_locator().set_params(integer=True)
    ax_replicas.legend(loc="upper left", fontsize=8)
    ax_batch.step(knob_times, batches, where="post", color="tab:green")
    ax_batch.set_ylabel("max_batch_size")
    ax_batch.set_ylim(bottom=0)
    ax_timeout.step(knob_times, timeouts, where="post", color="tab:purple")
    ax_timeout.set_ylabel("batch timeout (ms)")
    ax_timeout.set_ylim(bottom=0)
    ax_timeout.set_xlabel("time since load start (s)")
    for ax in (ax_p99, ax_llm, ax_replicas, ax_batch, ax_timeout):
        for at in (step, surge, fall):
            ax.axvline(at, color="black", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    # At the bottom of the axes whatever its scale: x in data, y in axes fractions.
    marks = [(start, f"load {label}") for start, _, label in options.phases()]
    for at, text in (*marks, (fall, "load back")):
        ax_p99.annotate(
            text, (at, 0), xycoords=ax_p99.get_xaxis_transform(), xytext=(4, 4),
            textcoords="offset points", fontsize=8,
        )  # fmt: skip
    fleet = f"{options.replicas} autoscaled" if options.replicas.autoscaled else options.replicas
    fig.suptitle(
        f"batchpilot demo: {fleet} continuous-batching server(s) of {Path(options.model).name}"
        f"\nSLO {options.slo_label()}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def llm_panel(ax: Any, times: list[float], samples: list[Sample], options: DemoOptions) -> None:
    """TTFT and TPOT p99 against their targets (log scale: they differ by 10-100x), the
    attainment against its target on the right."""
    targets = options.targets_ms
    for name, color in (("ttft", "tab:blue"), ("tpot", "tab:cyan")):
        values = [_nan(s.p99s_ms[name]) for s in samples]
        ax.plot(times, values, marker="o", markersize=3, color=color, label=f"{name.upper()} p99")
        if name in targets:
            ax.axhline(targets[name], color=color, linestyle="--", label=f"{name.upper()} target")
    ax.set_yscale("log")
    ax.set_ylabel("TTFT / TPOT p99 (ms)")
    ax_att = ax.twinx()
    ax_att.plot(
        times, [_nan(s.attainment) for s in samples], color="tab:green", marker="s",
        markersize=3, label="attainment",
    )  # fmt: skip
    ax_att.axhline(
        options.slo_attainment, color="tab:green", linestyle=":", label="attainment target"
    )
    ax_att.set_ylim(0, 1.05)
    ax_att.set_ylabel("attainment")
    handles = ax.get_legend_handles_labels()[0] + ax_att.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", fontsize=7)
