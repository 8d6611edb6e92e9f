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


def test_the_section_states_the_ratio_against_its_target_and_every_row() -> None:
    def cls(met: int) -> dict[str, object]:
        return {"sent": 10, "failed": 0, "windows_met": met, "windows_judged": 5,
                "attainment": 1.0, "goodput": 1.0}  # fmt: skip

    def pool(classes: dict[str, object], seconds: int, peak: int) -> dict[str, object]:
        reasons = ["round 1: scale out"] if peak > 1 else []
        return {"classes": classes, "replica_seconds": seconds, "peak_replicas": peak,
                "moves": [], "scale_reasons": reasons}  # fmt: skip

    r = {
        "rates_rps": {scr.INTERACTIVE: 2.0, scr.BATCH: 1.0},
        "capacity_rps": {scr.INTERACTIVE: 4.0, scr.BATCH: 3.0},
        "targets": {scr.INTERACTIVE: {"ttft_s": 1.0, "tpot_s": 0.015}, scr.BATCH: {"e2e_s": 30}},
        "pools": {
            "shared": pool({scr.INTERACTIVE: cls(5), scr.BATCH: cls(4)}, 170, 2),
            f"separate/{scr.INTERACTIVE}": pool({scr.INTERACTIVE: cls(5)}, 90, 1),
            f"separate/{scr.BATCH}": pool({scr.BATCH: cls(5)}, 90, 1),
        },
        "replica_seconds_shared": 170,
        "replica_seconds_separate": 180,
        "replica_seconds_ratio": 1.059,
    }
    text = scr.markdown(r, 90.0, scr.CADENCE, 8.0)
    assert "= **1.059**" in text and "does not reach 1.3" in text
    assert "| shared | batch | 1.0 | 10 | 0 | 4 / 5 |" in text
    assert text.count("| separate/") == 2
    assert "peaked at 1 and 1" in text and "round 1: scale out" in text


def test_a_requests_tpot_is_its_mean_gap_after_the_first_token() -> None:
    r = result(2.0)
    assert r.tpot_s is None  # one token: no gap to judge
    r.inter_token_s = [0.01, 0.03]
    assert r.tpot_s == 0.02
    tally = Tally(Slo(tpot_s=0.025))
    assert tally.good(r)
    r.inter_token_s = [0.01, 0.05]
    assert not tally.good(r)
