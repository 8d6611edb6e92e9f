"""A request's SLO class: which targets judge it, and the priority it is served at.

The first of these that names one decides:

1. the class its API key is bound to (`--api-key-class`): a tenant cannot promote itself;
2. the `x-gateway-inference-objective` header, the Gateway API Inference Extension's way of
   naming an InferenceObjective (the class's name); an unknown name is a 400;
3. the body's `priority` field, with vLLM's meaning (an integer, lower is served earlier);
4. else the default class (the top-level SLO targets, priority 0).

A class's priority has the InferenceObjective's meaning, the other way round (higher is
served first), so a request's `priority` q asks for class priority -q. It gets the class
with the highest priority p <= -q (never a class above what it asked for); when every
class is above that, the lowest class. Ties go to the class listed first, the default
class before the named ones. So with classes chat (10) and batch (-5) beside default (0):
q <= -10 is chat, -9 <= q <= 0 is default (vLLM's default, 0, included), q >= 1 is batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot_server.batching_config import DEFAULT_CLASS, SloClass, SloTargets
from batchpilot_server.http.protocol import ApiError

OBJECTIVE_HEADER = "x-gateway-inference-objective"


@dataclass(frozen=True)
class RequestClass:
    name: str
    priority: int  # higher is served first (the InferenceObjective's meaning)


def class_of(
    slo: SloTargets, *, bound: str | None, header: str | None, priority: int | None
) -> RequestClass:
    """The request's class under the SLO in force (the order in the module's docstring)."""
    classes = slo.by_name()
    if bound is not None:
        return _named(classes, bound, "the class this API key is bound to")
    if header is not None and header.strip():
        return _named(classes, header.strip(), f"the {OBJECTIVE_HEADER} header")
    if priority is not None:
        return _by_request_priority(classes, priority)
    return RequestClass(DEFAULT_CLASS, 0)


def _class_priority(targets: SloClass | None) -> int:
    # the default class is a class without targets of its own when the SLO states none
    return 0 if targets is None else targets.priority


def _named(classes: dict[str, SloClass | None], name: str, source: str) -> RequestClass:
    if name not in classes:
        raise ApiError(
            400,
            f"unknown SLO class {name!r} ({source}); known classes: {', '.join(classes)}",
            code="unknown_slo_class",
        )
    return RequestClass(name, _class_priority(classes[name]))


def _by_request_priority(classes: dict[str, SloClass | None], priority: int) -> RequestClass:
    ranked = [RequestClass(name, _class_priority(c)) for name, c in classes.items()]
    asked = -priority
    within = [c for c in ranked if c.priority <= asked]
    if within:  # max and min keep the first of equals: the order listed
        return max(within, key=lambda c: c.priority)
    return min(ranked, key=lambda c: c.priority)
