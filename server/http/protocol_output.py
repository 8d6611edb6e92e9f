"""The engine's output side of the API: token events to text, stop strings, logprobs.

One `ChoiceOutput` per engine sequence turns its `TokenEvent`s into the text deltas
and log-probability entries of one choice; the formatting functions below write those
entries in the two shapes OpenAI answers with (completions' parallel lists, chat's list
of tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from batchpilot_server.engine_api import FinishReason, PromptLogprob, TokenEvent
from batchpilot_server.http.answers import (
    ChatLogprobs,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
)
from batchpilot_server.http.tool_calls import ParsedCall
from batchpilot_server.tokenizer import Tokenizer


@dataclass(frozen=True)
class LogprobEntry:
    """One token of a choice's text with what the engine said of its probability."""

    token_id: int
    logprob: float | None  # None: the prompt's first token (nothing precedes it)
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob)


@dataclass
class ChoiceDelta:
    """What one token event adds to a choice: text (possibly empty) and its entries."""

    index: int
    text: str
    entries: list[LogprobEntry] = field(default_factory=list)
    # "tool_calls": the chat choice ended on tool calls (tool_calls.py parsed them)
    finish_reason: FinishReason | Literal["tool_calls"] | None = None
    tool_calls: tuple[ParsedCall, ...] = ()
    # text_offset of the first entry: the length of the choice's text before it
    offset: int = 0


class TokenSpeller:
    """A token's text and UTF-8 bytes, as logprobs name them (cached: the same tokens
    come back in every top-k list)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, bytes]] = {}

    def spell(self, token_id: int) -> tuple[str, bytes]:
        spelled = self._cache.get(token_id)
        if spelled is None:
            raw = self._tokenizer.token_bytes(token_id)
            spelled = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return spelled

    def text(self, token_id: int) -> str:
        return self.spell(token_id)[0]


class ChoiceOutput:
    """One choice's text as its tokens arrive: decoded once each, cut at a stop string,
    with the prompt first under `echo`."""

    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        speller: TokenSpeller,
        stops: tuple[str, ...],
        *,
        echo_text: str | None,
        prompt_ids: list[int],
        logprobs: bool,
        output: bool,
    ) -> None:
        self.index = index
        self._speller = speller
        self._matcher = StopMatcher(stops)
        # Decodes each new token once, instead of the whole completion per token.
        self._decoder = tokenizer.incremental_decoder()
        self._decoded = ""
        self._echo_text = echo_text
        self._prompt_ids = prompt_ids
        self._logprobs = logprobs
        self._output = output  # False: max_tokens 0 with echo; the token is not answered
        self._offset = 0  # text_offset of the next entry
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.entries: list[LogprobEntry] = []

    @property
    def text(self) -> str:
        return (self._echo_text or "") + self._matcher.text

    @property
    def stopped_by_string(self) -> bool:
        return self._matcher.stopped

    def feed(self, event: TokenEvent) -> ChoiceDelta:
        """The delta of one token event; sets `finish_reason` on the last one."""
        delta = ChoiceDelta(self.index, "", offset=self._offset)
        if self.completion_tokens == 0 and self._echo_text is not None:
            delta.text = self._echo_text
            if self._logprobs:
                delta.entries += prompt_entries(self._prompt_ids, event.prompt_logprobs)
        self.completion_tokens += 1
        if not self._output:
            self.completion_tokens = 0
            self.finish_reason = "length"
            return self._finish(delta)
        final = event.finish_reason is not None
        self._decoded += self._decoder.decode([event.token_id], final=final)
        delta.text += self._matcher.feed(self._decoded)
        if self._logprobs:
            delta.entries.append(LogprobEntry(event.token_id, event.logprob, event.top_logprobs))
        if self._matcher.stopped:
            self.finish_reason = "stop"
        elif final:
            self.finish_reason = event.finish_reason
            delta.text += self._matcher.flush()
        return self._finish(delta)

    def _finish(self, delta: ChoiceDelta) -> ChoiceDelta:
        delta.finish_reason = self.finish_reason
        self.entries += delta.entries
        self._offset += sum(len(self._speller.text(e.token_id)) for e in delta.entries)
        return delta


def prompt_entries(
    prompt_ids: list[int], scored: tuple[PromptLogprob | None, ...] | None
) -> list[LogprobEntry]:
    """The prompt's tokens with their log-probabilities; the first has none. Where the
    engine scored none (a sampler without prompt logprobs) each entry has none."""
    entries = []
    for position, token_id in enumerate(prompt_ids):
        item = scored[position] if scored is not None and position < len(scored) else None
        if item is None:
            entries.append(LogprobEntry(token_id, None))
        else:
            entries.append(LogprobEntry(item.token_id, item.logprob, item.top))
    return entries


def completion_logprobs(
    entries: list[LogprobEntry], speller: TokenSpeller, k: int, offset: int
) -> CompletionLogprobs:
    """Completions' shape: parallel lists; each top-k dict also holds the chosen token,
    as vLLM answers (and null where the token has no log-probability)."""
    tokens, offsets, top = [], [], []
    for entry in entries:
        text = speller.text(entry.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry.logprob is None:
            top.append(None)
            continue
        best = {speller.text(token_id): floor(lp) for token_id, lp in entry.top[:k]}
        best.setdefault(text, floor(entry.logprob))
        top.append(best)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None if e.logprob is None else floor(e.logprob) for e in entries],
        top_logprobs=top,
        text_offset=offsets,
    )


def chat_logprobs(entries: list[LogprobEntry], speller: TokenSpeller, k: int) -> ChatLogprobs:
    """Chat's shape: one item per token, with its k most likely alternatives."""
    return ChatLogprobs(content=[_token_logprob(entry, speller, k) for entry in entries])


