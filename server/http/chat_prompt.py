"""A chat request's prompt: its messages (and tools) handed to the model's chat
template as vLLM and transformers hand them over, rendered and tokenized."""

from __future__ import annotations

import json
from typing import Any

from batchpilot_server.chat_template import ChatTemplateError
from batchpilot_server.http.protocol import ChatMessage, Tool, ToolCall, invalid
from batchpilot_server.tokenizer import Tokenizer


def template_tools(
    tools: list[Tool] | None, functions: list[Any] | None
) -> list[dict[str, Any]] | None:
    """The tools as transformers' apply_chat_template passes them (`tools=`): OpenAI's
    `{"type": "function", "function": {...}}` dicts; deprecated `functions` become such."""
    if tools:
        return [tool.model_dump(exclude_none=True) for tool in tools]
    if functions:
        return [
            {"type": "function", "function": function.model_dump(exclude_none=True)}
            for function in functions
        ]
    return None


def render_chat_ids(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    turns = [_for_template(message, i) for i, message in enumerate(messages)]
    try:
        text = tokenizer.render_chat(
            turns, add_generation_prompt=add_generation_prompt, tools=tools
        )
    except ChatTemplateError as exc:
        raise invalid(str(exc), code="chat_template_error", param="messages") from exc
    # The template writes the special tokens itself, as transformers renders it.
    return tokenizer.encode(text, add_special_tokens=False)


# roles as chat templates know them: `developer` is OpenAI's newer name of the system turn
_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}


def _for_template(message: ChatMessage, index: int) -> dict[str, Any]:
    """The message as chat templates read it (as vLLM and transformers hand it over):
    text parts joined into one string, tool-call arguments as the JSON object they hold.
    An assistant turn's null content (beside its tool calls) becomes "", as vLLM renders
    it: templates join content to text (SmolLM2's `+ message['content'] +`), and those
    that test it (`if message['content']`) read "" as they read null."""
    content = message.content
    calls = list(message.tool_calls or ())
    if content is None and not (message.role == "assistant" and (calls or message.function_call)):
        param = f"messages[{index}].content"
        raise invalid(
            f"{param} is required (null only in an assistant turn with tool_calls)",
            code="missing_field",
            param=param,
        )
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    turn: dict[str, Any] = {"role": _TEMPLATE_ROLES.get(message.role, message.role)}
    turn["content"] = content or ""
    if message.name is not None:
        turn["name"] = message.name
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.function_call is not None:
        calls.append(_legacy_call(message, index))
    if calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in calls
        ]
    return turn


def _legacy_call(message: ChatMessage, index: int) -> ToolCall:
    assert message.function_call is not None
    return ToolCall(id=f"call_{index}", function=message.function_call)


def _arguments(text: str) -> Any:
    """Templates index the arguments (`tool_call.arguments | tojson`, `.items()`): the
    object the JSON text holds, as vLLM passes it; text that is no object stays text."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text
