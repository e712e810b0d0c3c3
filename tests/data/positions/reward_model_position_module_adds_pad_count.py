"""A reward model scores left-padded responses; its position module numbers each row's tokens itself, off by the pads.

Written another way (x-transformers 013e60a, tests/data/blind/x_transformers_abs_pos_emb_left_pad_offset_sign.py):
a hand-written GPT-style reward model keeps its learned positions in a module of its own (`positional_embedding`,
its nn.Embedding inside named `table`), which counts each row's positions from the batch's attention_mask in its own
forward, a frame gone before any attention runs. The fix numbers each row's first real token 0 (the mask's running
count less one); the bug shifts the columns by the row's pad count where it meant to take it off, so a response
behind 4 pads starts at position 8 and another behind 2 at position 4, and the same response scores differently with
the batch it is padded into.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class PositionalEmbedding(nn.Module):
    def __init__(self, max_positions: int, dim: int):
        super().__init__()
        self.table = nn.Embedding(max_positions, dim)

    def forward(self, attention_mask: torch.Tensor) -> torch.Tensor:
        if FIXED:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        else:
            pads = (attention_mask == 0).sum(-1, keepdim=True)
            positions = torch.arange(attention_mask.shape[-1])[None, :] + pads
        return self.table(positions)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keep = causal[None, None] & attention_mask.bool()[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(out.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class RewardModel(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, max_positions: int = 32):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim)
        self.positional_embedding = PositionalEmbedding(max_positions, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.score = nn.Linear(dim, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.token_embedding(input_ids) + self.positional_embedding(attention_mask)
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.score(x[:, -1]).squeeze(-1)  # (left-padded: every row's last token is real)


def left_pad(rows: list[list[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def main() -> None:
    torch.manual_seed(0)
    model = RewardModel().eval()
    responses = [[5, 17, 23, 9, 41, 12, 8, 30], [7, 19, 33, 2], [11, 4, 26, 38, 15, 6]]
    ids, mask = left_pad(responses)
    with torch.no_grad():
        scores = model(ids, mask)
        alone = torch.cat([model(*left_pad([r])) for r in responses])
    for r, s, a in zip(responses, scores.tolist(), alone.tolist()):
        print(f"{len(r)} tokens: batched {s:+.4f}, alone {a:+.4f}")


if __name__ == "__main__":
    main()
