"""bench/slo_classes_real.py's bookkeeping: the policies each pool states, the windows a
class is judged in, and where its section goes in docs/benchmarks.md."""

from __future__ import annotations

import sys
from pathlib import Path

from batchpilot_operator.slo import Slo
from batchpilot_tools.loadgen import RequestResult

# bench/ is scripts, not a package: its modules import each other by bare name
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import slo_classes_real as scr
from planners_real import Tally


def result(end_s: float, latency_s: float = 0.5, status: int = 200) -> RequestResult:
    return RequestResult("http://x", end_s - latency_s, end_s, status, ttft_s=0.1)


def test_the_shared_policy_states_both_classes_and_a_pool_its_own_alone() -> None:
    classes = scr.Calibration(chat_rps=8.0, batch_rps=4.0, chat_tpot_p90_s=0.01).classes()
    shared = classes.shared_slo()
    assert [c.name for c in shared.classes] == [scr.INTERACTIVE, scr.BATCH]
    assert (shared.ttft_s, shared.tpot_s) == (scr.INTERACTIVE_TTFT_S, 0.02)
    assert classes.interactive.priority > classes.batch.priority
    assert classes.pool_slo(scr.BATCH) == Slo(e2e_s=scr.BATCH_E2E_S, attainment=scr.ATTAINMENT)
    assert classes.pool_slo(scr.INTERACTIVE).classes == ()
    # the pods take the classes with the targets: a request naming one is not refused
    assert [c.name for c in shared.targets().classes] == [scr.INTERACTIVE, scr.BATCH]


def test_windows_skip_the_first_and_judge_only_those_with_enough_requests() -> None:
    tally = Tally(Slo(e2e_s=1.0, attainment=0.9))
    tally.results += [result(5.0)] * 10  # the first window: the start, not judged
    tally.results += [result(12.0)] * 9 + [result(13.0, latency_s=2.0)]  # 9 of 10 good
    tally.results += [result(25.0)] * (scr.MIN_JUDGED - 1)  # too few to judge
    tally.results += [result(35.0)] * 5 + [result(36.0, status=503)] * 5  # half failed
    tally.results += [result(45.0)] * 10  # past the load's end (40 s): not judged
    assert scr.windows(tally, seconds=40.0, window_s=10.0) == [0.9, 0.5]
    figures = scr.class_figures(tally, seconds=40.0, window_s=10.0)
    assert (figures["windows_met"], figures["windows_judged"]) == (1, 2)
    assert (figures["sent"], figures["failed"]) == (44, 5)
    assert figures["goodput"] == round(38 / 40.0, 3)


def test_the_section_goes_right_after_the_simulated_benchs(tmp_path: Path) -> None:
    md = tmp_path / "benchmarks.md"
    md.write_text(
        "# B\n\n<!-- slo-classes:start -->\nsim\n\n<!-- slo-classes:end -->\n\n"
        "<!-- later:start -->\nx\n\n<!-- later:end -->\n"
    )
    scr.write_section(md, "first\n")
    scr.write_section(md, "second\n")  # replaced where it is
    text = md.read_text()
    assert text.count(f"<!-- {scr.SECTION}:start -->") == 1
    assert "first" not in text
    sim_end = text.index("<!-- slo-classes:end -->")
    assert sim_end < text.index("second") < text.index("<!-- later:start -->")
