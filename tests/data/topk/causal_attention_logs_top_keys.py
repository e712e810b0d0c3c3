"""A causal decoder layer that ranks its raw scores with `topk(3)` to log which keys each query scores highest (an
interpretability hook), then masks the future and softmaxes over every past key: its topk is no mask, and its
softmax keeps keys the topk never picked. Correct: nothing to say.
"""
import torch
from torch import nn


class LoggedCausalAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.top_keys = None

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        self.top_keys = scores.topk(3, dim=-1).indices  # (logged: the keys each query scores highest)
        future = torch.ones(n, n, dtype=torch.bool).triu(1)
        weights = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        return (weights @ v).transpose(1, 2).reshape(b, n, d)


torch.manual_seed(0)
layer = LoggedCausalAttention().eval()
with torch.no_grad():
    layer(torch.randn(2, 8, 16))
print("top keys of the last query:", layer.top_keys[0, 0, -1].tolist())
