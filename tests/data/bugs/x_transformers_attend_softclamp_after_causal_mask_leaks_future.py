# x-transformers (lucidrains/x-transformers commit 9078611, "softclamping of attention logits needs to happen before masking"):
# Attend.forward softclamps the logits AFTER the causal/key-padding masked_fill, so -finfo.max becomes -logit_softclamp_value
# and masked (future / padded) keys get a small non-zero softmax weight.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def softclamp(t, value):
    return (t / value).tanh() * value


def create_causal_mask(i, j, device):
    return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)


class Attend(nn.Module):
    def __init__(self, *, causal=False, scale=None, logit_softclamp_value=None):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.create_causal_mask = create_causal_mask
        self.attn_fn = partial(F.softmax, dtype=torch.float64)
        self.logit_softclamp_value = logit_softclamp_value

    def forward(self, q, k, v, mask=None, attn_bias=None):
        n = q.shape[-2]
        device = q.device
        scale = default(self.scale, q.shape[-1] ** -0.5)
        causal = self.causal
        if n == 1 and causal:
            causal = False

        sim = einsum('b h i d, b h j d -> b h i j', q, k) * scale

        if exists(attn_bias):
            sim = sim + attn_bias

        if FIXED and exists(self.logit_softclamp_value):
            sim = softclamp(sim, self.logit_softclamp_value)

        i, j, dtype = *sim.shape[-2:], sim.dtype
        mask_value = -torch.finfo(sim.dtype).max

        if exists(mask):
            sim = sim.masked_fill(~mask, mask_value)

        if causal:
            causal_mask = self.create_causal_mask(i, j, device=device)
            sim = sim.masked_fill(causal_mask, mask_value)

        if not FIXED and exists(self.logit_softclamp_value):
            sim = softclamp(sim, self.logit_softclamp_value)

        attn = self.attn_fn(sim, dim=-1)
        attn = attn.type(dtype)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        return out


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=False, logit_softclamp_value=None):
        super().__init__()
        self.heads = heads
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.attend = Attend(causal=causal, logit_softclamp_value=logit_softclamp_value)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (t(x).view(b, n, h, -1).transpose(1, 2) for t in (self.to_q, self.to_k, self.to_v))
        input_mask = None
        if exists(mask):
            input_mask = mask[:, None, None, :]  # 'b j -> b 1 1 j'
        out = self.attend(q, k, v, mask=input_mask)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class Decoder(nn.Module):
    def __init__(self, dim, depth, heads, attn_logit_softclamp_value):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                nn.LayerNorm(dim), Attention(dim, heads=heads, causal=True, logit_softclamp_value=attn_logit_softclamp_value),
                nn.LayerNorm(dim), FeedForward(dim),
            ]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        for n1, attn, n2, ff in self.layers:
            x = attn(n1(x), mask=mask) + x
            x = ff(n2(x)) + x
        return self.final_norm(x)


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens, max_seq_len, attn_layers):
        super().__init__()
        dim = 32
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, x, mask=None):
        pos = torch.arange(x.shape[1], device=x.device)
        x = self.token_emb(x) + self.pos_emb(pos)
        x = self.attn_layers(x, mask=mask)
        return self.to_logits(x)


model = TransformerWrapper(
    num_tokens=64, max_seq_len=32,
    attn_layers=Decoder(dim=32, depth=2, heads=4, attn_logit_softclamp_value=10.),
).eval()

seq = torch.randint(0, 64, (2, 16))
seq2 = seq.clone()
seq2[:, 8:] = torch.randint(0, 64, (2, 8))  # change only the "future" half

with torch.no_grad():
    a = model(seq)
    b = model(seq2)

causal_leak = (a[:, :8] - b[:, :8]).abs().max().item()
print(f"max |logits[:8]| change when only tokens 8.. change (causal leak): {causal_leak:.3e}")
