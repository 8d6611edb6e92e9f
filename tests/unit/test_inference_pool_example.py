"""The InferencePool example selects the pods its policy runs, on the server's port, and
its endpoint picker calls a pod full where the policy would."""

from __future__ import annotations

import yaml
from batchpilot_operator.builders import SERVER_PORT, selector_labels

from tests.support import ROOT

EXAMPLES = ROOT / "manifests" / "examples"


def test_the_inference_pool_selects_its_policys_pods_with_its_thresholds() -> None:
    pool, epp_config = yaml.safe_load_all(
        (EXAMPLES / "inference-gateway" / "inferencepool.yaml").read_text()
    )
    policy = yaml.safe_load((EXAMPLES / "cpu-policy.yaml").read_text())
    name = policy["metadata"]["name"]
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    assert pool["metadata"]["namespace"] == policy["metadata"]["namespace"]
    assert pool["spec"]["selector"]["matchLabels"] == selector_labels(name)
    assert pool["spec"]["targetPorts"] == [{"number": SERVER_PORT}]
    detector = yaml.safe_load(epp_config["data"]["config.yaml"])["saturationDetector"]
    assert detector["kvCacheUtilThreshold"] == policy["spec"]["autotune"]["kvHighWatermark"]
    assert detector["queueDepthThreshold"] == policy["spec"]["batching"]["maxBatchSize"]["initial"]
