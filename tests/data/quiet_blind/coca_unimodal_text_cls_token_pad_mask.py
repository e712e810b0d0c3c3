"""CoCa unimodal text encoder: causal text plus a trailing CLS token that must not see padding.

Follows lucidrains/CoCa-pytorch coca_pytorch/coca_pytorch.py (CoCa.embed_text, ParallelTransformerBlock).
A learned text CLS token is appended after the (right-padded) caption. Each ParallelTransformerBlock
masks the future with a bool triu causal mask (-finfo.max); embed_text adds an extra attention mask
`F.pad(cls_mask, (0, 1, seq, 0), value=True)` whose only restrictive row is the CLS row: it hides the
pad tokens from the CLS token. Pads sit after the real tokens, so causality already keeps real text
rows off them; pad rows attend to real text and earlier pads, and their outputs are dropped by the
caption loss (ignore_index=pad_id).
Mask meant: causal over seq+1 positions, and the CLS row (last) sees only non-pad text plus itself.
Keys/values are single-head (multi-query), as in the project.
"""
import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class ParallelTransformerBlock(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, ff_mult=2):
        super().__init__()
        self.norm = LayerNorm(dim)
        attn_inner_dim = dim_head * heads
        ff_inner_dim = dim * ff_mult
        self.fused_dims = (attn_inner_dim, dim_head, dim_head, ff_inner_dim * 2)
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.fused_attn_ff_proj = nn.Linear(dim, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(attn_inner_dim, dim, bias=False)
        self.ff_out = nn.Sequential(SwiGLU(), nn.Linear(ff_inner_dim, dim, bias=False))
        self.mask = None

    def get_mask(self, n, device):
        if self.mask is not None and self.mask.shape[-1] >= n:
            return self.mask[:n, :n].to(device)
        mask = torch.ones((n, n), device=device, dtype=torch.bool).triu(1)
        self.mask = mask
        return mask

    def forward(self, x, attn_mask=None):
        b, n, _ = x.shape
        h = self.heads
        x = self.norm(x)
        q, k, v, ff = self.fused_attn_ff_proj(x).split(self.fused_dims, dim=-1)
        q = q.view(b, n, h, -1).transpose(1, 2) * self.scale
        sim = torch.einsum("bhid,bjd->bhij", q, k)
        causal_mask = self.get_mask(n, x.device)
        sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        if attn_mask is not None:
            # extra mask: keeps the text CLS token off the padding
            sim = sim.masked_fill(~attn_mask[:, None], -torch.finfo(sim.dtype).max)
        sim = sim - sim.amax(dim=-1, keepdim=True).detach()
        attn = sim.softmax(dim=-1)
        out = torch.einsum("bhij,bjd->bhid", attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.attn_out(out) + self.ff_out(ff)


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, *args, **kwargs):
        return self.fn(x, *args, **kwargs) + x


class CoCaText(nn.Module):
    def __init__(self, *, dim, num_tokens, unimodal_depth, pad_id=0):
        super().__init__()
        self.pad_id = pad_id
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.text_cls_token = nn.Parameter(torch.randn(dim))
        self.unimodal_layers = nn.ModuleList(
            [Residual(ParallelTransformerBlock(dim=dim)) for _ in range(unimodal_depth)])
        self.text_cls_norm = LayerNorm(dim)

    def embed_text(self, text):
        batch, seq = text.shape
        text_tokens = self.token_emb(text)
        text_cls_tokens = self.text_cls_token.expand(batch, 1, -1)
        text_tokens = torch.cat((text_tokens, text_cls_tokens), dim=-2)
        # the CLS token at the end must not attend to padding
        cls_mask = (text != self.pad_id)[:, None, :]
        attn_mask = F.pad(cls_mask, (0, 1, seq, 0), value=True)
        for attn_ff in self.unimodal_layers:
            text_tokens = attn_ff(text_tokens, attn_mask=attn_mask)
        text_tokens, text_cls_tokens = text_tokens[:, :-1], text_tokens[:, -1]
        return self.text_cls_norm(text_cls_tokens), text_tokens


if __name__ == "__main__":
    torch.manual_seed(0)
    model = CoCaText(dim=64, num_tokens=100, unimodal_depth=2, pad_id=0).eval()
    text = torch.tensor([[5, 17, 23, 9, 0, 0, 0],
                         [8, 44, 12, 61, 30, 2, 0],
                         [3, 7, 0, 0, 0, 0, 0]])
    with torch.no_grad():
        text_embeds, text_tokens = model.embed_text(text)
    print("text_embeds", tuple(text_embeds.shape), "text_tokens", tuple(text_tokens.shape))
