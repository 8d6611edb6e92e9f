"""Property: any body to any endpoint gets a success or a 4xx in the error shape, never a 5xx.

Bodies come from hypothesis: a valid body with one field of any value of its
documented shape, values of the shape /openapi.json documents for the
endpoint (bounds ignored), such bodies with fields swapped for any JSON, objects
of the endpoint's fields holding any JSON, any JSON value, and bytes that are
not JSON at all. Strings include lone
surrogates. The server is the real app and engine, run on a thread of its own
so that hypothesis can drive it synchronously; its max_tokens limit keeps each
generation short.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.servers import serve_in_process

pytestmark = pytest.mark.timeout(300)

TOKEN = "test-token"
EXAMPLES = 120  # per endpoint; `make test` stays short
ERROR_KEYS = {"message", "type", "code", "param"}


@dataclass
class Endpoint:
    method: str
    path: str
    schema: str  # its request body in components.schemas
    valid: dict[str, Any]


ENDPOINTS = {
    "completions": Endpoint("POST", "/v1/completions", "CompletionRequest", {"prompt": "hi"}),
    "chat": Endpoint("POST", "/v1/chat/completions", "ChatCompletionRequest",
                     {"messages": [{"role": "user", "content": "hi"}]}),
    "admin": Endpoint("PUT", "/admin/batching", "BatchingUpdate", {"max_batch_size": 8}),
}  # fmt: skip


@dataclass
class Server:
    host: str
    port: int
    openapi: dict[str, Any]

    def request(self, method: str, path: str, body: bytes) -> tuple[int, str, bytes]:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=60)
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"}
        try:
            connection.request(method, path, body=body, headers=headers)
            response = connection.getresponse()
            return response.status, response.getheader("Content-Type", ""), response.read()
        finally:
            connection.close()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    started = threading.Event()
    state: dict[str, Any] = {}

    async def run() -> None:
        async with serve_in_process(max_tokens=8, admin_token=TOKEN) as running:
            state["url"], state["stop"] = running.url, asyncio.Event()
            state["loop"] = asyncio.get_running_loop()
            started.set()
            await state["stop"].wait()

    thread = threading.Thread(target=asyncio.run, args=(run(),), name="fuzzed-server")
    thread.start()
    assert started.wait(60), "the server did not start"
    host, port = state["url"].removeprefix("http://").split(":")
    probe = Server(host, int(port), {})
    status, _, raw = probe.request("GET", "/openapi.json", b"")
    assert status == 200
    try:
        yield Server(host, int(port), json.loads(raw))
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(60)


TEXT = st.text(st.characters() | st.characters(categories=["Cs"]), max_size=12)
SCALARS = (
    st.none() | st.booleans() | st.integers() | st.integers(-3, 3)
    | st.floats() | TEXT
)  # fmt: skip
JSON = st.recursive(
    SCALARS,
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(TEXT, children, max_size=4),
    max_leaves=12,
)


def shaped(schema: dict[str, Any], schemas: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values of a JSON schema's shape with its bounds ignored: checking them is the
    server's job. Lets the fuzzing reach past the type checks, into generation."""
    if "$ref" in schema:
        return shaped(schemas[schema["$ref"].rsplit("/", 1)[1]], schemas)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([shaped(option, schemas) for option in schema[key]])
    if "const" in schema or "enum" in schema:
        return st.sampled_from(schema.get("enum", [schema.get("const")])) | SCALARS
    kind = schema.get("type")
    if kind == "object":
        properties = {k: shaped(v, schemas) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: v for k, v in properties.items() if k in required},
            optional={k: v for k, v in properties.items() if k not in required},
        )
    if kind == "array":
        return st.lists(shaped(schema.get("items", {}), schemas), max_size=4)
    scalars = {
        "integer": st.integers(-1, 20) | st.integers(),
        "number": st.floats(-0.5, 2.5) | st.floats(),
        "string": TEXT,
        "boolean": st.booleans(),
        "null": st.none(),
    }
    return scalars.get(kind, JSON)


def bodies(server: Server, endpoint: Endpoint) -> st.SearchStrategy[bytes]:
    schemas = server.openapi["components"]["schemas"]
    schema = schemas[endpoint.schema]
    fields = list(schema["properties"])
    well_shaped = shaped(schema, schemas)
    one_field = st.sampled_from(fields).flatmap(
        lambda name: shaped(schema["properties"][name], schemas).map(lambda v: {name: v})
    )
    own_fields = st.dictionaries(st.sampled_from(fields) | TEXT, JSON, max_size=5)
    swapped = st.tuples(well_shaped, st.dictionaries(st.sampled_from(fields), JSON, max_size=2))
    documents = st.one_of(
        one_field.map(lambda field: {**endpoint.valid, **field}),
        well_shaped,
        swapped.map(lambda pair: {**pair[0], **pair[1]}),
        own_fields,
        JSON,
    )
    return documents.map(lambda body: json.dumps(body).encode()) | st.binary(max_size=40)


def check_answer(endpoint: Endpoint, status: int, content_type: str, raw: bytes) -> None:
    assert status < 500, raw[:500]
    if status == 200 and content_type.startswith("text/event-stream"):
        events = [line for line in raw.decode().split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        for event in events[:-1]:
            payload = json.loads(event.removeprefix("data: "))
            assert "choices" in payload or set(payload["error"]) == ERROR_KEYS
        return
    answer = json.loads(raw)
    if status == 200:
        expected = {"admin": "version", "completions": "choices", "chat": "choices"}
        assert expected[next(k for k, e in ENDPOINTS.items() if e is endpoint)] in answer
    else:
        assert 400 <= status < 500
        assert set(answer) == {"error"} and set(answer["error"]) == ERROR_KEYS
        assert answer["error"]["message"]


@pytest.mark.parametrize("name", ENDPOINTS)
def test_any_body_gets_a_success_or_a_4xx_in_the_error_shape(server: Server, name: str) -> None:
    endpoint = ENDPOINTS[name]

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        database=None,
    )
    @given(body=bodies(server, endpoint))
    def property_(body: bytes) -> None:
        check_answer(endpoint, *server.request(endpoint.method, endpoint.path, body))

    property_()
    assert server.request("GET", "/healthz", b"")[0] == 200
