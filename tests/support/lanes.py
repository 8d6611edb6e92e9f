"""The two lanes `make test` runs side by side (`pytest -n 2`), each whole on one worker.

Most tests time real servers, loads and Prometheus against each other on two cores, so
they run one at a time, in collection order, in the main lane, as they do without xdist.
The tests beside it either run the operator, or its API client, against the API emulator
with fake pods or none (they mostly wait for its rounds, 5 s apart, on a tenth of a core),
or check values against a reference and time nothing (real-model parity, lm-eval,
structured output, promtool), which a busy core slows without changing what they assert.

The controller sees test ids only, so a lane is chosen by module, or by test where a
module's other tests run servers. (xdist_group marks and `--dist loadgroup` would say
it in each module, but on pytest 9.2 that silently stops grouping: pytest-xdist issue
#1386.)
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

MAIN = "main"
BESIDE = "emulator"
BESIDE_THE_SERVERS = frozenset({
    "test_kube.py",
    "test_kube_login.py",
    "test_operator.py",
    "test_operator_chaos.py",
    "test_operator_cli.py",
    "test_operator_emulator.py",
    "test_operator_metrics.py",
    "test_operator_replicas.py",
    "test_autoscale_operator.py::"
    "test_kubectl_scale_writes_through_the_scale_subresource_and_the_operator_follows",
    "test_autotune_operator.py::"
    "test_unreachable_prometheus_sets_metrics_available_false_and_holds",
    # Minutes of pip installing into a fresh virtualenv, then one server and the shortest
    # demo: it times nothing, so it waits beside the main lane rather than in it.
    "test_install.py",
    # Correctness against a reference (transformers, lm-eval, promtool, the schema): they
    # compare values, never time anything, so a busy core slows them without changing
    # what they assert.
    "test_eval_clients.py",
    "test_real_model.py",
    "test_weight_modes.py",
    "test_structured_output.py",
    "test_engine_kv.py",
    "test_logprob_values.py",
    "test_sampler_real_model.py",
    "test_prefix_cache_equality.py",
    "test_spec_decode_serving.py",
    "test_prometheus_rules.py",
})  # fmt: skip


def lane_of(nodeid: str) -> str:
    path, _, test = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1]
    function = test.split("[", 1)[0]
    beside = {module, f"{module}::{function}"} & BESIDE_THE_SERVERS
    return BESIDE if beside else MAIN


class LaneScheduling(LoadScopeScheduling):
    """xdist's scope scheduling with the lane as the scope: a worker takes a lane whole."""

    def _split_scope(self, nodeid: str) -> str:
        return lane_of(nodeid)
