"""A correct model whose attention module says `causal = False` while its forward chooses the direction per call.

For checks/directions.py: GritLM's way (one model, bidirectional for embeddings and causal for generation), written
with the module's attribute left False and `is_causal` handed to the model's forward. Both calls are meant; the
rule must stay quiet. (No --fixed: the program is correct as written.)
"""
import torch
import torch.nn as nn

torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.is_causal = heads, False
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).masked_fill(~keep, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


class Model(nn.Module):
    def __init__(self, vocab=30, dim=16, heads=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = Attention(dim, heads)

    def forward(self, input_ids, attention_mask, is_causal=True):
        n = input_ids.shape[1]
        keep = attention_mask.bool()[:, None, None, :]
        if is_causal:
            keep = keep & torch.ones(n, n, dtype=torch.bool).tril()
        return self.attn(self.embed(input_ids), keep)


if __name__ == "__main__":
    model = Model().eval()
    ids, mask = torch.tensor([[4, 8, 2, 9], [5, 1, 7, 0]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    with torch.no_grad():
        embedded = model(ids, mask, is_causal=False)
        generated = model(ids, mask, is_causal=True)
    print("bidirectional vs causal:", f"{(embedded - generated).abs().max().item():.4f}")
