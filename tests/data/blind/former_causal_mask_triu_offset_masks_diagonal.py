# Reproduces pbloem/former#10: the "transformers from scratch" causal mask used
# torch.triu_indices(t, t, offset=0), which also masks the diagonal (a token cannot see itself; row 0 is all -inf).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SelfAttention(nn.Module):
    def __init__(self, k, heads=2, mask=False):
        super().__init__()
        self.k, self.heads, self.mask = k, heads, mask
        self.tokeys = nn.Linear(k, k * heads, bias=False)
        self.toqueries = nn.Linear(k, k * heads, bias=False)
        self.tovalues = nn.Linear(k, k * heads, bias=False)
        self.unifyheads = nn.Linear(heads * k, k)

    def forward(self, x):
        b, t, k = x.size()
        h = self.heads
        queries = self.toqueries(x).view(b, t, h, k)
        keys = self.tokeys(x).view(b, t, h, k)
        values = self.tovalues(x).view(b, t, h, k)

        keys = keys.transpose(1, 2).contiguous().view(b * h, t, k)
        queries = queries.transpose(1, 2).contiguous().view(b * h, t, k)
        values = values.transpose(1, 2).contiguous().view(b * h, t, k)

        queries = queries / (k ** (1 / 4))
        keys = keys / (k ** (1 / 4))

        dot = torch.bmm(queries, keys.transpose(1, 2))  # (b*h, t, t)

        if self.mask:
            offset = 1 if FIXED else 0
            indices = torch.triu_indices(t, t, offset=offset)
            dot[:, indices[0], indices[1]] = float('-inf')

        dot = F.softmax(dot, dim=2)
        out = torch.bmm(dot, values).view(b, h, t, k)
        out = out.transpose(1, 2).contiguous().view(b, t, h * k)
        return self.unifyheads(out)


class TransformerBlock(nn.Module):
    def __init__(self, k, heads, mask):
        super().__init__()
        self.attention = SelfAttention(k, heads=heads, mask=mask)
        self.norm1 = nn.LayerNorm(k)
        self.norm2 = nn.LayerNorm(k)
        self.ff = nn.Sequential(nn.Linear(k, 4 * k), nn.ReLU(), nn.Linear(4 * k, k))

    def forward(self, x):
        attended = self.attention(x)
        x = self.norm1(attended + x)
        fedforward = self.ff(x)
        return self.norm2(fedforward + x)


class GTransformer(nn.Module):
    """Generating transformer: autoregressive character model (mask=True)."""

    def __init__(self, k, heads, depth, seq_length, num_tokens):
        super().__init__()
        self.num_tokens = num_tokens
        self.token_embedding = nn.Embedding(num_tokens, k)
        self.pos_embedding = nn.Embedding(seq_length, k)
        self.tblocks = nn.Sequential(*[TransformerBlock(k, heads, mask=True) for _ in range(depth)])
        self.toprobs = nn.Linear(k, num_tokens)

    def forward(self, x):
        tokens = self.token_embedding(x)
        b, t, k = tokens.size()
        positions = self.pos_embedding(torch.arange(t))[None, :, :].expand(b, t, k)
        x = self.tblocks(tokens + positions)
        x = self.toprobs(x.view(b * t, k)).view(b, t, self.num_tokens)
        return F.log_softmax(x, dim=2)


def main():
    torch.manual_seed(0)
    model = GTransformer(k=16, heads=2, depth=2, seq_length=8, num_tokens=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    seq = torch.randint(0, 32, (4, 9))
    source, target = seq[:, :-1], seq[:, 1:]
    output = model(source)
    loss = F.nll_loss(output.transpose(2, 1), target, reduction='mean')
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"{'fixed' if FIXED else 'buggy'}: training loss = {loss.item():.4f}, "
          f"nan in outputs = {torch.isnan(output).any().item()}")


if __name__ == "__main__":
    main()
