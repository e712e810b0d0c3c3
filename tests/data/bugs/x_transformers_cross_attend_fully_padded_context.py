# lucidrains/x-transformers#263 (fixed in 35f7000): a cross-attention row whose context_mask is all False
# was not handled outside the causal+mask branch, so the query spread its attention over the padded context.
import sys
import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(v):
    return v is not None


class Attend(nn.Module):
    def __init__(self, causal=False, dropout=0.):
        super().__init__()
        self.causal = causal
        self.attn_fn = F.softmax
        self.attn_dropout = nn.Dropout(dropout)

    def create_causal_mask(self, i, j, device):
        return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)

    def forward(self, q, k, v, mask=None):
        n, device = q.shape[-2], q.device
        scale = q.shape[-1] ** -0.5
        causal = self.causal

        if exists(mask) and mask.ndim == 2:
            mask = mask[:, None, None, :]  # 'b j -> b 1 1 j'

        if n == 1 and causal:
            causal = False

        sim = einsum('b h i d, b h j d -> b h i j', q, k) * scale
        i, j, dtype = *sim.shape[-2:], sim.dtype
        mask_value = -torch.finfo(sim.dtype).max

        if exists(mask):
            sim = sim.masked_fill(~mask, mask_value)

        if causal:
            causal_mask = self.create_causal_mask(i, j, device=device)
            sim = sim.masked_fill(causal_mask, mask_value)

        row_is_entirely_masked = None
        if FIXED and exists(mask):
            row_is_entirely_masked = ~mask.any(dim=-1)

        attn = self.attn_fn(sim, dim=-1).type(dtype)
        attn = self.attn_dropout(attn)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        if exists(row_is_entirely_masked):
            out = out.masked_fill(row_is_entirely_masked[..., None], 0.)
        return out


class Attention(nn.Module):
    def __init__(self, dim, heads=2, dim_head=8, causal=False):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_k = nn.Linear(dim, heads * dim_head, bias=False)
        self.to_v = nn.Linear(dim, heads * dim_head, bias=False)
        self.attend = Attend(causal=causal)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x, context=None, context_mask=None):
        kv_input = context if exists(context) else x
        b, n, _ = x.shape
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        q, k, v = map(lambda t: t.view(b, -1, self.heads, t.shape[-1] // self.heads).transpose(1, 2), (q, k, v))
        out = self.attend(q, k, v, mask=context_mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class Decoder(nn.Module):
    def __init__(self, dim, depth=2, cross_attend=True):
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            self.layers.append(nn.ModuleList([nn.LayerNorm(dim), Attention(dim, causal=True),
                                              nn.LayerNorm(dim), Attention(dim),
                                              nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))]))

    def forward(self, x, context=None, context_mask=None):
        for n1, self_attn, n2, cross_attn, n3, ff in self.layers:
            x = x + self_attn(n1(x))
            x = x + cross_attn(n2(x), context=context, context_mask=context_mask)
            x = x + ff(n3(x))
        return x


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens=40, dim=16):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.attn_layers = Decoder(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, context=None, context_mask=None):
        return self.to_logits(self.attn_layers(self.token_emb(x), context=context, context_mask=context_mask))


model = TransformerWrapper().eval()
tokens = torch.randint(0, 40, (2, 6))
context = torch.randn(2, 4, 16)
context_mask = torch.tensor([[True, True, True, False], [False, False, False, False]])  # sample 1: no conditioning
with torch.no_grad():
    out = model(tokens, context=context, context_mask=context_mask)
    other = context.clone()
    other[1] = torch.randn(4, 16)  # change only the fully padded context of sample 1
    out2 = model(tokens, context=other, context_mask=context_mask)
print("fixed" if FIXED else "buggy", "sample 1 logits move with its padded context by",
      f"{(out[1] - out2[1]).abs().max().item():.4f}", "| sample 0 unchanged:", torch.allclose(out[0], out2[0]))
