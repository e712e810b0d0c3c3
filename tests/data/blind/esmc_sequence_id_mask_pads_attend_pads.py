"""ESM C attention mask from `seq_id` equality lets padding tokens attend to each other.

Citation: Biohub/esm#299 ("Bug in attention mask - currently ESM3 and ESMC pad tokens attend to
each other", open).  I read the issue description, which quotes esm/layers/attention.py and gives
the fix; no merged fix was visible to me, so `--fixed` applies the issue's `correct_mask`.

Bug: ESMC.forward derives `sequence_id = sequence_tokens != pad_token_id` (True on residues,
False on padding; written from my knowledge of esm/models/esmc.py, not re-read here — the issue's
own script builds `seq_id` the same way) and MultiHeadAttention turns it into
`mask_BLL = seq_id.unsqueeze(-1) == seq_id.unsqueeze(-2)`.  Equality is also True where both
query and key are padding, so every pad query attends to all pad keys (real queries are fine).
The pad hidden states differ from what a padding mask should give, and the compute is wasted.
Fix (issue): `seq_id[:, None, :, None] & seq_id[:, None, None, :]` — a pad query sees nothing
(SDPA returns zeros for a fully masked row) and a pad key is seen by no one.

Reproduction: a 2-layer ESMC-style stack (LayerNorm+QKV, q/k LayerNorm, rotary, SDPA with a bool
mask, SwiGLU FFN, residual scaling) on a batch of 2 sequences of lengths 8 and 5, right-padded.
`einops.rearrange` is replaced by view/transpose.
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, q, k):
        # q, k: (B, L, H, D)
        t = torch.arange(q.shape[1], dtype=self.inv_freq.dtype)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, bias=False, qk_layernorm=True):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_head = self.d_model // self.n_heads
        self.layernorm_qkv = nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, d_model * 3, bias=bias))
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)
        if qk_layernorm:
            self.q_ln = nn.LayerNorm(d_model, bias=bias)
            self.k_ln = nn.LayerNorm(d_model, bias=bias)
        else:
            self.q_ln = nn.Identity()
            self.k_ln = nn.Identity()
        self.rotary = RotaryEmbedding(d_model // n_heads)

    def _apply_rotary(self, q, k):
        q = q.unflatten(-1, (self.n_heads, self.d_head))
        k = k.unflatten(-1, (self.n_heads, self.d_head))
        q, k = self.rotary(q, k)
        return q.flatten(-2, -1), k.flatten(-2, -1)

    def forward(self, x, seq_id):
        qkv_BLD3 = self.layernorm_qkv(x)
        query_BLD, key_BLD, value_BLD = torch.chunk(qkv_BLD3, 3, dim=-1)
        query_BLD, key_BLD = self.q_ln(query_BLD).to(query_BLD.dtype), self.k_ln(key_BLD).to(query_BLD.dtype)
        query_BLD, key_BLD = self._apply_rotary(query_BLD, key_BLD)

        def reshaper(t):  # "b s (h d) -> b h s d"
            return t.unflatten(-1, (self.n_heads, self.d_head)).transpose(1, 2)

        query_BHLD, key_BHLD, value_BHLD = map(reshaper, (query_BLD, key_BLD, value_BLD))

        if seq_id is not None:
            # Where True, enable participation in attention.
            if FIXED:
                mask_BHLL = seq_id[:, None, :, None] & seq_id[:, None, None, :]
            else:
                mask_BLL = seq_id.unsqueeze(-1) == seq_id.unsqueeze(-2)
                mask_BHLL = mask_BLL.unsqueeze(1)
            context_BHLD = F.scaled_dot_product_attention(query_BHLD, key_BHLD, value_BHLD, mask_BHLL)
        else:
            context_BHLD = F.scaled_dot_product_attention(query_BHLD, key_BHLD, value_BHLD)

        context_BLD = context_BHLD.transpose(1, 2).flatten(-2, -1)  # "b h s d -> b s (h d)"
        return self.out_proj(context_BLD)


class SwiGLU(nn.Module):
    def forward(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        return F.silu(x1) * x2


def swiglu_ln_ffn(d_model, expansion_ratio, bias):
    hidden = int(((expansion_ratio * d_model) + 255) // 256 * 256)
    return nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, hidden * 2, bias=bias), SwiGLU(),
                         nn.Linear(hidden, d_model, bias=bias))


class UnifiedTransformerBlock(nn.Module):
    def __init__(self, d_model, n_heads, bias=False, expansion_ratio=8 / 3, residue_scaling_factor=1.0,
                 qk_layernorm=True):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, n_heads, bias, qk_layernorm=qk_layernorm)
        self.ffn = swiglu_ln_ffn(d_model, expansion_ratio, bias)
        self.scaling_factor = residue_scaling_factor

    def forward(self, x, sequence_id):
        r1 = self.attn(x, sequence_id)
        x = x + r1 / self.scaling_factor
        r3 = self.ffn(x) / self.scaling_factor
        return x + r3


class TransformerStack(nn.Module):
    def __init__(self, d_model, n_heads, n_layers):
        super().__init__()
        self.blocks = nn.ModuleList([
            UnifiedTransformerBlock(d_model, n_heads, residue_scaling_factor=math.sqrt(n_layers / 36))
            for _ in range(n_layers)
        ])
        self.norm = nn.LayerNorm(d_model, bias=False)

    def forward(self, x, sequence_id=None):
        for block in self.blocks:
            x = block(x, sequence_id)
        return self.norm(x), x


class ESMC(nn.Module):
    pad_token_id = 1

    def __init__(self, d_model, n_heads, n_layers, vocab_size=64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.transformer = TransformerStack(d_model, n_heads, n_layers)
        self.sequence_head = nn.Linear(d_model, vocab_size)

    def forward(self, sequence_tokens, sequence_id=None):
        if sequence_id is None:
            sequence_id = sequence_tokens != self.pad_token_id
        x = self.embed(sequence_tokens)
        x, _ = self.transformer(x, sequence_id=sequence_id)
        return self.sequence_head(x), x


if __name__ == "__main__":
    torch.manual_seed(0)
    model = ESMC(d_model=64, n_heads=4, n_layers=2).eval()
    tokens = torch.tensor([[0, 5, 9, 12, 7, 20, 6, 2], [0, 8, 13, 4, 2, 1, 1, 1]])
    with torch.no_grad():
        logits, embeddings = model(tokens)
    pad = tokens == ESMC.pad_token_id
    print(f"pad embedding norm {embeddings[pad].norm().item():.4f}, residue logits sum "
          f"{logits[~pad].sum().item():.4f}")
