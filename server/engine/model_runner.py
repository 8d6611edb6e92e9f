"""Turns scheduled sequences into batched forwards over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from batchpilot_server.engine.attention_kernel import NativeDecodeAttention, native_kernel_for
from batchpilot_server.engine.inference_mode import inference_mode
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.models import Decoder
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import AttentionBackend

# prefill's hook for the prompt's log-probabilities: (sequence, first position, logits
# [positions, vocab] from there on), called only for rows that want them; it keeps
# what it makes of them for `StepPlan.advance` (the runner writes no sequence)
PromptLogits = Callable[[Sequence, int, torch.Tensor], None]
# prompt positions whose logits are computed at once: a 2048-token chunk's logits over
# a 50k-150k vocabulary would take GBs
PROMPT_LOGITS_SLICE = 256


def compute_dtype(cache: KVCache) -> torch.dtype:
    """The dtype attention computes in: float32 on the CPU whatever the cache holds (as
    the native kernel does), the cache's dtype on CUDA."""
    return torch.float32 if cache.k.device.type == "cpu" else cache.k.dtype


class PagedPrefillAttention:
    """Each row computes a chunk of its tokens, positions [start, end): the chunk's K/V
    are stored, and its queries attend causally to the row's K/V before `start` (read
    back from the cache) and to the chunk's own. A batch whose rows all start at 0
    attends to the fresh K/V only. Computes in `compute_dtype`; returns q's."""

    def __init__(
        self,
        cache: KVCache,
        stored: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        context: tuple[torch.Tensor, torch.Tensor] | None,
        mask: torch.Tensor | None,
    ) -> None:
        """`stored`: flat [batch * tokens] indices of the real (not padding) tokens and
        the (blocks, offsets) they are stored at; `context`: (blocks, offsets)
        [batch * keys] of every row's keys, None when no row starts past 0; `mask`:
        [batch, 1, tokens, keys] which keys each query sees, None for plain causal."""
        self.cache = cache
        self.stored, self.blocks, self.offsets = stored
        self.context = context
        self.mask = mask

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        dtype = compute_dtype(self.cache)
        query, key, value = (t.to(dtype) for t in (q, k, v))
        batch, _, kv_heads, head_dim = key.shape
        self.cache.write(
            layer,
            self.blocks,
            self.offsets,
            key.flatten(0, 1).index_select(0, self.stored),
            value.flatten(0, 1).index_select(0, self.stored),
        )
        if self.context is not None:
            # a later chunk reads its row's earlier K/V back: prefill is bound by
            # compute, and this copy is small beside the chunk's matmuls
            key, value = (
                t.view(batch, -1, kv_heads, head_dim).to(dtype)
                for t in self.cache.gather(layer, *self.context)
            )
        out = F.scaled_dot_product_attention(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attn_mask=self.mask,
            is_causal=self.mask is None,
            enable_gqa=True,
        )
        return out.transpose(1, 2).to(q.dtype)


