"""The run as a PNG: p99 against the SLO, and both knobs, over time; the load step marked."""

from __future__ import annotations

from pathlib import Path

from batchpilot_tools.demo.options import INITIAL, SERVERS
from batchpilot_tools.demo.recording import Recording


def write_plot(recording: Recording, path: Path) -> None:
    # matplotlib is a dev dependency: imported only when a run has something to plot.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options, samples = recording.options, recording.samples
    times = [s.t_s for s in samples]
    # The knobs start at the initial config, before the first decision.
    knob_times = [0.0, *times]
    batches = [INITIAL.max_batch_size, *(s.max_batch_size for s in samples)]
    timeouts = [INITIAL.batch_timeout_ms, *(s.batch_timeout_ms for s in samples)]
    fig, (ax_p99, ax_batch, ax_timeout) = plt.subplots(
        3, 1, figsize=(10, 8), sharex=True, height_ratios=(2, 1, 1)
    )
    ax_p99.plot(
        times, [s.p99_ms if s.p99_ms is not None else float("nan") for s in samples],
        marker="o", markersize=3, label="p99 latency",
    )  # fmt: skip
    ax_p99.axhline(options.slo_p99_ms, color="tab:red", linestyle="--", label="p99 SLO")
    ax_p99.set_ylabel("p99 latency (ms)")
    ax_p99.set_ylim(bottom=0)
    ax_load = ax_p99.twinx()
    load_t = [0.0, options.step_at_s, options.step_at_s, options.duration_s]
    load_r = [options.base_rate, options.base_rate, *[options.offered_rate(options.step_at_s)] * 2]
    ax_load.plot(load_t, load_r, color="tab:gray", alpha=0.6, label="offered load")
    ax_load.set_ylabel("offered load (req/s)")
    ax_load.set_ylim(bottom=0)
    handles = ax_p99.get_legend_handles_labels()[0] + ax_load.get_legend_handles_labels()[0]
    ax_p99.legend(handles=handles, loc="upper left", fontsize=8)

    ax_batch.step(knob_times, batches, where="post", color="tab:green")
    ax_batch.set_ylabel("max_batch_size")
    ax_batch.set_ylim(bottom=0)
    ax_timeout.step(knob_times, timeouts, where="post", color="tab:purple")
    ax_timeout.set_ylabel("batch timeout (ms)")
    ax_timeout.set_ylim(bottom=0)
    ax_timeout.set_xlabel("time since load start (s)")
    for ax in (ax_p99, ax_batch, ax_timeout):
        ax.axvline(options.step_at_s, color="black", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    ax_p99.annotate(
        f"load x{options.step_factor:g}", (options.step_at_s, 0), xytext=(4, 4),
        textcoords="offset points", fontsize=8,
    )  # fmt: skip
    fig.suptitle(
        f"batchpilot demo: {SERVERS} continuous-batching servers of {options.model}, "
        f"SLO p99 {options.slo_p99_ms:.0f} ms"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
