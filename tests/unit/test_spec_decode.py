"""Speculative decoding's torch-free parts: the n-gram proposer, a verification's
acceptance and its KV rollback in the block pool, and the knob's validation."""

from __future__ import annotations

import pytest
from batchpilot_server.batching_config import BatchingConfig, ConfigError
from batchpilot_server.engine.block_pool import BlockPool, KVAccountingError
from batchpilot_server.engine.ngram_proposer import propose
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import SamplingParams

EOS = frozenset({0})


def test_the_proposer_copies_what_followed_the_latest_match_of_the_longest_suffix() -> None:
    #          0  1  2  3  4  5  6  7  8  9 10 11 12 13
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 7, 1, 2, 3, 4, 5]
    # the 5-gram 1 2 3 4 5 occurs at 0 and at 6: the latest (6) is followed by 7 1 2
    assert propose(tokens, 3) == [7, 1, 2]
    assert propose(tokens, 1) == [7]
    # no more than what follows the match
    assert propose([9, 1, 2, 3, 4, 5, 8, 1, 2, 3, 4, 5], 10) == [8, 1, 2, 3, 4, 5]


def test_the_proposer_tries_shorter_ngrams_down_to_its_minimum() -> None:
    tokens = [1, 2, 3, 9, 8, 2, 3]
    assert propose(tokens, 2) == []  # no 5-gram repeats: vLLM's default minimum is 5
    assert propose(tokens, 2, lookup_min=2) == [9, 8]
    assert propose(tokens, 2, lookup_max=3, lookup_min=1) == [9, 8]
    assert propose([4], 3, lookup_min=1) == []  # nothing before the suffix
    assert propose([1, 2, 3, 4, 5, 1, 2, 3, 4, 5], 0) == []


def seq(prompt: list[int], output: list[int], max_tokens: int = 32) -> Sequence:
    s = Sequence("r", prompt, SamplingParams(max_tokens=max_tokens), 0.0, None, None)
    s.admit(0)
    s.advance(len(prompt), output)  # prefill, and its first token
    s.advance(len(output) - 1, ())  # the rest as decoded already
    return s


def test_a_verification_keeps_the_matching_run_then_the_models_token() -> None:
    a, b = seq([5, 6, 7], [8]), seq([5, 6, 7], [8])
    plan = StepPlan(verify=[a, b], drafts=[[1, 2, 3], [1, 2]])
    # a drew 1 2 then 4 (a mismatch at the third draft token); b drew its whole draft
    # and the bonus token 9
    spans = plan.accept([1, 2, 4, 7, 1, 2, 9], EOS)
    assert spans == [(a, 0, 3), (b, 4, 3)]
    assert plan.accepted == [2, 2]
    assert a.token_ids == [5, 6, 7, 8, 1, 2, 4] and b.token_ids == [5, 6, 7, 8, 1, 2, 9]
    # the newest token and the accepted drafts are computed; the token after them not
    assert a.num_uncomputed == 1 and b.num_uncomputed == 1


def test_a_verification_stops_at_a_stop_token_or_max_tokens_within_its_run() -> None:
    stopping, capped = seq([5, 6, 7], [8]), seq([5, 6, 7], [8], max_tokens=2)
    plan = StepPlan(verify=[stopping, capped], drafts=[[1, 0, 3], [1]])
    spans = plan.accept([1, 0, 3, 4, 1, 2], EOS)
    assert spans == [(stopping, 0, 2), (capped, 4, 1)]
    assert stopping.token_ids[-2:] == [1, 0]
    assert capped.num_output == 2


def test_rejected_draft_blocks_go_back_to_the_pool() -> None:
    pool = BlockPool(8, block_size=4, prefix_caching=True)
    table: list[int] = []
    assert pool.grow(table, 14)  # 10 tokens and a draft of 4: 4 blocks
    pool.shrink(table, 11)  # 11 kept: 3 blocks
    assert len(table) == 3 and pool.num_used == 3
    pool.shrink(table, 11)
    assert pool.num_used == 3
    pool.publish(table[2], b"name")
    with pytest.raises(KVAccountingError):
        pool.shrink(table, 8)
    pool.release(table)
    assert pool.num_used == 0


@pytest.mark.parametrize("value", [-1, 17, 2.0, True, "4"])
def test_the_knob_refuses_what_is_not_a_draft_length(value: object) -> None:
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        BatchingConfig().merged({"num_speculative_tokens": value})


def test_the_knob_is_left_out_of_the_config_while_off() -> None:
    """Servers from before speculative decoding refuse the key: an operator's ConfigMap
    and PUTs still reach them while it is off."""
    assert "num_speculative_tokens" not in BatchingConfig().to_dict()
    on = BatchingConfig(num_speculative_tokens=4)
    assert on.to_dict()["num_speculative_tokens"] == 4
    assert BatchingConfig.from_dict(on.to_dict()) == on
