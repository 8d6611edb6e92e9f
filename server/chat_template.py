"""Chat templates: a model's jinja2 template rendered as transformers'
`apply_chat_template` renders it (the sandbox, its helpers), so the prompt text is the
same; and ChatML, for models without a template of their own."""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, for models without a template of their own (the tiny preset), with tools in
# the Hermes format that Qwen2.5's template writes: the tools' JSON schemas in the
# system turn, calls as <tool_call>{json}</tool_call>, results as <tool_response>
CHATML_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Function signatures are within "
    "<tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and "
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
    '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message['content'] %}{{- message['content'] + '\\n' }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>\\n{\\\"name\\\": ' + call['function']['name'] | tojson + "
    "', \\\"arguments\\\": ' + call['function']['arguments'] | tojson + '}\\n</tool_call>' }}"
    "{%- if not loop.last %}{{- '\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' and tools %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
    "'\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template refuses the conversation."""


class ChatTemplate:
    """A model's jinja2 chat template with the special-token strings it may read."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str]) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens)

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.source is None:
            raise ChatTemplateError(
                "this model has no chat template; use /v1/completions, or start the server "
                "with --chat-template FILE"
            )
        try:
            return _compiled(self.source).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # a template meeting what it did not expect (a null content joined to text)
            raise ChatTemplateError(
                f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}"
            ) from exc

    @classmethod
    def from_file(cls, path: Path, special_tokens: Mapping[str, str]) -> ChatTemplate:
        """--chat-template: a jinja2 file that must compile (checked now, not per request)."""
        source = path.read_text(encoding="utf-8")
        try:
            _compiled(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{path}: not a valid jinja2 template: {exc}") from exc
        return cls(source, special_tokens)


@lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    """The environment transformers' apply_chat_template renders in."""

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        # jinja's own tojson escapes HTML characters, which templates do not expect
        return json.dumps(
            value,
            ensure_ascii=ensure_ascii,
            indent=indent,
            separators=separators,
            sort_keys=sort_keys,
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
