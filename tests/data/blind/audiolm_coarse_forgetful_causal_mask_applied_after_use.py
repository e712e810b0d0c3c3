"""audiolm-pytorch CoarseTransformerWrapper: the forgetful causal mask is applied after the forward pass.

Citation: lucidrains/audiolm-pytorch PR #69 ("bugfix - forgetful mask was not used"), commit
e98e856b4076b8c6210f5838278be1ba1c400982 (merge 42c48b2). Read in the upstream git history of
audiolm_pytorch/audiolm_pytorch.py (parent and fix commit).

Bug: `CoarseTransformerWrapper.forward` (and `FineTransformerWrapper.forward`) build the
self-attention key mask from the semantic tokens (`!= pad_id` and `!= semantic_eos_id`), pad it
for the BOS tokens and the coarse tokens, call `self.transformer(..., self_attn_mask=...)`, and
only then apply "forgetful causal mask - structured dropout":
`self_attn_mask &= generate_mask_with_prob(shape, self.mask_prob)`. The mask had already been
used, so the random key dropping configured by `mask_prob` (0.15) never reaches attention.
Fix: apply the forgetful mask before calling the transformer.

This program: `generate_mask_with_prob`, `Attention` (key mask `b j -> b 1 1 j`, causal
`triu(j - i + 1)`, masked_fill + softmax) and `Transformer` as upstream, without the relative
position bias, null kv and grad shrink; `CoarseTransformer` reduced to token embeddings and the
transformer; training mode with dropout 0 so the run is deterministic.
"""
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def generate_mask_with_prob(shape, mask_prob, device):
    seq = shape[-1]
    rand = torch.randn(shape, device=device)
    rand[:, 0] = -torch.finfo(rand.dtype).max
    num_mask = min(int(seq * mask_prob), seq - 1)
    indices = rand.topk(num_mask, dim=-1).indices
    mask = ~torch.zeros(shape, device=device).scatter(1, indices, 1.).bool()
    return mask


class Attention(nn.Module):
    def __init__(self, dim, causal=False, dim_head=64, heads=8, dropout=0.1):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.causal = causal
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.attn_dropout = nn.Dropout(dropout)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * 2, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, dim, bias=False), nn.Dropout(dropout))

    def forward(self, x, mask=None, attn_bias=None):
        b, n, _ = x.shape
        x = self.norm(x)
        q, k, v = self.to_q(x), *self.to_kv(x).chunk(2, dim=-1)
        q = q.view(b, n, self.heads, -1).transpose(1, 2)  # 'b n (h d) -> b h n d'
        q = q * self.scale
        sim = einsum('b h i d, b j d -> b h i j', q, k)
        if exists(attn_bias):
            sim = sim + attn_bias
        if exists(mask):
            mask = mask[:, None, None, :]  # 'b j -> b 1 1 j'
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)
        out = einsum('b h i j, b j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, *, dim, depth, heads, attn_dropout=0., ff_dropout=0., **kwargs):
        super().__init__()
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim=dim, heads=heads, dropout=attn_dropout, causal=True, **kwargs),
                nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 4), nn.GELU(), nn.Dropout(ff_dropout), nn.Linear(dim * 4, dim)),
            ]))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, self_attn_mask=None):
        for attn, ff in self.layers:
            x = attn(x, mask=self_attn_mask) + x
            x = ff(x) + x
        return self.norm(x)


class CoarseTransformer(nn.Module):
    def __init__(self, *, num_semantic_tokens, codebook_size, dim, depth, heads=8, dim_head=16):
        super().__init__()
        self.semantic_start_token = nn.Parameter(torch.randn(dim))
        self.coarse_start_token = nn.Parameter(torch.randn(dim))
        self.semantic_embedding = nn.Embedding(num_semantic_tokens + 1, dim)
        self.coarse_embedding = nn.Embedding(codebook_size, dim)
        self.transformer = Transformer(dim=dim, depth=depth, heads=heads, dim_head=dim_head)
        self.to_semantic_logits = nn.Linear(dim, num_semantic_tokens + 1)
        self.to_coarse_logits = nn.Linear(dim, codebook_size)

    def forward(self, *, semantic_token_ids, coarse_token_ids, self_attn_mask=None):
        b = semantic_token_ids.shape[0]
        semantic_tokens = self.semantic_embedding(semantic_token_ids)
        coarse_tokens = self.coarse_embedding(coarse_token_ids)
        semantic_start = self.semantic_start_token.expand(b, 1, -1)
        coarse_start = self.coarse_start_token.expand(b, 1, -1)
        tokens = torch.cat((semantic_start, semantic_tokens, coarse_start, coarse_tokens), dim=1)
        tokens = self.transformer(tokens, self_attn_mask=self_attn_mask)
        n = semantic_token_ids.shape[-1]
        return self.to_semantic_logits(tokens[:, :n + 1]), self.to_coarse_logits(tokens[:, n + 1:])


class CoarseTransformerWrapper(nn.Module):
    def __init__(self, *, transformer, pad_id=-1, mask_prob=0.15):
        super().__init__()
        self.transformer = transformer
        self.pad_id = pad_id
        self.semantic_eos_id = transformer.semantic_embedding.num_embeddings - 1
        self.mask_prob = mask_prob

    def forward(self, *, semantic_token_ids, coarse_token_ids):
        self_attn_mask = (semantic_token_ids != self.pad_id) & (semantic_token_ids != self.semantic_eos_id)
        semantic_token_ids = semantic_token_ids.masked_fill(~self_attn_mask, 0)
        coarse_token_len = coarse_token_ids.shape[-1]
        self_attn_mask = F.pad(self_attn_mask, (1, coarse_token_len + 1), value=True)  # attend to semantic bos and all coarse tokens

        if FIXED:
            # forgetful causal mask - structured dropout
            if self.mask_prob > 0 and self.training:
                self_attn_mask &= generate_mask_with_prob(self_attn_mask.shape, self.mask_prob, device=self_attn_mask.device)

        semantic_logits, coarse_logits = self.transformer(
            semantic_token_ids=semantic_token_ids,
            coarse_token_ids=coarse_token_ids,
            self_attn_mask=self_attn_mask,
        )

        if not FIXED:
            # forgetful causal mask - structured dropout
            if self.mask_prob > 0 and self.training:
                self_attn_mask &= generate_mask_with_prob(self_attn_mask.shape, self.mask_prob, device=self_attn_mask.device)

        return semantic_logits, coarse_logits


def main():
    torch.manual_seed(0)
    coarse = CoarseTransformer(num_semantic_tokens=50, codebook_size=32, dim=32, depth=2, heads=4, dim_head=8)
    wrapper = CoarseTransformerWrapper(transformer=coarse, mask_prob=0.15)
    wrapper.train()  # the forgetful mask is a training-time regulariser; all dropouts are 0 here
    semantic_token_ids = torch.randint(0, 50, (2, 12))
    semantic_token_ids[1, 9:] = -1  # pad_id
    coarse_token_ids = torch.randint(0, 32, (2, 8))
    semantic_logits, coarse_logits = wrapper(semantic_token_ids=semantic_token_ids, coarse_token_ids=coarse_token_ids)
    print("coarse logits[0, -1, :4]:", [round(v, 4) for v in coarse_logits[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
