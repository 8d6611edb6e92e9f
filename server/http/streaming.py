"""Server-sent events: a generation's stream, its error event when it fails after
the headers went out, and `data: [DONE]`."""

from __future__ import annotations

import json

from aiohttp import web
from batchpilot_server.http.accounting import RequestEnd
from batchpilot_server.http.answer_formats import AnswerFormat
from batchpilot_server.http.generation import Generation
from batchpilot_server.http.protocol import ApiError
from batchpilot_server.http.protocol_output import ChoiceDelta
from pydantic import BaseModel


async def stream_answer(
    request: web.Request, generation: Generation, answer_format: AnswerFormat, end: RequestEnd
) -> web.StreamResponse:
    # Wait for the first token before sending headers, so that a full queue or
    # a missed deadline still gets its own status code.
    delta = await generation.next_delta()
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    # Most events differ only in their text: serialize the rest once per choice.
    frames: dict[int, tuple[bytes, bytes]] = {}
    try:
        for event in answer_format.opening(generation):
            await _send_event(response, event)
        while delta is not None:
            if delta.finish_reason is not None:
                usage = generation.usage() if generation.finished else None
                await _send_event(response, answer_format.event(generation, delta, usage))
            elif delta.entries or generation.parsed.logprobs is not None:
                await _send_event(response, answer_format.event(generation, delta))
            else:
                head, tail = frames.get(delta.index) or _text_frame(
                    answer_format, generation, delta.index, frames
                )
                text = json.dumps(delta.text).encode()
                await response.write(b"data: " + head + text + tail + b"\n\n")
            delta = await generation.next_delta()
    except ApiError as err:
        # Headers are gone: the error travels as an event and the request counts as failed.
        end.record("error", err.status)
        await _send_event(response, err.answer())
        await response.write(b"data: [DONE]\n\n")
        raise StreamEnded(response) from err
    except ConnectionResetError as exc:
        raise StreamEnded(response) from exc
    if generation.parsed.include_usage_chunk:
        await _send_event(response, answer_format.usage_event(generation))
    end.record("ok")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _text_frame(
    answer_format: AnswerFormat,
    generation: Generation,
    index: int,
    frames: dict[int, tuple[bytes, bytes]],
) -> tuple[bytes, bytes]:
    """A text event of choice `index` split around its text, to be filled per token."""
    placeholder = answer_format.event(generation, ChoiceDelta(index, "\x00"))
    head, tail = placeholder.model_dump_json().encode().split(b'"\\u0000"')
    frames[index] = (head, tail)
    return head, tail


class StreamEnded(Exception):
    """An SSE stream ended early (error event sent, or client gone) after its headers."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("stream ended early")
        self.response = response


async def _send_event(response: web.StreamResponse, event: BaseModel) -> None:
    await response.write(b"data: " + event.model_dump_json().encode() + b"\n\n")
