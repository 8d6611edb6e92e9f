"""A request's SLO class (server/http/slo_class.py): the bound key's, the header's, the
`priority` field's by vLLM's order, else the default class."""

from __future__ import annotations

from pathlib import Path

import pytest
from batchpilot_server.batching_config import SloClass, SloTargets
from batchpilot_server.http.protocol import ApiError
from batchpilot_server.http.slo_class import RequestClass, class_of
from batchpilot_server.serve_options import UsageError, class_keys, parser

SLO = SloTargets(
    e2e_ms=5000.0,
    classes=(
        SloClass("chat", 10, ttft_ms=500.0),
        SloClass("agent", 10, e2e_ms=60000.0),  # as high as chat, listed after it
        SloClass("batch", -5, e2e_ms=600000.0),
    ),
)


def pick(**given: object) -> RequestClass:
    asked = {"bound": None, "header": None, "priority": None, **given}
    return class_of(SLO, **asked)  # type: ignore[arg-type]


def test_nothing_named_is_the_default_class() -> None:
    assert pick() == RequestClass("default", 0)
    assert pick(header="  ") == RequestClass("default", 0)  # an empty header names nothing


def test_the_bound_class_wins_over_the_header_and_the_priority() -> None:
    assert pick(bound="batch", header="chat", priority=-100) == RequestClass("batch", -5)
    assert pick(header="agent", priority=100) == RequestClass("agent", 10)


@pytest.mark.parametrize(
    ("priority", "expected"),
    [(-11, "chat"), (-10, "chat"), (-9, "default"), (0, "default"), (1, "batch"), (9, "batch")],
)
def test_a_priority_gets_the_highest_class_not_above_what_it_asked(
    priority: int, expected: str
) -> None:
    # ties (chat and agent at 10) go to the class listed first
    assert pick(priority=priority).name == expected


def test_a_priority_below_every_class_gets_the_lowest() -> None:
    only_high = SloTargets(classes=(SloClass("chat", 10, ttft_ms=500.0),))
    assert class_of(only_high, bound=None, header=None, priority=50) == RequestClass("default", 0)
    assert class_of(SloTargets(), bound=None, header=None, priority=-7).name == "default"


def test_an_unknown_name_is_a_400_naming_every_class() -> None:
    for given in ({"header": "gold"}, {"bound": "gold"}):
        with pytest.raises(ApiError) as caught:
            pick(**given)
        assert caught.value.status == 400 and caught.value.code == "unknown_slo_class"
        assert caught.value.message.endswith("known classes: default, chat, agent, batch")


def test_keys_bound_to_classes_are_read_and_checked(tmp_path: Path) -> None:
    (tmp_path / "batch").write_text("batch-key\n")
    (tmp_path / "same").write_text("free-key")
    args = parser().parse_args(["--api-key-class", f"batch={tmp_path / 'batch'}"])
    (bound,) = class_keys(args, "free-key")
    assert (bound.slo_class, bound.file.current()) == ("batch", "batch-key")
    for flag, words in (
        ("batch", "give CLASS=KEY_FILE"),
        (f"Batch UI={tmp_path / 'batch'}", "is no SLO class name"),
        (f"batch={tmp_path / 'none'}", "cannot read"),
        (f"batch={tmp_path / 'same'}", "two keys are the same"),
    ):
        with pytest.raises(UsageError, match=words):
            class_keys(parser().parse_args(["--api-key-class", flag]), "free-key")
