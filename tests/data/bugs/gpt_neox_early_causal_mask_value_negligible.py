"""Early GPT-NeoX (lucidrains' prototype): causal mask added with MASK_VALUE = -1e-7, i.e. no mask at all.

Citation: EleutherAI/gpt-neox commit 102d09b8 ("fix bug with masking", Dec 2020: MASK_VALUE -1e-7 -> -1e7,
the causal mask made (i, j) and passed as attn_mask); the dense-attention side was finished in commit
7043aac0 (EleutherAI/gpt-neox#21, PR #23: "fix bug with mask and half values, as well as masking in dense
attention": dense_attn takes attn_mask, mask value -finfo(dtype).max). I read both diffs.

Bug: Attention.forward built the causal mask as zeros filled with MASK_VALUE above the diagonal and
dense_attn added it to the scores. MASK_VALUE was -1e-7 (a typo for -1e7), so future keys kept essentially
their full weight: the autoregressive training loss was computed by a model that sees the tokens it
predicts.

Fix: a large negative mask value (-1e7, later -torch.finfo(q.dtype).max). The same commit also made the
mask (i, j) and passed it as attn_mask; that part does not change what attention computes, so this program
switches only the value.

This program: the model as the prototype wrote it (einsum attention with an additive mask; einops'
rearrange written as view/permute since einops is not installed here) and one training step on random
tokens (plain SGD in place of train.py's Adam).
"""
import sys
from functools import partial

import torch
from torch import einsum, nn

FIXED = "--fixed" in sys.argv

MASK_VALUE = -1e7 if FIXED else -1e-7


def exists(val):
    return val is not None


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, dropout=0.):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Dropout(dropout), nn.Linear(dim * mult, dim))

    def forward(self, x, **kwargs):
        return self.net(x)


def dense_attn(q, k, v, key_padding_mask=None, dropout_fn=None):
    scale = q.shape[-1] ** -0.5
    sim = einsum('b h i d, b h j d -> b h i j', q, k) * scale
    if exists(key_padding_mask):
        sim = sim + key_padding_mask[:, None, :, :]
    attn = sim.softmax(dim=-1)
    if exists(dropout_fn):
        attn = dropout_fn(attn)
    return einsum('b h i j, b h j d -> b h i d', attn, v)


class Attention(nn.Module):
    def __init__(self, dim, heads, causal=True, dim_head=64, dropout=0.):
        super().__init__()
        inner_dim = heads * dim_head
        self.causal = causal
        self.heads = heads
        self.dropout = nn.Dropout(dropout)
        self.attn_fn = partial(dense_attn, dropout_fn=self.dropout)
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, **kwargs):
        b, n, h, device = x.shape[0], x.shape[1], self.heads, x.device
        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = map(lambda t: t.view(b, n, h, -1).permute(0, 2, 1, 3), (q, k, v))  # b n (h d) -> b h n d
        mask = None
        if self.causal:
            i, j = q.shape[-2], k.shape[-2]
            bool_mask = torch.ones(i, j, device=device).triu_(j - i + 1).bool()
            mask = torch.zeros(b, i, j, device=device)
            mask.masked_fill_(bool_mask, MASK_VALUE)
        out = self.attn_fn(q, k, v, key_padding_mask=mask)
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)  # b h n d -> b n (h d)
        return self.to_out(out)


class GPTNeoX(nn.Module):
    def __init__(self, *, num_tokens, dim, seq_len, depth, heads=8, dim_head=64, attn_dropout=0., ff_dropout=0.):
        super().__init__()
        self.seq_len = seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.token_emb.weight.data.normal_(0, 0.02)
        self.pos_emb.weight.data.normal_(0, 0.02)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                PreNorm(dim, Attention(dim=dim, heads=heads, dim_head=dim_head, dropout=attn_dropout)),
                PreNorm(dim, FeedForward(dim=dim, dropout=ff_dropout)),
            ]))
        self.norm = nn.LayerNorm(dim)
        self.to_logits = lambda t: t @ self.token_emb.weight.t()

    def forward(self, x, mask=None):
        n, device = x.shape[1], x.device
        x = self.token_emb(x)
        x = self.pos_emb(torch.arange(n, device=device)) + x
        for (attn, ff) in self.layers:
            x = attn(x) + x
            x = ff(x) + x
        return self.to_logits(self.norm(x))


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        xi, xo = x[:, :-1], x[:, 1:]
        out = self.net(xi)
        return nn.functional.cross_entropy(out.transpose(1, 2), xo)


def main():
    torch.manual_seed(0)
    model = AutoregressiveWrapper(GPTNeoX(num_tokens=256, dim=32, seq_len=16, depth=2, heads=2, dim_head=16))
    data = torch.randint(0, 256, (2, 17))
    loss = model(data)
    loss.backward()
    with torch.no_grad():  # plain SGD step (train.py used Adam; torch.optim's import doubles the run time)
        for p in model.parameters():
            p -= 1e-4 * p.grad
    print("training loss %.5f" % loss.item())


if __name__ == "__main__":
    main()
