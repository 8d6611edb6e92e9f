"""One request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchpilot_server.block_pool import BlockHash
from batchpilot_server.engine_api import FinishReason, SamplingParams

if TYPE_CHECKING:
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() at submit
    deadline: float | None  # monotonic; only applies until first scheduled
    generator: torch.Generator | None  # None: greedy
    token_ids: list[int] = field(init=False)
    block_table: list[int] = field(default_factory=list)
    # the prefix cache's names of the full blocks of token_ids, as far as computed
    # (block_pool.extend_block_hashes): tokens only append, so they stay valid
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)
    # leading blocks of block_table the prefix cache knows: shared from it, or published
    num_cached_blocks: int = 0
    # tokens whose K/V the cache holds: a chunked prefill advances it chunk by chunk,
    # each decode by one; preemption frees the blocks and sets it back to 0
    num_computed: int = 0
    status: Status = Status.WAITING
    first_scheduled: float | None = None
    finish_reason: FinishReason | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V the cache lacks: 1 while decoding, more while prefilling."""
        return len(self.token_ids) - self.num_computed

    @property
    def ready_to_sample(self) -> bool:
        """Every token is computed: the last forward's logits give the next token."""
        return self.num_uncomputed == 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt + self.params.max_tokens

    def finish_reason_after(self, token_id: int, eos_ids: frozenset[int]) -> FinishReason | None:
        """Why the sequence ends with `token_id` just appended, if it does."""
        if token_id in self.params.stop_token_ids:
            return "stop"
        if token_id in eos_ids and not self.params.ignore_eos:
            return "stop"
        if self.num_output >= self.params.max_tokens:
            return "length"
        return None
