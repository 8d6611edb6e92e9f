"""The output side of the API on the engine's own event types: a choice's text and
log-probability entries as tokens arrive, and the two wire shapes of logprobs."""

from __future__ import annotations

import json
from pathlib import Path

from batchpilot_server.engine_api import PromptLogprob, TokenEvent
from batchpilot_server.http.generation_defaults import GenerationDefaults, generation_defaults
from batchpilot_server.http.protocol_output import (
    LOGPROB_FLOOR,
    ChoiceOutput,
    TokenSpeller,
    chat_logprobs,
    completion_logprobs,
)
from batchpilot_server.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
A, B, C = ord("a"), ord("b"), ord("c")


def choice(**options: object) -> ChoiceOutput:
    defaults: dict[str, object] = {
        "echo_text": None, "prompt_ids": [TOKENIZER.bos_id, A], "logprobs": True, "output": True,
    }  # fmt: skip
    return ChoiceOutput(
        0,
        TOKENIZER,
        TokenSpeller(TOKENIZER),
        ("bc",),
        **{**defaults, **options},  # type: ignore[arg-type]
    )


def test_a_stop_string_cuts_the_text_and_the_entries_follow_the_tokens() -> None:
    output = choice()
    deltas = [
        output.feed(TokenEvent(A, 0, None, -0.5, top_logprobs=((A, -0.5), (B, -1.0)))),
        output.feed(TokenEvent(B, 1, None, -0.25)),
        output.feed(TokenEvent(C, 2, None, -0.125)),
    ]
    # each text waits until it cannot begin "bc"; "bc" then stops the choice
    assert [d.text for d in deltas] == ["", "a", ""]
    assert output.finish_reason == "stop" and output.text == "a"
    assert [d.offset for d in deltas] == [0, 1, 2]
    shape = completion_logprobs(output.entries, TokenSpeller(TOKENIZER), 2, 0)
    assert shape.tokens == ["a", "b", "c"]
    assert shape.token_logprobs == [-0.5, -0.25, -0.125]
    # the k best, and the chosen token where the engine gave none (as vLLM)
    assert shape.top_logprobs == [{"a": -0.5, "b": -1.0}, {"b": -0.25}, {"c": -0.125}]
    assert shape.text_offset == [0, 1, 2]


def test_echo_puts_the_prompt_first_with_a_null_first_entry() -> None:
    output = choice(echo_text="a")
    scored = (None, PromptLogprob(A, -3.0, ((B, -2.0),)))
    delta = output.feed(TokenEvent(B, 0, "length", -0.1, prompt_logprobs=scored))
    assert delta.text == "ab" and output.text == "ab" and output.finish_reason == "length"
    shape = completion_logprobs(output.entries, TokenSpeller(TOKENIZER), 1, 0)
    assert shape.tokens == ["", "a", "b"]  # BOS spells as nothing
    assert shape.token_logprobs == [None, -3.0, -0.1]
    assert shape.top_logprobs == [None, {"b": -2.0, "a": -3.0}, {"b": -0.1}]
    assert shape.text_offset == [0, 0, 1]


def test_max_tokens_zero_with_echo_answers_the_prompt_alone() -> None:
    output = choice(echo_text="a", output=False)
    delta = output.feed(TokenEvent(B, 0, None, -0.1, prompt_logprobs=(None, None)))
    assert delta.text == "a" and output.finish_reason == "length"
    assert output.completion_tokens == 0
    assert [e.token_id for e in output.entries] == [TOKENIZER.bos_id, A]


def test_chat_logprobs_list_alternatives_with_bytes_and_a_floor_for_minus_infinity() -> None:
    output = choice()
    output.feed(TokenEvent(0xC3, 0, None, float("-inf"), top_logprobs=((A, -0.1),)))
    shape = chat_logprobs(output.entries, TokenSpeller(TOKENIZER), 1)
    (item,) = shape.content  # type: ignore[misc]
    assert item.token == "\ufffd" and item.bytes == [0xC3]  # half a character: its byte
    assert item.logprob == LOGPROB_FLOOR  # JSON has no -Infinity
    assert [(t.token, t.logprob, t.bytes) for t in item.top_logprobs] == [("a", -0.1, [A])]


def test_generation_defaults_come_from_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "temperature": 0.6,
                "top_p": 0.9,
                "top_k": 50,
                "eos_token_id": 2,
                "repetition_penalty": 99,
            }
        )
    )
    assert generation_defaults(str(tmp_path)) == GenerationDefaults(
        temperature=0.6,
        top_p=0.9,
        top_k=50,  # 99 is outside the API's range: ignored
    )
    assert generation_defaults("tiny") == GenerationDefaults(temperature=1.0)
