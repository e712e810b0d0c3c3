"""A correct program of the same shape that must stay quiet: packed rows right-padded with the pad id, segment ids
numbered from 0 per row, the padding kept in the last sample's segment in every row (the collator never sets padding
apart) and hidden from the real queries by the causal mask; a pad query's output is dropped by the loss's -100.
Nothing the ids state sets padding apart in one row and not in another. (python FILE; --fixed runs the same.)
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

PAD = 0


class PackedLM(nn.Module):
    def __init__(self, vocab=30, dim=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=PAD)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)
        self.heads = heads

    def forward(self, input_ids, segment_ids):
        x = self.embed(input_ids)
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        keep = (segment_ids[:, :, None] == segment_ids[:, None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return self.head(y.transpose(1, 2).reshape(b, n, d))


def main():
    torch.manual_seed(0)
    input_ids = torch.tensor([[4, 9, 7, 5, 11, 12, 6, 0, 0, 0], [8, 3, 14, 15, 9, 10, 0, 0, 0, 0]])
    segment_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])
    logits = PackedLM()(input_ids, segment_ids)
    labels = input_ids.masked_fill(input_ids == PAD, -100)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