class PagedDecodeAttention:
    """One new token per row attends to its cached context, read in place, with
    torch ops: for CUDA, and for a CPU where the C kernel cannot be built.

    Copying every sequence's blocks into a contiguous tensor each step costs
    more than the attention itself at long contexts (the index_select row of docs/benchmarks.md).
    Instead each pool block in use is scored against its owner's query where it
    lies (one batched matmul over `span` blocks), only the small score tensor is
    rearranged per sequence for the softmax, and the weights go back to block
    layout for the value matmul. K/V are read once, like contiguous attention.
    """

    def __init__(self, cache: KVCache, seqs: list[Sequence]) -> None:
        # numpy, not Python loops: this runs every step over every block in use
        size, batch = cache.block_size, len(seqs)
        lengths = np.fromiter((seq.num_tokens for seq in seqs), np.int64, batch)
        counts = -(-lengths // size)  # blocks in use; a dynamic batch reserves more
        blocks = np.fromiter(
            chain.from_iterable(seq.block_table[:n] for seq, n in zip(seqs, counts, strict=True)),
            np.int64,
            int(counts.sum()),
        )
        rows = np.repeat(np.arange(batch), counts)
        firsts = np.cumsum(counts) - counts
        columns = np.arange(blocks.size) - np.repeat(firsts, counts)
        width, span = int(counts.max()), int(blocks.max()) + 1
        tables = np.zeros((batch, width), np.int64)
        tables[rows, columns] = blocks
        # per pool block below `span`: its owner's row and its column in that row's
        # table; blocks of no one in the batch score against row 0 and add into a
        # spare output row `batch`
        row, column = np.zeros(span, np.int64), np.zeros(span, np.int64)
        out_row = np.full(span, batch, np.int64)
        row[blocks], column[blocks], out_row[blocks] = rows, columns, rows
        device = cache.k.device
        keys = np.arange(width * size).reshape(1, 1, width, size)
        self.cache = cache
        self.span = span
        self.width = width
        # where each pool block's weights lie in the [batch * width] rows of the
        # block-major weights: one index_select instead of a 2-d advanced index
        weight_row = row * width + column
        self.tables, self.row, self.weight_row, self.out_row = (
            torch.from_numpy(a).to(device) for a in (tables.reshape(-1), row, weight_row, out_row)
        )
        self.bias = torch.from_numpy(
            np.where(keys >= lengths[:, None, None, None], -np.inf, 0.0)
        ).to(device=device, dtype=compute_dtype(cache))
        self.write_blocks = torch.from_numpy(blocks[firsts + counts - 1]).to(device)
        self.write_offsets = torch.from_numpy((lengths - 1) % size).to(device)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        batch, _, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        group = heads // kv_heads  # query head h reads KV head h // group
        size, dtype = self.cache.block_size, compute_dtype(self.cache)
        query = q[:, 0].to(dtype)
        self.cache.write(layer, self.write_blocks, self.write_offsets, k[:, 0], v[:, 0])
        # 3-d views for bmm: one (group x hd) @ (hd x bs) product per block and KV
        # head, so each KV head's block is read once for its whole group (a bfloat16
        # pool on the CPU is read into float32 first)
        pieces = self.span * kv_heads
        keys = self.cache.k[layer, : self.span].view(pieces, size, head_dim).to(dtype)
        values = self.cache.v[layer, : self.span].view(pieces, size, head_dim).to(dtype)
        queries = query.index_select(0, self.row).view(pieces, group, head_dim)
        scores = torch.bmm(queries, keys.transpose(1, 2)).view(self.span, heads, size)
        per_seq = scores.index_select(0, self.tables).view(batch, self.width, heads, size)
        logits = torch.add(self.bias, per_seq.transpose(1, 2), alpha=head_dim**-0.5)
        weights = torch.softmax(logits.reshape(batch, heads, -1), -1)
        block_major = weights.view(batch, heads, self.width, size).transpose(1, 2)
        rows = block_major.reshape(batch * self.width, heads, size)
        by_block = rows.index_select(0, self.weight_row)
        mixed = torch.bmm(by_block.view(pieces, group, size), values)
        out = query.new_zeros(batch + 1, heads, head_dim)
        out.index_add_(0, self.out_row, mixed.view(self.span, heads, head_dim))
        return out[:batch, None].to(q.dtype)


DecodeAttention = PagedDecodeAttention | NativeDecodeAttention


class MixedAttention:
    """A step's prefill rows, verify rows and decode rows as one forward: the
    projections take every token at once, so a step reads the weights once, not once
    per kind of row; attention takes them apart again. The tokens are each rectangle
    [rows, width] flattened (the prefill rows', then the verify rows': apart, so that a
    verify row's few positions are not padded to a long prompt chunk's width), then one
    per decode row (None: none)."""

    def __init__(self, rectangles: list[PrefillBatch], decode: DecodeAttention | None) -> None:
        self.rectangles, self.decode = rectangles, decode
        self.sizes = [batch.ids.numel() for batch in rectangles]
        self.split = sum(self.sizes)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q, k, v [1, tokens, heads, head_dim]; the output is q's shape."""
        outputs = []
        start = 0
        for batch, size in zip(self.rectangles, self.sizes, strict=True):
            shape = batch.ids.shape
            part = (t[0, start : start + size].unflatten(0, shape) for t in (q, k, v))
            outputs.append(batch.attention(layer, *part).flatten(0, 1))
            start += size
        if self.decode is not None:
            outputs.append(self.decode(layer, *(t[0, start:, None] for t in (q, k, v)))[:, 0])
        return torch.cat(outputs)[None]


@dataclass
class PrefillBatch:
    """A step's prefill rows as the model takes them: token ids and positions
    [rows, width] (short chunks padded), and where each row's chunk starts and ends."""

    ids: torch.Tensor
    positions: torch.Tensor
    attention: PagedPrefillAttention
    starts: np.ndarray
    counts: np.ndarray
    ends: np.ndarray


class ModelRunner:
    def __init__(
        self,
        model: Decoder,
        cache: KVCache,
        attention: AttentionBackend = "auto",
        threads: int = 1,
    ) -> None:
        """`threads`: how many threads decode attention may use (the native kernel's,
        on the engine thread's OpenMP team); the projections run on torch's intra-op
        threads."""
        self.model = model
        self.cache = cache
        self.device = model.device
        self.kernel = native_kernel_for(attention, cache, threads)

    @property
    def attention(self) -> Literal["native", "torch"]:
        """The decode attention in use."""
        return "torch" if self.kernel is None else "native"

    @inference_mode
    def step(self, plan: StepPlan, prompt_logits: PromptLogits | None = None) -> torch.Tensor:
        """One forward over the plan's rows, writing only the KV cache: compute the
        next `plan.chunk_sizes()` tokens of each prefill sequence from its
        `num_computed` on, and feed each decode sequence its newest token (padding rows
        last). Returns logits [rows, vocab]: first those of the prefill rows this
        completes (`plan.sampling()`), then those of every decode and padding row, each
        in order. `prompt_logits` is handed the logits of every position that predicts
        a prompt token, for the rows that `wants_prompt_logprobs`. Verify rows (their
        newest token and draft, speculative decoding) compute a rectangle of their own
        in the same forward, and the logits of each of their positions come after the
        prefill rows' (the order of `plan.sampler_rows()`). The sequences are left as they were:
        `StepPlan.advance` records what the step computed."""
        prefill, decode = plan.prefill, plan.decode + plan.pad
        pre = self._prefill_batch(_chunks(plan)) if prefill else None
        # each verify row's newest token and draft, a rectangle of their own
        drafted = [(s, s.token_ids[-1:] + d) for s, d in zip(plan.verify, plan.drafts, strict=True)]
        ver = self._prefill_batch(drafted) if drafted else None
        prefill_hidden, verify_hidden, hidden = self._hidden(pre, ver, decode)
        if verify_hidden is not None:  # each verify row's every position, before the decode rows
            verified = [verify_hidden[r, : len(draft) + 1] for r, draft in enumerate(plan.drafts)]
            hidden = torch.cat((*verified, hidden))
        if pre is not None and prefill_hidden is not None:
            if prompt_logits is not None:
                self._prompt_positions(
                    prefill, pre.starts, pre.counts, prefill_hidden, prompt_logits
                )
            totals = np.fromiter((seq.num_tokens for seq in prefill), np.int64, len(prefill))
            done = np.flatnonzero(pre.ends == totals)
            rows = torch.from_numpy(done).to(self.device)
            last = torch.from_numpy(pre.counts[done] - 1).to(self.device)
            hidden = torch.cat((prefill_hidden[rows, last], hidden))
        return self.model.logits(hidden)

    def _hidden(
        self, pre: PrefillBatch | None, ver: PrefillBatch | None, decode: list[Sequence]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """The final hidden states of the prefill rows and of the verify rows [rows,
        width, d_model] (None without such rows) and of the decode rows [rows, d_model]
        (maybe none), from one forward."""
        model, device = self.model, self.device
        rectangles = [batch for batch in (pre, ver) if batch is not None]
        if decode:
            # one flat int64 array, ids then positions, and one tensor of it: numpy reads
            # a list of ints about twice as fast as torch.tensor (3x at batch 32), and
            # at batch 1 this is per-step overhead beside a ~2 ms tiny-model step
            both = np.array(
                [seq.token_ids[-1] for seq in decode] + [seq.num_tokens - 1 for seq in decode],
                np.int64,
            )
            ids, positions = torch.from_numpy(both).to(device).view(2, len(decode))
            attention = self._decode_attention(decode)
            if not rectangles:
                hidden = model.hidden(ids[:, None], positions[:, None], attention)
                return None, None, hidden[:, 0]
        elif len(rectangles) == 1:  # as its own batch: SDPA's causal fast path may apply
            (batch,) = rectangles
            hidden = model.hidden(batch.ids, batch.positions, batch.attention)
            empty = hidden[:0, 0]
            return (hidden, None, empty) if batch is pre else (None, hidden, empty)
        mixed = MixedAttention(rectangles, attention if decode else None)
        flat = model.hidden(
            torch.cat([b.ids.flatten() for b in rectangles] + ([ids] if decode else []))[None],
            torch.cat(
                [b.positions.flatten() for b in rectangles] + ([positions] if decode else [])
            )[None],
            mixed,
        )[0]
        hiddens: list[torch.Tensor] = []
        start = 0
        for batch, size in zip(rectangles, mixed.sizes, strict=True):
            hiddens.append(flat[start : start + size].unflatten(0, batch.ids.shape))
            start += size
        prefill_hidden = hiddens[0] if pre is not None else None
        verify_hidden = hiddens[-1] if ver is not None else None
        return prefill_hidden, verify_hidden, flat[mixed.split :]

    def _prefill_batch(self, chunks: list[tuple[Sequence, list[int]]]) -> PrefillBatch:
        """The prefill rows' ids, positions and attention for `step`: each row's chunk
        of token ids, computed from its `num_computed` on."""
        seqs = [seq for seq, _ in chunks]
        batch = len(seqs)
        starts = np.fromiter((seq.num_computed for seq in seqs), np.int64, batch)
        counts = np.fromiter((len(ids) for _, ids in chunks), np.int64, batch)
        ends = starts + counts
        if (counts < 1).any():
            raise ValueError("each prefill chunk must hold at least one token")
        width = int(counts.max())
        ids = [chunk + [0] * (width - len(chunk)) for _, chunk in chunks]
        # padding repeats its row's last position: it stays inside the model's context
        positions = np.minimum(starts[:, None] + np.arange(width), ends[:, None] - 1)
        attention = self._prefill_attention(seqs, starts, counts, positions)
        device = self.device
        return PrefillBatch(
            torch.tensor(ids, device=device),
            torch.from_numpy(positions).to(device),
            attention,
            starts,
            counts,
            ends,
        )

    def _prompt_positions(
        self,
        seqs: list[Sequence],
        starts: np.ndarray,
        counts: np.ndarray,
        hidden: torch.Tensor,
        take: PromptLogits,
    ) -> None:
        """The logits of each chunk position that predicts a prompt token (not the
        prompt's last: it predicts the output), for the rows that want them."""
        for row, seq in enumerate(seqs):
            if not seq.wants_prompt_logprobs:
                continue
            start = int(starts[row])
            positions = min(int(counts[row]), seq.num_prompt - 1 - start)
            for first in range(0, positions, PROMPT_LOGITS_SLICE):
                last = min(positions, first + PROMPT_LOGITS_SLICE)
                take(seq, start + first, self.model.logits(hidden[row, first:last]))

    def _prefill_attention(
        self, seqs: list[Sequence], starts: np.ndarray, counts: np.ndarray, positions: np.ndarray
    ) -> PagedPrefillAttention:
        """Where each chunk's K/V go, which cached K/V its queries read, and the mask."""
        size, device = self.cache.block_size, self.device
        tables = np.zeros((len(seqs), max(len(seq.block_table) for seq in seqs)), np.int64)
        for row, seq in enumerate(seqs):
            tables[row, : len(seq.block_table)] = seq.block_table
        width = positions.shape[1]
        valid = np.arange(width) < counts[:, None]
        rows, columns = np.nonzero(valid)
        slots = positions[rows, columns]
        # flat [batch * tokens] indices of the real tokens, found once per step: a
        # boolean index on k and v would search the mask again in every layer
        stored = (
            torch.from_numpy(rows * width + columns).to(device),
            torch.from_numpy(tables[rows, slots // size]).to(device),
            torch.from_numpy(slots % size).to(device),
        )
        ends = starts + counts
        keys = np.arange(int(ends.max()))
        context = None
        if starts.any():
            key_slots = np.minimum(keys, ends[:, None] - 1)  # padding keys: any slot, masked
            key_blocks = np.take_along_axis(tables, key_slots // size, 1)
            context = (
                torch.from_numpy(key_blocks.reshape(-1)).to(device),
                torch.from_numpy((key_slots % size).reshape(-1)).to(device),
            )
        mask = None  # rows of equal length that start at 0 take SDPA's fast causal path
        if starts.any() or not valid.all():
            # query i of a row sees keys up to its own position, and none of the padding
            seen = (keys <= (starts[:, None] + np.arange(width))[:, :, None]) & (
                keys < ends[:, None, None]
            )
            mask = torch.from_numpy(seen[:, None]).to(device)
        return PagedPrefillAttention(self.cache, stored, context, mask)

    def _decode_attention(self, seqs: list[Sequence]) -> DecodeAttention:
        if self.kernel is None:
            return PagedDecodeAttention(self.cache, seqs)
        return NativeDecodeAttention(self.kernel, seqs)


def _chunks(plan: StepPlan) -> list[tuple[Sequence, list[int]]]:
    """The token ids each prefill row computes: its chunk."""
    sizes = plan.chunk_sizes()
    if any(
        not 1 <= size <= seq.num_uncomputed for seq, size in zip(plan.prefill, sizes, strict=True)
    ):
        raise ValueError("each prefill chunk must hold 1 to the tokens a sequence has left")
    return [
        (seq, seq.token_ids[seq.num_computed : seq.num_computed + size])
        for seq, size in zip(plan.prefill, sizes, strict=True)
    ]
