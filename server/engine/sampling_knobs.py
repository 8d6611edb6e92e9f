"""The sampling values of a step's rows as tensors: what the sampler (sampling.py) and
the penalties (penalties.py) read of them, built once for a run of steps."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from batchpilot_server.engine.sequence import Sequence

# the columns of Knobs.table
TEMPERATURE, TOP_P, MIN_P, TOP_K, REPETITION, FREQUENCY, PRESENCE = range(7)


@dataclass(frozen=True, eq=False)
class Knobs:
    """The sampling values of a step's rows, in one tensor built at once:
    `table` [rows, 7] of temperature, top_p (inf where 1: no cut, so that rounding
    never cuts a tail), min_p, top_k (the vocabulary where unset), repetition,
    frequency and presence penalties; which rows sample, which are greedy but
    processed, which are penalized and which constrained by a grammar (with the index
    tensors of the first two, None where they are every row); which cuts any sampled
    row makes, so that a step skips the stages nobody uses; and the sampled rows' cut
    knobs (`cuts`)."""

    table: torch.Tensor
    sampled: list[int]
    greedy: list[int]  # greedy rows whose logits the processors change
    penalized: list[int]
    constrained: list[int]
    sampled_index: torch.Tensor | None
    greedy_index: torch.Tensor | None
    top_k: bool
    top_p: bool
    min_p: bool
    widest_k: int  # the largest top_k set
    cuts: Cuts

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device | str) -> Knobs:
        params = [seq.params for seq in seqs]
        table = torch.tensor(
            [
                (
                    p.temperature,
                    p.top_p if p.top_p < 1.0 else torch.inf,
                    p.min_p,
                    p.top_k or torch.inf,
                    p.repetition_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                )
                for p in params
            ],
            device=device,
        )
        sampled = [row for row, seq in enumerate(seqs) if seq.sampled]
        greedy = [
            row
            for row, seq in enumerate(seqs)
            if not seq.sampled and (seq.always_processed or seq.holds_stops)
        ]
        cutting = [params[row] for row in sampled]
        sampled_index = rows_index(sampled, len(seqs), device)
        return cls(
            table=table,
            sampled=sampled,
            greedy=greedy,
            penalized=[row for row, seq in enumerate(seqs) if seq.penalized],
            constrained=[row for row, seq in enumerate(seqs) if seq.grammar is not None],
            sampled_index=sampled_index,
            greedy_index=rows_index(greedy, len(seqs), device),
            top_k=any(p.top_k for p in cutting),
            top_p=any(p.top_p < 1.0 for p in cutting),
            min_p=any(p.min_p > 0 for p in cutting),
            widest_k=max((p.top_k for p in cutting), default=0),
            cuts=Cuts.of(table if sampled_index is None else table.index_select(0, sampled_index)),
        )

    def cuts_of(self, table: torch.Tensor) -> Cuts:
        """The cut knobs of `table`'s rows: the kept ones when they are the sampled rows'."""
        return self.cuts if table is self.cuts.table else Cuts.of(table)


def rows_index(rows: list[int], count: int, device: torch.device | str) -> torch.Tensor | None:
    """`rows` of a step's `count` as an index tensor (None when they are all of it)."""
    return None if len(rows) == count else torch.tensor(rows, dtype=torch.int64, device=device)


@dataclass(frozen=True, eq=False)
class Cuts:
    """Sampled rows' knobs as the draw reads them, each column [rows, 1] of their Knobs
    `table`: temperature, top_k, top_p and min_p; where top_k is set (`renormalized`) and
    where top_k or top_p is (`cutting`), None where every row sets them; and, per
    candidate width met so far, which candidates lie within each row's top_k."""

    table: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    renormalized: torch.Tensor | None
    cutting: torch.Tensor | None
    within: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def of(cls, table: torch.Tensor) -> Cuts:
        def column(index: int) -> torch.Tensor:
            return table[:, index, None].contiguous()

        top_k, top_p = column(TOP_K), column(TOP_P)
        renormalized = top_k < torch.inf
        cutting = renormalized | (top_p < torch.inf)
        return cls(
            table=table,
            temperature=column(TEMPERATURE),
            top_k=top_k,
            top_p=top_p,
            min_p=column(MIN_P),
            renormalized=None if bool(renormalized.all()) else renormalized,
            cutting=None if bool(cutting.all()) else cutting,
        )

    def within_k(self, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows, width]: which of `width` candidates, best first, lie in the row's
        top_k, as bools and as 1.0 or 0.0 (a product with floats costs less than with
        bools, for the same result)."""
        if width not in self.within:
            within = torch.arange(width, device=self.top_k.device) < self.top_k
            self.within[width] = within, within.to(self.top_k.dtype)
        return self.within[width]
