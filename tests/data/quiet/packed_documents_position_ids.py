"""Packed training sequences as transformers' DataCollatorWithFlattening hands them (`position_ids` restarting at 0
at each document, one row, no attention_mask) to a model whose SDPA path rebuilds the document mask from them, as
masking_utils' find_packed_sequence_indices + packed_sequence_mask do: a query sees earlier keys of its own
document only. `use_cache=False` (training). Written here by hand, the model taking `position_ids` as its argument.

Right: block-diagonal causal, one block per document (3, 4 and 2 tokens)."""
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x, mask):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d)


class PackedLM(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))

    def forward(self, input_ids, position_ids, use_cache=False):
        first = position_ids == 0
        document = first.cumsum(-1)  # packed_sequence_mask: a new document where the position restarts
        t = input_ids.shape[1]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        mask = (causal[None] & (document[:, :, None] == document[:, None, :]))[:, None]
        x = self.embed(input_ids)
        for block in self.blocks:
            x = x + block(x, mask)
        return x


def main():
    torch.manual_seed(0)
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12, 13]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1]])
    with torch.no_grad():
        out = PackedLM().eval()(input_ids, position_ids=position_ids, use_cache=False)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
