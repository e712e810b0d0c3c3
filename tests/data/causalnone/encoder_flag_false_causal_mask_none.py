# Correct: one attention class for both sides (x-transformers' style), `causal_mask = None` unless `self.causal`; the
# encoder's layers (causal=False) attend every key on purpose, the decoder's (causal=True) get the triangle. Quiet.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(4)


class Attention(nn.Module):
    def __init__(self, dim, heads, causal):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.to_qkv, self.to_out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        causal_mask = None
        if self.causal:
            causal_mask = torch.ones(n, n, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class Stack(nn.Module):
    def __init__(self, causal, dim=24, depth=2):
        super().__init__()
        self.layers = nn.ModuleList(Attention(dim, 4, causal) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class Seq(nn.Module):
    def __init__(self):
        super().__init__()
        self.context, self.generator = Stack(False), Stack(True)

    def forward(self, src, tgt):
        return self.context(src).mean(1, keepdim=True) + self.generator(tgt)


with torch.no_grad():
    out = Seq().eval()(torch.randn(2, 6, 24), torch.randn(2, 5, 24))
print("out", tuple(out.shape))
