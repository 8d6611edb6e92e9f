"""The operator publishes each SLO class's attainment objective for the per-class alerts."""

from __future__ import annotations

from batchpilot_operator.policy_metrics import SLO_CLASS_ATTAINMENT_OBJECTIVE, PolicyMetrics
from batchpilot_operator.slo import Slo, SloClass
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def class_objectives(metrics: PolicyMetrics) -> dict[tuple[str, str], float]:
    page = generate_latest(metrics.registry).decode()
    return {
        (sample.labels["policy"], sample.labels["class"]): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == SLO_CLASS_ATTAINMENT_OBJECTIVE
    }


def test_each_class_and_default_publish_their_objective_and_go_with_them() -> None:
    metrics = PolicyMetrics()
    two = (SloClass("interactive", 10, ttft_s=1.0, attainment=0.99),
           SloClass("batch", e2e_s=120.0, attainment=0.95))  # fmt: skip
    metrics.publish_slo("ml", "llm", Slo(e2e_s=0.5, attainment=0.9, classes=two))
    metrics.publish_slo("ml", "plain", Slo(e2e_s=0.5))
    assert class_objectives(metrics) == {
        ("llm", "default"): 0.9, ("llm", "interactive"): 0.99, ("llm", "batch"): 0.95,
        ("plain", "default"): 0.99,
    }  # fmt: skip
    metrics.publish_slo("ml", "llm", Slo(e2e_s=0.5, attainment=0.9, classes=two[:1]))
    assert ("llm", "batch") not in class_objectives(metrics)  # a class the spec dropped
    metrics.forget("ml", "llm")
    assert class_objectives(metrics) == {("plain", "default"): 0.99}
