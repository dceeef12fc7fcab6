"""The flat token batch one engine step runs through the model.

Sequences are concatenated along one token axis (no padding): a step may mix prefill chunks of
several prompts with single decode tokens. K/V live in a paged cache; `slot_mapping` says where
each new token's K/V is written and `block_tables` where each sequence's history is read from.

    query_start_loc = [0, 5, 6, 9]   # three sequences contributing 5, 1 and 3 tokens this step
    context_lens    = [5, 37, 12]    # tokens each sequence has in the cache after this step
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.lora import LoRABatch


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T]
    positions: torch.Tensor  # int64 [T], position of each token inside its sequence
    slot_mapping: torch.Tensor  # int64 [T], flat cache slot (block * block_size + offset) for each token's K/V
    query_start_loc: torch.Tensor  # int32 [B + 1], cumulative new-token counts per sequence
    context_lens: torch.Tensor  # int32 [B], cached tokens per sequence after this step (incl. new ones)
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], -1 where unused
    logits_indices: torch.Tensor  # int64 [B], flat index of the token whose logits each sequence needs
    max_query_len: int  # host-side copies, so attention can pick a path without a device sync
    max_context_len: int
    lora: LoRABatch | None = None  # None when no token in the step uses an adapter

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    @classmethod
    def scratch_prefill(
        cls, token_ids: Sequence[int], *, start: int, block_size: int, device: torch.device
    ) -> ForwardBatch:
        """Tokens [start, start + len(token_ids)) of one sequence, its earlier tokens cached, in a
        scratch cache whose blocks 0, 1, 2, ... it holds in order (token p's K/V in slot p); the
        logits of its last token. What calibration forwards run, outside any engine."""
        end = start + len(token_ids)
        return cls(
            input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
            positions=torch.arange(start, end, dtype=torch.int64, device=device),
            slot_mapping=torch.arange(start, end, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=device),
            context_lens=torch.tensor([end], dtype=torch.int32, device=device),
            block_tables=torch.arange(-(-end // block_size), dtype=torch.int32, device=device)[None, :],
            logits_indices=torch.tensor([end - start - 1], dtype=torch.int64, device=device),
            max_query_len=end - start,
            max_context_len=end,
        )
