# Written another way (for checks/twopaths.py): a BERT-style sentence encoder whose self-attention has a `fused` flag
# (F.scaled_dot_product_attention with an additive float mask) beside its eager path (q @ k^T, masked_fill with the
# dtype's lowest value, softmax), the mask a query-and-key padding pair mask, so a padded token's row sees no key. The
# program checks the two paths against each other on one layer of a right-padded batch of three. Buggy: the fused path
# writes -inf into the mask (NaN on a kernel without a safe softmax, 0 here, where the eager path gives uniform
# weights). Fixed: the fused path fills with finfo.min, as the eager path does.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, fused=True):
        super().__init__()
        self.heads, self.d = heads, hidden // heads
        self.fused = fused
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out = nn.Linear(hidden, hidden)

    def split(self, x):
        b, n, _ = x.shape
        return x.view(b, n, self.heads, self.d).transpose(1, 2)

    def forward(self, hidden_states, pair_mask):
        q, k, v = self.split(self.query(hidden_states)), self.split(self.key(hidden_states)), self.split(self.value(hidden_states))
        if self.fused:
            low = torch.finfo(q.dtype).min if FIXED else float("-inf")
            bias = torch.zeros(pair_mask.shape, dtype=q.dtype).masked_fill(~pair_mask, low)
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            scores = q @ k.transpose(-1, -2) / math.sqrt(self.d)
            scores = scores.masked_fill(~pair_mask, torch.finfo(scores.dtype).min)
            ctx = scores.softmax(dim=-1) @ v
        b, _, n, _ = ctx.shape
        return self.out(ctx.transpose(1, 2).reshape(b, n, -1))


class Layer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.attention = SelfAttention(hidden, heads)
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.ffn = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.GELU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, pair_mask):
        x = self.ln1(x + self.attention(x, pair_mask))
        return self.ln2(x + self.ffn(x))


class SentenceEncoder(nn.Module):
    def __init__(self, vocab=100, hidden=32, heads=4, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden, padding_idx=0)
        self.layers = nn.ModuleList(Layer(hidden, heads) for _ in range(depth))

    def forward(self, input_ids, attention_mask):
        real = attention_mask.bool()
        pair_mask = real[:, None, :, None] & real[:, None, None, :]  # (B, 1, L, L): a pad token sees nothing
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, pair_mask)
        return (x * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)


def main():
    torch.manual_seed(0)
    enc = SentenceEncoder().eval()
    attention_mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 4 + [0] * 5])
    input_ids = torch.randint(1, 100, (3, 9)) * attention_mask
    with torch.no_grad():
        pooled = enc(input_ids, attention_mask)
        real = attention_mask.bool()
        pair_mask = real[:, None, :, None] & real[:, None, None, :]
        x = enc.embed(input_ids)
        attn = enc.layers[0].attention
        fused = attn(x, pair_mask)
        attn.fused = False
        eager = attn(x, pair_mask)
    print(f"{'fixed' if FIXED else 'buggy'}: pooled finite {torch.isfinite(pooled).all().item()}; "
          f"fused vs eager, max diff = {(fused - eager).abs().max().item():.3e}")


if __name__ == "__main__":
    main()
