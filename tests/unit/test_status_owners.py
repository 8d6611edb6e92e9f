"""One writer per status key (issue 40): the table in status_owners.py is disjoint, each
writer builds only its own keys, the CRD's status is exactly what the table owns, and no
other code writes status fields. A second writer of a key fails here."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from batchpilot_operator import autotune, reconcile, status_owners
from batchpilot_operator.policy.mode import ModeChoice, ModeState
from batchpilot_operator.policy.round import Decision
from batchpilot_operator.policy.types import Fleet, ReplicaState, ScaleDecision
from batchpilot_operator.reconcile import Outcome, in_force_fields, reconcile_fields
from batchpilot_operator.signals import ClassSignals, Signals
from batchpilot_operator.spec import SpecError, parse_spec
from batchpilot_operator.status_owners import CONDITION_OWNERS, OWNERS, status_paths
from batchpilot_operator.tuning_loop import ActuationReport, TuneStep

from tests.support.policies import policy_object

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = ROOT / "operator"

# Every call of write_status that passes status fields (not `{}`): module.function.
# Each passes the output of its module's owner in OWNERS; a new entry needs a new
# owner there, which the disjointness test then checks.
FIELD_WRITERS = {
    "reconcile.reconcile",  # _status_fields: in_force_fields + reconcile_fields
    "reconcile._report_invalid",  # reconcile_fields
    "reconcile.write_in_force",  # in_force_fields
    "autotune.record",  # StatusRecorder.record: autotune.status_fields
}

SPEC = {
    "batching": {"mode": "auto"},
    "slo": {"ttftMs": 500, "classes": [{"name": "batch", "e2eMs": 9000}]},
    "autoscale": {"minReplicas": 1, "maxReplicas": 4},
}


def test_no_status_key_has_two_owners() -> None:
    for (one, keys), (other, others) in itertools.combinations(OWNERS.items(), 2):
        assert not keys & others, f"{sorted(keys & others)} written by both {one} and {other}"


def test_reconcile_writes_only_its_keys() -> None:
    policy = policy_object("p", "ml", SPEC, uid="u")
    spec = parse_spec(SPEC)
    outcome = Outcome(spec=spec, config=spec.initial_config(), mode="dynamic")
    assert status_paths(reconcile_fields(policy, outcome)) == OWNERS["reconcile.reconcile_fields"]
    invalid = Outcome(spec=None, error=SpecError("Invalid", "bad"))
    assert status_paths(reconcile_fields(policy, invalid)) <= status_owners.RECONCILE
    for mode_spec, reason in (({"mode": "auto"}, "chosen"), ({"mode": "static"}, None)):
        other = parse_spec({**SPEC, "batching": mode_spec})
        fields = in_force_fields(other.initial_config(), "static", other, reason)
        assert status_paths(fields) == OWNERS["reconcile.in_force_fields"]


def test_a_round_writes_only_its_record() -> None:
    spec = parse_spec(SPEC)
    signals = Signals(
        status="ok", window_s=60, requests=100, slo_judged=100, slo_met=99,
        p99_latency_s=1.0, ttft_p99_s=0.2, tpot_p99_s=0.01, budget_attainment=0.99,
        kv_usage=0.5, request_rate=2.0, tokens_per_s=50.0, slo_missed={"all": 1},
        classes={"batch": ClassSignals("batch", slo_judged=10, slo_met=10)},
    )  # fmt: skip
    decision = Decision(
        spec.initial_config(), "grow", "room",
        scale=ScaleDecision(2, "scale_out", "load", ReplicaState()),
        mode=ModeChoice("continuous", "spread", ModeState(), switched=True),
    )  # fmt: skip
    step = TuneStep(1, 0.0, signals, spec.initial_config(), decision, ActuationReport(),
                    fleet=Fleet(1, 1))  # fmt: skip
    fields = autotune.status_fields(step, [], "2026-01-01T00:00:00Z", spec.slo)
    assert status_paths(fields) == OWNERS["autotune.status_fields"]


def test_the_crd_status_is_what_the_owners_write() -> None:
    crd = yaml.safe_load((ROOT / "crds" / "batchingpolicy.yaml").read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    declared = set(schema["properties"]) - {"conditions", "slo"}  # slo: owned by sub-key
    declared |= {f"slo.{sub}" for sub in schema["properties"]["slo"]["properties"]}
    owned = set().union(*OWNERS.values())
    assert declared == owned


def _write_status_callers(path: Path) -> set[str]:
    """module.function for each write_status call in `path` whose fields are not `{}`."""
    tree = ast.parse(path.read_text())
    callers: set[str] = set()
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for call in ast.walk(function):
            if isinstance(call, ast.Call) and _named(call.func) == "write_status":
                fields: Any = call.args[2] if len(call.args) > 2 else None
                if not (isinstance(fields, ast.Dict) and not fields.keys):
                    callers.add(f"{path.stem}.{function.name}")
    return callers


def _named(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    return func.attr if isinstance(func, ast.Attribute) else None


def test_only_the_owners_pass_status_fields_to_write_status() -> None:
    callers = set().union(*(_write_status_callers(p) for p in OPERATOR.rglob("*.py")))
    assert callers == FIELD_WRITERS, (
        "a new writer of status fields: give its keys an owner in status_owners.py "
        "(one writer per key) and list it here"
    )


def _status_patches(path: Path) -> list[str]:
    """Where `path` patches the status subresource itself (a call ending in "status")."""
    return [
        f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and _named(node.func) == "patch" and node.args
        and isinstance(node.args[-1], ast.Constant) and node.args[-1].value == "status"
    ]  # fmt: skip


def test_only_write_status_patches_the_status_subresource() -> None:
    patches = [hit for p in OPERATOR.rglob("*.py") for hit in _status_patches(p)]
    assert len(patches) == 1 and patches[0].startswith("reconcile.py:"), patches


def _condition_types(module: ModuleType) -> set[str]:
    """The condition types `module` builds: the "type" of its dict literals."""
    path = Path(str(module.__file__))
    types: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Dict):
            continue
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "type":
                if isinstance(value, ast.Name):
                    types.add(getattr(module, value.id))
                elif isinstance(value, ast.Constant):
                    types.add(value.value)
    return types


def test_each_condition_type_is_built_by_its_one_module() -> None:
    # the modules that call write_status with conditions
    for module in (reconcile, autotune):
        name = module.__name__.rsplit(".", 1)[-1]
        built = _condition_types(module)
        owned = {type_ for type_, owner in CONDITION_OWNERS.items() if owner == name}
        assert built == owned, f"{name} builds {sorted(built)}, owns {sorted(owned)}"
