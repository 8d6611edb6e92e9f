"""Fuzzing the HTTP API from its own /openapi.json with schemathesis.

Schemathesis reads the live server's document and generates, for every operation,
requests that fit it (positive) and requests that break it (negative: wrong types,
out-of-range values, missing or extra fields, a missing admin token). Each answer
must pass schemathesis' own checks (no 5xx, a documented status and content type,
a JSON body of the documented schema, invalid data refused) and ours: every 4xx body
is the error shape, and a stream is JSON events, each a chunk or an error, ending
`data: [DONE]`. Used by tests/integration/test_openapi_fuzz.py (few examples) and
bench/fuzz.py (many).

    with serve_on_thread(max_tokens=4, admin_token="t") as url:
        fuzzer = Fuzzer.connect(url, token="t")
        for operation in fuzzer.operations():
            tally = fuzzer.fuzz(operation, GenerationMode.NEGATIVE, examples=50)
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import Case, GenerationMode, Response
from schemathesis.checks import CheckContext, not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.transport import response_content_type
from schemathesis.schemas import APIOperation, BaseSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

ERROR_KEYS = {"message", "type", "code", "param"}
REQUEST_TIMEOUT_S = 60.0


@schemathesis.check
def error_shape(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """Every 4xx body is {"error": {"message", "type", "code", "param"}} with a message:
    the schema alone would accept a 4xx the document does not list."""
    if not 400 <= response.status_code < 500:
        return None
    answer = json.loads(response.content)
    assert isinstance(answer, dict) and set(answer) == {"error"}, f"not the error shape: {answer}"
    assert set(answer["error"]) == ERROR_KEYS, f"error keys {sorted(answer['error'])}"
    assert answer["error"]["message"], "an empty error message"
    return True


def _is_event_stream(response: Response) -> bool:
    return (response_content_type(response) or "").startswith("text/event-stream")


@schemathesis.check
def json_schema_conformance(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """schemathesis' response_schema_conformance for JSON answers. It would read the
    stream's `{"type": "string"}` (OpenAPI 3.1: the whole body is a string) as the
    schema of each event; event_stream_shape checks the events instead."""
    if _is_event_stream(response):
        return None
    return response_schema_conformance(ctx, response, case)


@schemathesis.check
def event_stream_shape(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """A stream is `data: <JSON>` events, each a chunk (`choices`) or an error in the
    error shape (one that arose after the first event), then `data: [DONE]`."""
    if not _is_event_stream(response):
        return None
    lines = response.content.decode().splitlines()
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"the stream does not end with [DONE]: {events}"
    for event in events[:-1]:
        payload = json.loads(event)
        assert "choices" in payload or set(payload.get("error", ())) == ERROR_KEYS, event
    return True


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    json_schema_conformance,
    event_stream_shape,
    negative_data_rejection,
    error_shape,
]


@dataclass
class Tally:
    """What one operation answered in one generation mode."""

    cases: int = 0
    statuses: Counter[str] = field(default_factory=Counter)  # "2xx", "4xx", ...
    failures: list[str] = field(default_factory=list)  # the first line of each check's report


@dataclass
class Fuzzer:
    base_url: str
    schema: BaseSchema
    session: requests.Session

    @classmethod
    def connect(cls, base_url: str, *, token: str | None) -> Fuzzer:
        """The live server's own document; `token` goes with every request (the admin PUT
        needs it; negative cases that drop or break it are schemathesis' own)."""
        schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", timeout=30)
        session = requests.Session()
        if token is not None:
            session.headers["Authorization"] = f"Bearer {token}"
        return cls(base_url, schema, session)

    def operations(self) -> list[APIOperation]:
        return [result.ok() for result in self.schema.get_all_operations()]

    def fuzz(
        self,
        operation: APIOperation,
        mode: GenerationMode,
        *,
        examples: int,
        derandomize: bool = False,
    ) -> Tally:
        """Up to `examples` generated cases against `operation`. Hypothesis stops at the
        first failing case and shrinks it: the tally holds its report. `derandomize`:
        the same cases every run (the test suite), else new ones (the benchmark)."""
        tally = Tally()

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=derandomize,
            suppress_health_check=list(HealthCheck),
            report_multiple_bugs=False,
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def property_(case: Case) -> None:
            response = case.call(
                base_url=self.base_url, session=self.session, timeout=REQUEST_TIMEOUT_S
            )
            tally.cases += 1
            tally.statuses[f"{response.status_code // 100}xx"] += 1
            case.validate_response(response, checks=CHECKS)

        try:
            property_()
        except Unsatisfiable:  # negative mode with nothing to break: no body, no parameters
            pass
        # a check's failure (an AssertionError), several at once, or no answer at all
        except (AssertionError, FailureGroup, requests.RequestException) as exc:
            tally.failures.append(str(exc).strip())
        return tally

    def healthy(self) -> bool:
        response = self.session.get(f"{self.base_url}/healthz", timeout=REQUEST_TIMEOUT_S)
        return response.status_code == 200 and response.json() == {"status": "ok"}
