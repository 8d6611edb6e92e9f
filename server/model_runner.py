"""Turns scheduled sequences into batched forwards over the paged KV cache."""

from __future__ import annotations

from itertools import chain
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from batchpilot_server.engine_api import AttentionBackend
from batchpilot_server.kv_cache import KVCache
from batchpilot_server.models import Decoder
from batchpilot_server.native_attention import NativeDecodeAttention, native_kernel_for
from batchpilot_server.sequence import Sequence


class PagedPrefillAttention:
    """Causal attention among each row's own (padded) tokens; stores their K/V."""

    def __init__(
        self, cache: KVCache, blocks: torch.Tensor, offsets: torch.Tensor, valid: torch.Tensor
    ) -> None:
        self.cache = cache
        self.blocks = blocks
        self.offsets = offsets
        # flat [batch * tokens] positions of the real tokens, found once per step: a
        # boolean index on k and v would search the mask again in every layer
        self.stored = valid.reshape(-1).nonzero().squeeze(1)
        tokens = valid.shape[1]
        causal = torch.ones(tokens, tokens, dtype=torch.bool, device=valid.device).tril()
        # ragged rows also mask the padding keys; equal rows take the fast causal path
        self.mask = None if bool(valid.all()) else causal & valid[:, None, None, :]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        k_stored = k.flatten(0, 1).index_select(0, self.stored)
        v_stored = v.flatten(0, 1).index_select(0, self.stored)
        self.cache.write(layer, self.blocks, self.offsets, k_stored, v_stored)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)
        return out.transpose(1, 2)


class PagedDecodeAttention:
    """One new token per row attends to its cached context, read in place, with
    torch ops: for CUDA, and for a CPU where the C kernel cannot be built.

    Copying every sequence's blocks into a contiguous tensor each step costs
    more than the attention itself at long contexts (DESIGN: +35-60% at 512).
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
        ).to(device=device, dtype=cache.k.dtype)
        self.write_blocks = torch.from_numpy(blocks[firsts + counts - 1]).to(device)
        self.write_offsets = torch.from_numpy((lengths - 1) % size).to(device)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        batch, _, heads, head_dim = q.shape
        size = self.cache.block_size
        self.cache.write(layer, self.write_blocks, self.write_offsets, k[:, 0], v[:, 0])
        # 3-d views for bmm: one (1 x hd) @ (hd x bs) product per block and head
        pieces = self.span * heads
        keys = self.cache.k[layer, : self.span].view(pieces, size, head_dim)
        values = self.cache.v[layer, : self.span].view(pieces, size, head_dim)
        query = q[:, 0].index_select(0, self.row).view(pieces, 1, head_dim)
        scores = torch.bmm(query, keys.transpose(1, 2)).view(self.span, heads, size)
        per_seq = scores.index_select(0, self.tables).view(batch, self.width, heads, size)
        logits = torch.add(self.bias, per_seq.transpose(1, 2), alpha=head_dim**-0.5)
        weights = torch.softmax(logits.reshape(batch, heads, -1), -1)
        block_major = weights.view(batch, heads, self.width, size).transpose(1, 2)
        rows = block_major.reshape(batch * self.width, heads, size)
        by_block = rows.index_select(0, self.weight_row)
        mixed = torch.bmm(by_block.view(pieces, 1, size), values)
        out = q.new_zeros(batch + 1, heads, head_dim)
        out.index_add_(0, self.out_row, mixed.view(self.span, heads, head_dim))
        return out[:batch, None]


class ModelRunner:
    def __init__(
        self,
        model: Decoder,
        cache: KVCache,
        attention: AttentionBackend = "auto",
        threads: int = 1,
    ) -> None:
        """`threads`: how many threads decode attention may use (the native kernel's)."""
        self.model = model
        self.cache = cache
        self.device = model.lm_head.weight.device
        self.kernel = native_kernel_for(attention, cache, threads)

    def close(self) -> None:
        """Stop the attention threads, if any."""
        if self.kernel is not None:
            self.kernel.close()

    @property
    def attention(self) -> Literal["native", "torch"]:
        """The decode attention in use."""
        return "torch" if self.kernel is None else "native"

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute every token of each sequence; logits [len(seqs), vocab] of the last."""
        size = self.cache.block_size
        lengths = [seq.num_tokens for seq in seqs]
        width = max(lengths)
        ids = [seq.token_ids + [0] * (width - seq.num_tokens) for seq in seqs]
        # numpy per sequence, not a Python loop per prompt token
        slots = [np.arange(seq.num_tokens) for seq in seqs]
        blocks = np.concatenate(
            [np.asarray(seq.block_table)[pos // size] for seq, pos in zip(seqs, slots, strict=True)]
        )
        offsets = np.concatenate(slots) % size
        device = self.device
        length_t = torch.tensor(lengths, device=device)
        positions = torch.arange(width, device=device)
        attention = PagedPrefillAttention(
            self.cache,
            torch.from_numpy(blocks).to(device),
            torch.from_numpy(offsets).to(device),
            positions[None, :] < length_t[:, None],
        )
        hidden = self.model.hidden(
            torch.tensor(ids, device=device), positions.expand(len(seqs), width), attention
        )
        last = hidden[torch.arange(len(seqs), device=device), length_t - 1]
        return self.model.logits(last)

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Feed each sequence's newest token; logits [len(seqs), vocab]."""
        device = self.device
        attention = (
            PagedDecodeAttention(self.cache, seqs)
            if self.kernel is None
            else NativeDecodeAttention(self.kernel, seqs)
        )
        # flat lists: torch.tensor reads them several times faster than nested ones
        ids = torch.tensor([seq.token_ids[-1] for seq in seqs], device=device)[:, None]
        positions = torch.tensor([seq.num_tokens - 1 for seq in seqs], device=device)[:, None]
        hidden = self.model.hidden(ids, positions, attention)
        return self.model.logits(hidden[:, 0])
