"""The BatchingPolicy CRD as the API server applies it: defaults, schema, then CEL rules
(jsonschema and cel-python standing in for the API server)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import celpy
import jsonschema
import yaml

from tests.support import ROOT

CRD = yaml.safe_load((ROOT / "crds" / "batchingpolicy.yaml").read_text())
(VERSION,) = CRD["spec"]["versions"]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """`value` defaulted the way the API server does: absent fields take `default`, recursively."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = dict(value)
    for key, sub in schema["properties"].items():
        if key not in out and "default" in sub:
            out[key] = copy.deepcopy(sub["default"])
        if key in out:
            out[key] = with_defaults(sub, out[key])
    return out


def to_cel(schema: dict[str, Any], value: Any) -> Any:
    """`value` as CEL sees it in Kubernetes: `type: number` is always a double."""
    if isinstance(value, dict):
        props = schema.get("properties", {})
        return celpy.celtypes.MapType({
            celpy.celtypes.StringType(k): to_cel(props.get(k, {}), v) for k, v in value.items()
        })
    if isinstance(value, list):
        return celpy.celtypes.ListType([to_cel(schema.get("items", {}), v) for v in value])
    if schema.get("type") == "number":
        return celpy.celtypes.DoubleType(value)
    return celpy.json_to_cel(value)


def rules(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any], dict]]:
    """(path, schema node, rule) for every x-kubernetes-validations rule in the schema."""
    for rule in schema.get("x-kubernetes-validations", []):
        yield path, schema, rule
    for key, sub in schema.get("properties", {}).items():
        yield from rules(sub, f"{path}.{key}")


def at(value: Any, path: str) -> Any:
    for key in path.strip(".").split("."):
        if key:
            value = value.get(key) if isinstance(value, dict) else None
    return value


CEL = celpy.Environment()


def cel_failures(obj: dict[str, Any]) -> list[str]:
    failures = []
    for path, node, rule in rules(SCHEMA):
        target = at(obj, path)
        if target is None:
            continue
        program = CEL.program(CEL.compile(rule["rule"]))
        if not program.evaluate({"self": to_cel(node, target)}):
            failures.append(rule["message"])
    return failures


def refusals(obj: dict[str, Any]) -> list[str]:
    """What the API server would say: schema errors first, then (on a defaulted object) CEL."""
    validator = jsonschema.Draft7Validator(SCHEMA)
    errors = [error.message for error in validator.iter_errors(obj)]
    return errors or cel_failures(with_defaults(SCHEMA, obj))
