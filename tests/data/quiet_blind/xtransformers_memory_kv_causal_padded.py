"""x-transformers Decoder with learned memory key/values (`attn_num_mem_kv`), causal, with a padding mask.

Follows lucidrains/x-transformers x_transformers/x_transformers.py (Attention: `self.mem_k`, `self.mem_v` of shape
(heads, num_mem_kv, dim_head) concatenated in FRONT of the keys/values, the input mask padded with True for them)
and x_transformers/attend.py (Attend.flash_attn: with causal and q_len != k_len it builds
`causal_mask = ones(i, j).triu(j - i + 1)`, i.e. the triangle aligned to the right end of the keys, ANDs it into the
bool mask and calls SDPA with is_causal=False).

Mask meant: keys are [2 memory slots, n tokens]; query i sees both memory slots always (they are learned
parameters, not sequence positions: no future leaks through them) and tokens j <= i that are not padding.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def exists(v):
    return v is not None


class Attend(nn.Module):
    def __init__(self, causal=False, dropout=0.0):
        super().__init__()
        self.causal = causal
        self.dropout = dropout

    def create_causal_mask(self, i, j, device):
        return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)

    def forward(self, q, k, v, mask=None):
        q_len, k_len = q.shape[-2], k.shape[-2]
        causal = self.causal
        if exists(mask):
            mask = mask[:, None, None, :].expand(-1, q.shape[1], q_len, -1)
        if causal and q_len != k_len:
            causal_mask = self.create_causal_mask(q_len, k_len, q.device)
            mask = (mask if exists(mask) else torch.ones_like(causal_mask)) & ~causal_mask
            causal = False
        elif causal and exists(mask):
            mask = mask & ~self.create_causal_mask(q_len, k_len, q.device)
            causal = False
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              dropout_p=self.dropout if self.training else 0.0)


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=8, causal=False, num_mem_kv=0):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.attend = Attend(causal=causal)
        self.num_mem_kv = num_mem_kv
        if num_mem_kv > 0:
            self.mem_k = nn.Parameter(torch.randn(heads, num_mem_kv, dim_head))
            self.mem_v = nn.Parameter(torch.randn(heads, num_mem_kv, dim_head))

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (t(x).view(b, n, h, -1).transpose(1, 2) for t in (self.to_q, self.to_k, self.to_v))
        if self.num_mem_kv > 0:
            mem_k = self.mem_k.unsqueeze(0).expand(b, -1, -1, -1)
            mem_v = self.mem_v.unsqueeze(0).expand(b, -1, -1, -1)
            k = torch.cat((mem_k, k), dim=-2)
            v = torch.cat((mem_v, v), dim=-2)
            if exists(mask):
                mask = F.pad(mask, (self.num_mem_kv, 0), value=True)
        out = self.attend(q, k, v, mask=mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class Decoder(nn.Module):
    def __init__(self, dim, depth, heads, attn_num_mem_kv=0):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                nn.LayerNorm(dim), Attention(dim, heads, causal=True, num_mem_kv=attn_num_mem_kv),
                nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim)),
            ]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x, mask=None):
        for norm1, attn, norm2, ff in self.layers:
            x = x + attn(norm1(x), mask=mask)
            x = x + ff(norm2(x))
        return self.final_norm(x)


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens, max_seq_len, attn_layers, dim):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(max_seq_len, dim)
        self.attn_layers = attn_layers
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, mask=None):
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.token_emb(x) + self.pos_emb(pos)
        return self.to_logits(self.attn_layers(h, mask=mask))


def main():
    torch.manual_seed(0)
    model = TransformerWrapper(num_tokens=50, max_seq_len=16, dim=32,
                               attn_layers=Decoder(dim=32, depth=2, heads=4, attn_num_mem_kv=2)).eval()
    x = torch.randint(0, 50, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[1, 7:] = False  # second sequence is 7 tokens long, right padded
    with torch.no_grad():
        logits = model(x, mask=mask)
        prefix = model(x[:, :5], mask=mask[:, :5])
    # causality: a prefix run gives the same logits as the full run on those positions
    assert torch.allclose(prefix, logits[:, :5], atol=1e-5)
    print(logits.argmax(-1)[:, :7].tolist())


if __name__ == "__main__":
    main()
