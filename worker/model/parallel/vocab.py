"""The vocabulary-parallel embedding and LM head: each rank holds a contiguous share of the
vocabulary's rows (the last share padded with zero rows when the vocabulary does not split evenly).

Embedding: a rank looks up the tokens in its share, zeros for the others, and one all-reduce sums
the ranks' rows into every token's embedding. Head: each rank computes the logits of its share and
an all-gather puts them side by side (every rank gets the whole row, so any may sample).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from worker.model.layers import VocabEmbedding
from worker.model.parallel.group import TensorParallel
from worker.model.weights import copy_weight


class VocabParallelEmbedding(VocabEmbedding):
    """weight [cdiv(vocab, size), hidden]: rows [start, start + rows) of the whole table."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        per_rank = -(-vocab_size // tp.size)
        super().__init__(per_rank, hidden_size, dtype=dtype, device=device)
        self.tp = tp
        self.vocab_size = vocab_size
        self.start = tp.rank * per_rank
        self.rows = max(0, min(per_rank, vocab_size - self.start))  # real rows; the rest pad

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """int64 [T] → [T, hidden], summed over the ranks."""
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(hidden)

    def logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, hidden] → float32 [N, vocab] (every rank's share gathered), into `out` when given."""
        logits = self.tp.all_gather_columns(F.linear(hidden, self.weight))[:, : self.vocab_size]
        if out is None:
            return logits.float()
        return out.copy_(logits)

    def load(self, tensor: torch.Tensor, *, name: str) -> None:
        """Fill this rank's rows from the whole checkpoint table [vocab, hidden]; zero the padding."""
        copy_weight(self.weight[: self.rows], tensor[self.start : self.start + self.rows], name=name)
        self.weight[self.rows :].zero_()
