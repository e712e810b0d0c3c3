"""audiolm-pytorch: the forgetful causal mask of CoarseTransformerWrapper is built after the forward pass.

Citation: lucidrains/audiolm-pytorch#69 ("bugfix - forgetful mask was not used", commit e98e856).

Bug: CoarseTransformerWrapper.forward (and FineTransformerWrapper.forward) implement forgetful
causal masking (mask_prob = 0.15: during training each row drops a random subset of keys, a
structured attention dropout) by ``self_attn_mask &= generate_mask_with_prob(...)`` - but that line
sat *after* ``self.transformer(..., self_attn_mask = self_attn_mask)``, so the transformer only
ever saw the semantic padding mask and the dropout never reached attention.
Fix: move the forgetful-mask block above the transformer call.

Reproduction: the wrapper, CoarseTransformer and Attention (masked_fill of ~mask on the keys, then
the causal triu fill, softmax) of that version in training mode with dropout 0, a batch of two
semantic sequences (the second padded with pad_id) and coarse tokens.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

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
    def __init__(self, dim, causal=False, dim_head=8, heads=4, dropout=0.):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.causal = causal
        inner_dim = dim_head * heads
        self.norm = nn.LayerNorm(dim)
        self.attn_dropout = nn.Dropout(dropout)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        x = self.norm(x)
        q, k, v = self.to_q(x), *self.to_kv(x).chunk(2, dim=-1)
        q = q.view(b, n, self.heads, -1).transpose(1, 2) * self.scale
        sim = einsum('b h i d, b j d -> b h i j', q, k)
        if exists(mask):
            mask = mask[:, None, None, :]
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = self.attn_dropout(sim.softmax(dim=-1))
        out = einsum('b h i j, b j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class Transformer(nn.Module):
    def __init__(self, dim, depth):
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleList([
            Attention(dim=dim, causal=True),
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim * 4), nn.GELU(), nn.Linear(dim * 4, dim)),
        ]) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, self_attn_mask=None):
        for attn, ff in self.layers:
            x = attn(x, mask=self_attn_mask) + x
            x = ff(x) + x
        return self.norm(x)


class CoarseTransformer(nn.Module):
    def __init__(self, *, codebook_size, num_coarse_quantizers, dim, depth, num_semantic_tokens):
        super().__init__()
        self.semantic_start_token = nn.Parameter(torch.randn(dim))
        self.coarse_start_token = nn.Parameter(torch.randn(dim))
        self.semantic_embedding = nn.Embedding(num_semantic_tokens + 1, dim)
        self.coarse_embedding = nn.Embedding(num_coarse_quantizers * codebook_size, dim)
        self.transformer = Transformer(dim=dim, depth=depth)
        self.to_semantic_logits = nn.Linear(dim, num_semantic_tokens + 1)
        self.to_coarse_logits = nn.Linear(dim, codebook_size)

    def forward(self, *, semantic_token_ids, coarse_token_ids, self_attn_mask=None):
        b = semantic_token_ids.shape[0]
        semantic_tokens = self.semantic_embedding(semantic_token_ids)
        coarse_tokens = self.coarse_embedding(coarse_token_ids)
        semantic_seq_len = semantic_tokens.shape[1]
        semantic_start = self.semantic_start_token.expand(b, 1, -1)
        coarse_start = self.coarse_start_token.expand(b, 1, -1)
        tokens = torch.cat((semantic_start, semantic_tokens, coarse_start, coarse_tokens), dim=1)
        tokens = self.transformer(tokens, self_attn_mask=self_attn_mask)
        pred_semantic_tokens, pred_coarse_tokens = tokens[:, :semantic_seq_len], tokens[:, (semantic_seq_len + 1):]
        return self.to_semantic_logits(pred_semantic_tokens), self.to_coarse_logits(pred_coarse_tokens)


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
                self_attn_mask &= generate_mask_with_prob(self_attn_mask.shape, self.mask_prob,
                                                          device=self_attn_mask.device)

        semantic_logits, coarse_logits = self.transformer(
            semantic_token_ids=semantic_token_ids,
            coarse_token_ids=coarse_token_ids,
            self_attn_mask=self_attn_mask,
        )

        if not FIXED:
            # forgetful causal mask - structured dropout
            if self.mask_prob > 0 and self.training:
                self_attn_mask &= generate_mask_with_prob(self_attn_mask.shape, self.mask_prob,
                                                          device=self_attn_mask.device)

        return semantic_logits, coarse_logits


if __name__ == "__main__":
    torch.manual_seed(0)
    transformer = CoarseTransformer(codebook_size=16, num_coarse_quantizers=2, dim=32, depth=2,
                                    num_semantic_tokens=20)
    wrapper = CoarseTransformerWrapper(transformer=transformer, pad_id=-1, mask_prob=0.15)
    wrapper.train()
    semantic_token_ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10],
                                       [3, 11, 12, 13, 14, -1, -1, -1]])
    coarse_token_ids = torch.randint(0, 32, (2, 12))
    semantic_logits, coarse_logits = wrapper(semantic_token_ids=semantic_token_ids,
                                             coarse_token_ids=coarse_token_ids)
    print("coarse logits", tuple(coarse_logits.shape), "%.4f" % coarse_logits[0, -1].sum().item())
