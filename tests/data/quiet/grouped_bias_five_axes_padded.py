"""A correct JAX-style grouped-query decoder ported to torch (MaxText's and the t5x family's layout): the additive
bias is laid out (batch, 1, 1, q, k) of 0 and -1e9 from a left-padded batch's padding and the causal triangle (each
padding query kept on itself, so no row is empty), added to einsum scores (batch, kv_heads, groups, q, k) in one
layer and handed to SDPA, squeezed to (batch, 1, q, k), with the heads flattened in the other. Each kernel keeps to the
bias the frames hold: no finding."""
import torch
import torch.nn as nn
import torch.nn.functional as F


def attend(q, k, v, attn_bias, use_fused):
    b, kv, g, t, d = q.shape
    if use_fused:
        qf = q.reshape(b, kv * g, t, d)
        kf, vf = (x.repeat_interleave(g, dim=1) for x in (k, v))
        return F.scaled_dot_product_attention(qf, kf, vf, attn_mask=attn_bias[:, :, 0]).reshape(b, kv, g, t, d)
    logits = torch.einsum("bkgtd,bksd->bkgts", q, k) / d ** 0.5 + attn_bias
    return torch.einsum("bkgts,bksd->bkgtd", logits.softmax(-1), v)


class GroupedAttention(nn.Module):
    def __init__(self, dim=16, kv_heads=2, groups=2, use_fused=True):
        super().__init__()
        self.kv_heads, self.groups, self.head_dim, self.use_fused = kv_heads, groups, dim // (kv_heads * groups), use_fused
        self.q, self.kv, self.o = nn.Linear(dim, dim), nn.Linear(dim, 2 * kv_heads * self.head_dim), nn.Linear(dim, dim)

    def forward(self, x, attn_bias):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.kv_heads, self.groups, self.head_dim).permute(0, 2, 3, 1, 4)
        k, v = (z.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2) for z in self.kv(x).chunk(2, -1))
        out = attend(q, k, v, attn_bias, self.use_fused)
        return self.o(out.permute(0, 3, 1, 2, 4).reshape(b, t, -1))


class Decoder(nn.Module):
    def __init__(self, vocab=30, dim=16):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.blocks = nn.ModuleList([GroupedAttention(dim, use_fused=False), GroupedAttention(dim, use_fused=True)])

    def forward(self, tokens, attention_mask):
        t = tokens.shape[1]
        allowed = attention_mask.bool()[:, None, :] & torch.ones(t, t, dtype=torch.bool).tril()
        allowed |= torch.eye(t, dtype=torch.bool)
        attn_bias = torch.where(allowed, 0.0, -1e9)[:, None, None]
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x, attn_bias)
        return self.head(x)


torch.manual_seed(0)
model = Decoder().eval()
tokens = torch.tensor([[0, 0, 5, 9, 14, 3], [7, 8, 2, 11, 19, 4]])
with torch.no_grad():
    logits = model(tokens, (tokens != 0).long())
print("logits", tuple(logits.shape))