def _token_logprob(entry: LogprobEntry, speller: TokenSpeller, k: int) -> TokenLogprob:
    text, raw = speller.spell(entry.token_id)
    return TokenLogprob(
        token=text,
        logprob=floor(LOGPROB_FLOOR if entry.logprob is None else entry.logprob),
        bytes=list(raw),
        top_logprobs=[_top(token_id, logprob, speller) for token_id, logprob in entry.top[:k]],
    )


def _top(token_id: int, logprob: float, speller: TokenSpeller) -> TopLogprob:
    text, raw = speller.spell(token_id)
    return TopLogprob(token=text, logprob=floor(logprob), bytes=list(raw))


# OpenAI's value for "as good as impossible": JSON has no -Infinity, and a token the
# model gives probability 0 (float32 underflow) still needs a number
LOGPROB_FLOOR = -9999.0


def floor(logprob: float) -> float:
    return logprob if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN and -inf too


# --- stop strings -------------------------------------------------------------------


class StopMatcher:
    """Finds stop sequences in a growing completion text.

    `feed` returns the text that is safe to send now: the tail that could
    still be the start of a stop sequence is held back until it is decided.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, full_text: str) -> str:
        """`full_text` is the whole completion so far; returns the new text to emit."""
        self.text = full_text
        # A stop starting before `sent` was whole when that text went out, and was
        # not found then: searching from `sent` keeps a long completion linear.
        found = (full_text.find(s, self.sent) for s in self._stops)
        cut = min((i for i in found if i >= 0), default=-1)
        if cut >= 0:
            self.text = full_text[:cut]
            self.stopped = True
            safe_end = cut
        else:
            safe_end = len(full_text) - self._holdback
            # A partial UTF-8 character decodes to U+FFFD until its last byte arrives.
            while safe_end > self.sent and full_text[safe_end - 1] == "\ufffd":
                safe_end -= 1
        return self._emit(max(safe_end, self.sent))

    def flush(self) -> str:
        """The held-back text, once the completion has ended without a stop."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        chunk = self.text[self.sent : end]
        self.sent = end
        return chunk
