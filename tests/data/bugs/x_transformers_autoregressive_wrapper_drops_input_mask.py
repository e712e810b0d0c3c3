"""x-transformers: AutoregressiveWrapper dropped a `mask` that already had the input's length.

Citation: lucidrains/x-transformers commit d69d33c ("Fix potential dropped mask in
AutoregressiveWrapper", by Kenneth C. Arnold, April 2021): "if `mask` was already the right
shape, it gets dropped from `kwargs`".

Bug: `AutoregressiveWrapper.forward(x, **kwargs)` feeds `xi = x[:, :-1]` to the network and
tries to help users whose mask has the length of `x`:

    mask = kwargs.pop('mask', None)
    if mask is not None and mask.shape[1] == x.shape[1]:
        mask = mask[:, :-1]
        kwargs.update(mask = mask)

A mask already sized for `xi` (length n - 1) was popped and never put back, so the decoder ran
with no padding mask at all.
Fix: `kwargs.get('mask')` and `kwargs['mask'] = mask` only when it is trimmed.

This program keeps the wrapper and the Attention masking of that version (q_mask * k_mask
filled with the max negative value before the causal mask, einsum scores, softmax) in a small
TransformerWrapper(Decoder) and trains one step on a left-padded batch (pad id 0) whose
`mask` is given for the inputs `x[:, :-1]`.
"""
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    if exists(val):
        return val
    return d() if callable(d) else d


def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=False):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, mask=None):
        b, n, _, h, device = *x.shape, self.heads, x.device
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        q, k, v = (t.reshape(b, n, h, -1).transpose(1, 2) for t in (q, k, v))

        input_mask = None
        if exists(mask):
            q_mask = default(mask, lambda: torch.ones((b, n), device=device).bool())
            k_mask = q_mask
            q_mask = q_mask[:, None, :, None]
            k_mask = k_mask[:, None, None, :]
            input_mask = q_mask * k_mask

        dots = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        mask_value = max_neg_value(dots)

        if exists(input_mask):
            dots.masked_fill_(~input_mask, mask_value)
            del input_mask

        if self.causal:
            i, j = dots.shape[-2:]
            r = torch.arange(i, device=device)
            mask = r[None, None, :, None] < r[None, None, None, :]
            mask = F.pad(mask, (j - i, 0), value=False)
            dots.masked_fill_(mask, mask_value)
            del mask

        attn = dots.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Decoder(nn.Module):
    def __init__(self, dim, depth, heads):
        super().__init__()
        self.layers = nn.ModuleList([
            nn.ModuleList([
                nn.LayerNorm(dim), Attention(dim, heads=heads, causal=True),
                nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim)),
            ])
            for _ in range(depth)
        ])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        for norm1, attn, norm2, ff in self.layers:
            x = attn(norm1(x), mask=mask) + x
            x = ff(norm2(x)) + x
        return self.norm(x)


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens, max_seq_len, attn_layers, dim):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, mask=None):
        n = x.shape[1]
        x = self.token_emb(x) + self.pos_emb(torch.arange(n, device=x.device))
        x = self.attn_layers(x, mask=mask)
        return self.to_logits(x)


class AutoregressiveWrapper(nn.Module):
    def __init__(self, net, ignore_index=-100, pad_value=0):
        super().__init__()
        self.pad_value = pad_value
        self.ignore_index = ignore_index
        self.net = net
        self.max_seq_len = net.max_seq_len

    def forward(self, x, **kwargs):
        xi = x[:, :-1]
        xo = x[:, 1:]

        # help auto-solve a frequent area of confusion around input masks in auto-regressive
        # if user supplies a mask that is only off by one from the source sequence, resolve it for them
        if FIXED:
            mask = kwargs.get('mask', None)
            if mask is not None and mask.shape[1] == x.shape[1]:
                mask = mask[:, :-1]
                kwargs['mask'] = mask
        else:
            mask = kwargs.pop('mask', None)
            if mask is not None and mask.shape[1] == x.shape[1]:
                mask = mask[:, :-1]
                kwargs.update(mask=mask)

        out = self.net(xi, **kwargs)
        loss = F.cross_entropy(out.transpose(1, 2), xo, ignore_index=self.ignore_index)
        return loss


def main():
    torch.manual_seed(0)
    model = AutoregressiveWrapper(
        TransformerWrapper(num_tokens=64, max_seq_len=16, dim=32, attn_layers=Decoder(dim=32, depth=2, heads=4)),
        ignore_index=0, pad_value=0,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    lengths = [10, 6, 3]
    seq_len = 10
    seq = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    for row, length in enumerate(lengths):
        seq[row, seq_len - length:] = torch.randint(1, 64, (length,))  # left padded with pad id 0
    mask = (seq != 0)[:, :-1]  # mask for the inputs x[:, :-1]

    loss = model(seq, mask=mask)
    loss.backward()
    opt.step()
    print("fixed" if FIXED else "buggy", f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
