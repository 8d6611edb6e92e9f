"""One writer per status key (issue 40): which function writes which key of a
BatchingPolicy's `.status`.

Two writers of one key race: a round's decision and a reconcile of the ConfigMap
would each show their own value, and the last patch wins. So every key has exactly
one function that builds it; everything that writes the key goes through that
function. `slo` is shared by sub-key (a merge patch merges it key by key): reconcile
owns the stated targets, the tuning round what the window measured. The conditions
are merged by type (`reconcile.set_conditions`) and owned by type the same way.

tests/unit/test_status_owners.py holds the writers to this table: the sets are
disjoint, each writer returns only its own keys, and no other code passes status
fields to `write_status`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Sub-keys of these keys are owned one by one ("slo.objective"); other keys whole.
SHARED_BY_SUB_KEY = frozenset({"slo"})

IN_FORCE = frozenset({
    "maxBatchSize", "batchTimeoutMs", "numSpeculativeTokens", "mode", "modeReason",
})  # fmt: skip
RECONCILE = frozenset({
    "observedGeneration", "replicas", "readyReplicas", "selector",
    "slo.objective", "slo.ttftMs", "slo.tpotMs", "slo.e2eMs",
    "slo.attainmentTarget", "slo.budgetWindow",
})  # fmt: skip
ROUND = frozenset({
    "observed", "lastDecision", "history", "replicaState", "lastScaling",
    "slo.judged", "slo.attainment", "slo.missed", "slo.p99TtftMs", "slo.p99TpotMs",
    "slo.p99E2eMs", "slo.budgetAttainment", "slo.errorBudgetRemaining",
    "slo.classes", "slo.bindingClass",
})  # fmt: skip

# The writer (module.function) of each set of keys.
OWNERS: Mapping[str, frozenset[str]] = {
    "reconcile.in_force_fields": IN_FORCE,
    "reconcile.reconcile_fields": RECONCILE,
    "autotune.status_fields": ROUND,
}

# Conditions by type, and the one module that writes each.
CONDITION_OWNERS: Mapping[str, str] = {
    "Ready": "reconcile",
    "Tuning": "autotune",
    "SLOMet": "autotune",
    "MetricsAvailable": "autotune",
    "Autoscaling": "autotune",
}


def status_paths(fields: Mapping[str, Any]) -> frozenset[str]:
    """The keys `fields` writes, with a shared key's sub-keys as `key.sub`."""
    paths: set[str] = set()
    for key, value in fields.items():
        if key in SHARED_BY_SUB_KEY and isinstance(value, Mapping):
            paths.update(f"{key}.{sub}" for sub in value)
        else:
            paths.add(key)
    return frozenset(paths)
