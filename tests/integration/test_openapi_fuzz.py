"""Property: the server answers every request schemathesis derives from its own
/openapi.json as that document says, with no 5xx and every 4xx in the error shape.

For each operation schemathesis generates requests that fit the document (positive)
and requests that break it (negative); tests/support/openapi_fuzz.py lists the checks.
The server is the real app and engine on a real port, with an admin token so the
PUT /admin/batching is fuzzed too, and a max_tokens limit of 4 so that generation
stays short. `python bench/fuzz.py` runs the same for minutes.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from batchpilot_server.http.openapi import openapi_document
from schemathesis import GenerationMode

from tests.support.openapi_fuzz import Fuzzer
from tests.support.servers import serve_on_thread

pytestmark = pytest.mark.timeout(300)

TOKEN = "test-token"
EXAMPLES = 40  # per operation and mode; derandomized, so `make test` sees the same cases
# schemathesis leaves out the operation that serves the document it reads
OPERATIONS = [
    f"{method.upper()} {path}"
    for path, item in openapi_document()["paths"].items()
    for method in item
    if path != "/openapi.json"
]


@pytest.fixture(scope="module")
def fuzzer() -> Iterator[Fuzzer]:
    with serve_on_thread(max_tokens=4, admin_token=TOKEN) as url:
        yield Fuzzer.connect(url, token=TOKEN)


def test_every_documented_operation_is_fuzzed(fuzzer: Fuzzer) -> None:
    assert sorted(op.label for op in fuzzer.operations()) == sorted(OPERATIONS)


@pytest.mark.parametrize("mode", list(GenerationMode), ids=str)
@pytest.mark.parametrize("label", OPERATIONS)
def test_operation_answers_as_documented(fuzzer: Fuzzer, label: str, mode: GenerationMode) -> None:
    operation = fuzzer.schema.find_operation_by_label(label)
    assert operation is not None
    tally = fuzzer.fuzz(operation, mode, examples=EXAMPLES, derandomize=True)
    assert not tally.failures, "\n\n".join(tally.failures)
    if mode is GenerationMode.POSITIVE:
        # the cases reached past validation: into generation, or into a new config
        assert tally.statuses["2xx"] > 0, tally.statuses
    assert fuzzer.healthy()


def test_a_vanishing_top_p_leaves_the_server_healthy() -> None:
    # a server of its own: the failure takes the engine down with it
    with serve_on_thread(max_tokens=4, admin_token=TOKEN) as url:
        fuzzer = Fuzzer.connect(url, token=TOKEN)
        body = {"prompt": "hi", "temperature": 1.0, "top_p": 1e-200}
        answer = fuzzer.session.post(f"{url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert fuzzer.healthy()
