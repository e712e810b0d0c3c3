"""Correct: an ELMo-style bidirectional language model (its own nn.Module, no transformers model under it): a forward
stream reads the tokens left to right and a backward stream reads them reversed, each causal, and their states are
joined. The name says bidirectional of the model, not of either attention. Written for tests/test_checks_bidirname.py."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class CausalStream(nn.Module):
    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class BidirectionalLanguageModel(nn.Module):
    def __init__(self, vocab=40, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.forward_stream = CausalStream(dim)
        self.backward_stream = CausalStream(dim)
        self.head = nn.Linear(2 * dim, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        ahead = self.forward_stream(h)
        behind = self.backward_stream(h.flip(1)).flip(1)
        return self.head(torch.cat([ahead, behind], dim=-1))


model = BidirectionalLanguageModel().eval()
with torch.no_grad():
    print(model(torch.randint(0, 40, (2, 9))).sum().item())
