"""What a chat request wants its output to match: `response_format`, or a forced
tool call (`tool_choice` "required" or named), as the schema grammar_compiler.py compiles."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from batchpilot_server.batching_config import brief
from batchpilot_server.http.protocol import ChatCompletionRequest, invalid, unsupported
from batchpilot_server.http.request_validation import printable


@dataclass(frozen=True)
class GrammarRequest:
    """What a request wants its output to match (grammar_compiler.py compiles it): any
    JSON object, or a JSON schema. `param`: the request field an error names."""

    schema: dict[str, Any] | None  # None: any JSON object (json_object)
    param: str

    @property
    def key(self) -> str:
        """The schema's text, as the compiled grammars are cached by (keys in their
        order: the output writes properties in the schema's order)."""
        return "" if self.schema is None else json.dumps(self.schema)


def output_structure(
    request: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> tuple[GrammarRequest | None, tuple[str, ...]]:
    """The grammar `response_format` or a forced tool choice asks for, and the names of
    the tools whose calls are parsed from the output."""
    functions = [tool["function"] for tool in tools or ()]
    names = tuple(function["name"] for function in functions)
    choice: Any = request.tool_choice
    param = "tool_choice"
    if choice is None and request.function_call is not None:
        choice, param = request.function_call, "function_call"
    if not isinstance(choice, str) and choice is not None:  # a named function
        name = choice.function.name if hasattr(choice, "function") else choice.name
        if name not in names:
            offered = ", ".join(names) or "none"
            raise invalid(
                f"{param} names the function {brief(printable(name))}, which is not among "
                f"the tools offered ({brief(offered)})",
                param=param,
            )
        functions, choice = [f for f in functions if f["name"] == name], "required"
    if choice == "required" and not functions:
        raise invalid(f"{param} is required, but the request offers no tools", param=param)
    if choice == "none":
        names = ()
    forced = _call_grammar(functions, param) if choice == "required" else None
    formatted = _response_grammar(request)
    if forced is not None and formatted is not None:
        raise invalid(
            "response_format cannot be combined with a required or named tool_choice: both "
            "constrain the output",
            param="response_format",
        )
    return forced or formatted, names


def _response_grammar(request: ChatCompletionRequest) -> GrammarRequest | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarRequest(None, "response_format")
    if response_format.json_schema is None:
        raise invalid(
            "response_format.json_schema is required with type json_schema",
            code="missing_field",
            param="response_format.json_schema",
        )
    schema = response_format.json_schema.schema_
    return GrammarRequest(schema, "response_format.json_schema.schema")


def _call_grammar(functions: list[dict[str, Any]], param: str) -> GrammarRequest:
    """One call of one of `functions`, written as Llama 3.1's JSON: {"name", "arguments"}.
    Each tool's `$defs` move to the root, where its `#/$defs/...` references point."""
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    options = []
    for function in functions:
        arguments = dict(function.get("parameters") or {"type": "object"})
        for key, found in defs.items():
            found.update(arguments.pop(key, None) or {})
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return GrammarRequest({**schema, **{key: found for key, found in defs.items() if found}}, param)


def check_grammar_params(request: ChatCompletionRequest) -> None:
    """What structured output cannot honour: it must be free to end on EOS once the
    output is complete."""
    if request.ignore_eos:
        raise unsupported("ignore_eos", "cannot be combined with structured output")
    if request.min_tokens:
        raise unsupported("min_tokens", "cannot be combined with structured output")
