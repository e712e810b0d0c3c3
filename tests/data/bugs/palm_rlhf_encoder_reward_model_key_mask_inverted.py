"""PaLM-rlhf-pytorch: the encoder (reward model) key padding mask is inverted (lucidrains/PaLM-rlhf-pytorch 6e1baf6).

Citation: lucidrains/PaLM-rlhf-pytorch commit 6e1baf6 "fix masking logic when using palm as encoder"
(2023-01-08), fixing the mask added two days earlier in 4cac0e6 "make sure key padding mask is in effect if
training reward model as encoder". Read in the upstream git history: palm_rlhf_pytorch/palm_rlhf_pytorch.py
(`ParallelTransformerBlock.forward`, `PaLM.forward`, `RewardModel.forward`) and the README at 6e1baf6^. No issue
thread.

Bug: a reward model is a `PaLM(causal=False)` (the README's reward-model example). `PaLM.forward` treats negative
token ids as padding, but built the mask as `mask = (x < 0) if not self.causal else None`, while the block applies
it as a keep-mask: `sim.masked_fill(~mask, -finfo.max)`. So every real token is masked out as a key and only the
(negative-id) padding would be kept. With an unpadded batch (negative ids would also crash the embedding), every
key of every query is masked and the softmax is uniform over the whole sequence.

Fix: `mask = x >= 0; x = x.masked_fill(~mask, 0)` when not causal.

This program: the pre-fix ParallelTransformerBlock (fused attention/feedforward projection, multi-query attention,
rotary embeddings, key padding mask then causal mask, softmax of einsum scores), `PaLM(causal=False)` and
`RewardModel` (prompt/response embeddings, mean pooling, scalar head), run on the README's mock data shape
(an unpadded batch with a prompt mask). LoRA finetune scopes and xpos are left out (`use_lora=False`), and einops' `rearrange` calls are
written as plain view/transpose/indexing (einops is not installed here). Prints rewards.
"""

import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def masked_mean(seq, mask=None, dim=1):
    if not exists(mask):
        return seq.mean(dim=dim)
    mask = mask[..., None]  # rearrange(mask, "b n -> b n 1")
    return (seq * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1e-5)


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


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len):
        t = torch.arange(seq_len).type_as(self.inv_freq)
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(pos, t):
    return (t * pos.cos()) + (rotate_half(t) * pos.sin())


class ParallelTransformerBlock(nn.Module):
    def __init__(self, dim, dim_head=16, causal=True, heads=4, ff_mult=4):
        super().__init__()
        self.norm = LayerNorm(dim)
        attn_inner_dim = dim_head * heads
        ff_inner_dim = dim * ff_mult
        self.fused_dims = (attn_inner_dim, dim_head, dim_head, (ff_inner_dim * 2))
        self.heads = heads
        self.scale = dim_head**-0.5
        self.causal = causal
        self.rotary_emb = RotaryEmbedding(dim_head)
        self.fused_attn_ff_proj = nn.Linear(dim, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(attn_inner_dim, dim, bias=False)
        self.ff_out = nn.Sequential(SwiGLU(), nn.Linear(ff_inner_dim, dim, bias=False))

    def forward(self, x, mask=None):
        n, device, h = x.shape[1], x.device, self.heads
        x = self.norm(x)
        q, k, v, ff = self.fused_attn_ff_proj(x).split(self.fused_dims, dim=-1)
        # multi-query single-key-value attention
        q = q.view(q.shape[0], n, h, -1).transpose(1, 2)  # rearrange "b n (h d) -> b h n d"
        q = q * self.scale
        positions = self.rotary_emb(n)
        q, k = apply_rotary_pos_emb(positions, q), apply_rotary_pos_emb(positions, k)
        sim = einsum("b h i d, b j d -> b h i j", q, k)

        # key padding mask
        if exists(mask):
            mask = mask[:, None, None, :]  # rearrange "b j -> b 1 1 j"
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)

        # causal mask
        if self.causal:
            causal_mask = torch.ones((n, n), device=device, dtype=torch.bool).triu(1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)
        out = einsum("b h i j, b j d -> b h i d", attn, v)
        out = out.transpose(1, 2).reshape(out.shape[0], n, -1)  # rearrange "b h n d -> b n (h d)"
        return self.attn_out(out) + self.ff_out(ff)


class PaLM(nn.Module):
    def __init__(self, *, dim, num_tokens, depth, causal=True, dim_head=16, heads=4, ff_mult=4):
        super().__init__()
        self.dim = dim
        self.causal = causal
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.layers = nn.ModuleList(
            [ParallelTransformerBlock(dim=dim, causal=causal, dim_head=dim_head, heads=heads, ff_mult=ff_mult)
             for _ in range(depth)]
        )
        self.norm = LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)
        self.to_logits.weight = self.token_emb.weight
        nn.init.normal_(self.token_emb.weight, std=0.02)

    def forward(self, x, extra_embed=None, return_only_embedding=False):
        # mask if encoder
        # treat any token ids that are negative as tokens to mask out - only needed if not autoregressive
        if FIXED:
            if not self.causal:
                mask = x >= 0
                x = x.masked_fill(~mask, 0)
            else:
                mask = None
        else:
            mask = (x < 0) if not self.causal else None

        x = self.token_emb(x)
        if exists(extra_embed):
            x = x + extra_embed
        for layer in self.layers:
            x = x + layer(x, mask=mask)
        embeds = self.norm(x)
        if return_only_embedding:
            return embeds
        return self.to_logits(embeds)


class RewardModel(nn.Module):
    def __init__(self, palm: PaLM, num_binned_output=0.0, use_lora=False):
        super().__init__()
        self.palm = palm
        dim = palm.dim
        self.binned_output = num_binned_output > 1
        self.prompt_embed = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.response_embed = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.to_pred = nn.Linear(dim, 1, bias=False)

    def forward(self, x, mask=None, prompt_mask=None, labels=None):
        # reward model should have an understanding of which section is prompt, and which section is response
        extra_embed = None
        if exists(prompt_mask):
            extra_embed = torch.where(prompt_mask[..., None], self.prompt_embed, self.response_embed)
        embeds = self.palm(x, extra_embed=extra_embed, return_only_embedding=True)
        pooled = masked_mean(embeds, mask, dim=1)
        pred = self.to_pred(pooled).squeeze(-1)
        if not exists(labels):
            return pred
        return F.mse_loss(pred, labels)


def main():
    torch.manual_seed(0)
    palm = PaLM(num_tokens=256, dim=32, depth=2, causal=False)
    reward_model = RewardModel(palm)
    # mock data, as in the README: which part of the sequence is prompt, which part is response
    seq = torch.randint(0, 256, (2, 12))
    prompt_mask = torch.arange(12)[None, :] < torch.tensor([[5], [7]])
    with torch.no_grad():
        reward = reward_model(seq, prompt_mask=prompt_mask)
    print("rewards:", [round(r, 5) for r in reward.tolist()])


if __name__ == "__main__":
    main()
