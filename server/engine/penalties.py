"""Repetition, frequency and presence penalties: each penalized sequence's tokens and
counts, pooled, and their effect on a step's logits (step 3 of sampling.py's order)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from batchpilot_server.engine.sampling_knobs import (
    FREQUENCY,
    PRESENCE,
    REPETITION,
    Knobs,
    rows_index,
)
from batchpilot_server.engine.sequence import Sequence, Status


@dataclass(frozen=True, eq=False)
class PenalizedRows:
    """A batch's penalized rows as PenaltyState reads them, built once for the batch:
    their sequences, their `slots` [rows] in the pool and each slot's start in the
    flattened `counts` ([rows, 1]); their rows of the step's logits (`logits_at`: each
    row's start in the flattened logits, [rows, 1]; `picked`: their places among the
    step's rows; both None where they are every row, in order); their weights [rows, 1]
    and whether any row repeats (a repetition penalty not 1) or counts (a frequency or
    presence penalty not 0): a weight that changes nothing leaves a logit bit for bit,
    so a stage no row uses is skipped. `repeated` picks each repeated logit, x times
    the penalty where x < 0 and x over it elsewhere, from the two: with every penalty
    at least 1 that is the lesser of them, with every one at most 1 the greater (the
    rounding keeps the order), one float op in place of a comparison and a select;
    None where the rows' penalties lie on both sides of 1."""

    seqs: list[Sequence]
    slots: torch.Tensor
    counts_at: torch.Tensor
    logits_at: torch.Tensor | None
    picked: torch.Tensor | None
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    repeats: bool
    repeated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    counted: bool
    ones: torch.Tensor  # [rows], what each step adds to the counts


def repeated_pick(
    penalties: list[float],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """PenalizedRows.repeated for rows of these repetition penalties (all above 0)."""
    if all(penalty >= 1.0 for penalty in penalties):
        return torch.minimum
    if all(0.0 < penalty <= 1.0 for penalty in penalties):
        return torch.maximum
    return None


class PenaltyState:
    """What the penalties read of each penalized sequence, one row of pooled tensors
    per sequence (`Sequence.penalty_slot`): its `tokens` (prompt and output, in order;
    the places past its length repeat its first token, so that reading a batch's
    widest row is harmless for the others) and `counts` [slot, vocab] of each token
    in its output. A row is filled once, when its sequence first samples. A step
    reads the counts only at the rows' tokens (a gather and a scatter of the logits
    there, never a pass over the vocabulary) and adds the sampled tokens with two
    batched scatters. A finished sequence's row is reused; the pool doubles when full."""

    def __init__(self, vocab_size: int, device: str) -> None:
        self.tokens = torch.zeros(0, 0, dtype=torch.int64, device=device)
        self.counts = torch.zeros(0, vocab_size, device=device)
        self.owners: list[Sequence | None] = []

    def rows_of(self, seqs: list[Sequence], knobs: Knobs, logits: torch.Tensor) -> PenalizedRows:
        """The penalized rows `knobs.penalized` (of `seqs`) of a batch, each sequence
        assigned and filled on first sight."""
        for seq in seqs:
            if seq.penalty_slot is None:
                self._assign(seq)
        device = self.counts.device
        slots = torch.tensor([seq.penalty_slot for seq in seqs], device=device)
        picked = rows_index(knobs.penalized, logits.shape[0], device)
        table = knobs.table if picked is None else knobs.table.index_select(0, picked)
        weights = [
            table[:, column, None].contiguous() for column in (REPETITION, FREQUENCY, PRESENCE)
        ]
        params = [seq.params for seq in seqs]
        return PenalizedRows(
            seqs=seqs,
            slots=slots,
            counts_at=slots[:, None] * self.counts.shape[1],
            logits_at=None if picked is None else picked[:, None] * logits.shape[1],
            picked=picked,
            repetition=weights[0],
            frequency=weights[1],
            presence=weights[2],
            repeats=any(p.repetition_penalty != 1.0 for p in params),
            repeated=repeated_pick([p.repetition_penalty for p in params]),
            counted=any(p.frequency_penalty != 0 or p.presence_penalty != 0 for p in params),
            ones=torch.ones(len(seqs), dtype=self.counts.dtype, device=device),
        )

    def apply(self, logits: torch.Tensor, rows: PenalizedRows) -> None:
        """The penalties of `rows` on `logits`, in place: transformers' repetition
        penalty on each token the row holds, then OpenAI's frequency and presence
        penalties over its output counts. A token seen twice is read and written twice,
        with the same value."""
        width = max(seq.num_tokens for seq in rows.seqs)
        tokens = self.tokens[:, :width].index_select(0, rows.slots)
        at = tokens if rows.logits_at is None else rows.logits_at + tokens
        seen = logits.gather(1, at) if rows.logits_at is None else logits.take(at)
        if rows.repeats:
            times, over = seen * rows.repetition, seen / rows.repetition
            pick = rows.repeated
            seen = torch.where(seen < 0, times, over) if pick is None else pick(times, over)
        if rows.counted:
            counts = self.counts.take(rows.counts_at + tokens)
            # counts > 0 as 0 or 1, from whole counts: a float op, not a bool one
            seen = seen - (counts * rows.frequency + counts.clamp(max=1.0) * rows.presence)
        if rows.logits_at is None:
            logits.scatter_(1, at, seen)
        else:
            logits.put_(at, seen)

    def record(self, rows: PenalizedRows, tokens: torch.Tensor) -> None:
        """The tokens just sampled for the step's rows (one per row, not appended yet),
        for the penalized `rows`."""
        if rows.picked is not None:
            tokens = tokens.index_select(0, rows.picked)
        places = torch.tensor([seq.num_tokens for seq in rows.seqs], device=tokens.device)
        self.tokens.index_put_((rows.slots, places), tokens)
        self.counts.index_put_((rows.slots, tokens), rows.ones, accumulate=True)

    def _assign(self, seq: Sequence) -> None:
        slot = self._free_slot()
        seq.penalty_slot, self.owners[slot] = slot, seq
        self._widen(seq.num_prompt + seq.params.max_tokens)  # the most it will hold
        device = self.counts.device
        held = torch.tensor(seq.token_ids, device=device)
        self.tokens[slot] = held[0]
        self.tokens[slot, : len(held)] = held
        self.counts[slot] = 0.0
        # the output so far (none when a sequence first samples in the engine)
        output = held[seq.num_prompt :]
        self.counts[slot].index_put_(
            (output,), torch.ones_like(output, dtype=self.counts.dtype), accumulate=True
        )

    def _widen(self, width: int) -> None:
        """Room for `width` tokens per row."""
        have, rows = self.tokens.shape[1], self.tokens.shape[0]
        if width > have:
            # the new places repeat each row's first token, as unused places do
            first = self.tokens[:, :1] if have else self.tokens.new_zeros(rows, 1)
            self.tokens = torch.cat([self.tokens, first.expand(rows, width - have)], 1)

    def _free_slot(self) -> int:
        for slot, owner in enumerate(self.owners):
            if owner is None or owner.status is Status.FINISHED:
                if owner is not None:
                    owner.penalty_slot = None
                return slot
        slot = len(self.owners)
        extra = max(8, slot)  # the pool doubles
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(extra, self.tokens.shape[1])])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.counts.shape[1])])
        self.owners += [None] * extra
        return slot
