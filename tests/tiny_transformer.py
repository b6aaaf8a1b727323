"""A tiny random causal transformer over packed sequences, for layout-invariance tests.

Attention is masked block-diagonally from cu_seqlens (never across sequences) and positions come
from position_ids, so each token's hidden state depends only on its own sequence's prefix.
"""

from __future__ import annotations

import torch
from torch import nn


class TinyPackedTransformer(nn.Module):
    def __init__(
        self, vocab: int = 50, hidden: int = 16, layers: int = 2, heads: int = 2, max_pos: int = 512
    ):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_pos, hidden)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "norm1": nn.LayerNorm(hidden),
                    "qkv": nn.Linear(hidden, 3 * hidden),
                    "out": nn.Linear(hidden, hidden),
                    "norm2": nn.LayerNorm(hidden),
                    "mlp": nn.Sequential(
                        nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden)
                    ),
                }
            )
            for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, cu_seqlens):
        """[T] token ids -> [T, hidden] final hidden states (the LM head is applied by the loss)."""
        total = input_ids.shape[0]
        seq_of = torch.repeat_interleave(
            torch.arange(len(cu_seqlens) - 1), cu_seqlens.diff().long()
        )
        idx = torch.arange(total)
        allowed = (seq_of[:, None] == seq_of[None, :]) & (idx[:, None] >= idx[None, :])
        x = self.embed(input_ids) + self.pos(position_ids)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["norm1"](x)).view(total, 3, self.heads, -1).unbind(1)
            att = torch.einsum("thd,shd->hts", q, k) / q.shape[-1] ** 0.5
            att = att.masked_fill(~allowed, float("-inf")).softmax(-1)
            x = x + blk["out"](torch.einsum("hts,shd->thd", att, v).reshape(total, -1))
            x = x + blk["mlp"](blk["norm2"](x))
        return self.norm(x)
