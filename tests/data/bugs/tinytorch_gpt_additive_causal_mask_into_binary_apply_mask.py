"""TinyTorch (cs249r_book) GPT: an additive -inf causal mask fed to an attention that expects a 0/1 keep-mask.

Citation: harvard-edge/cs249r_book#1785, "fix(tinytorch): fix GPT causal mask convention in module 13" (merged).
``GPT._create_causal_mask`` in 13_transformers.py built an additive mask (-inf above the diagonal, 0 on and
below it), but ``_apply_mask`` in 12_attention.py expects a binary lower-triangular mask (1 = attend, 0 = block)
and adds ``(1 - mask) * MASK_VALUE``. Every allowed position (value 0) therefore got -1e9, the future ones got
-inf: the mask the attention applies blocks every past and present key too, and in float32 the -1e9 swamps
the scores so the weights over the past collapse to a uniform average. The fix builds
``np.tril(np.ones((seq_len, seq_len)))`` so the convention matches.

TinyTorch is numpy with its own autograd Tensor; this is a torch port of the two modules as the PR describes
them (Embedding + Pre-LN blocks + MultiHeadAttention calling scaled_dot_product_attention with the GPT's mask).
I read the PR description, not its diff line by line.
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

MASK_VALUE = -1e9  # large negative added to blocked scores (12_attention)


# ---- 12_attention -------------------------------------------------------------------------------------
def _apply_mask(scores, mask):
    """Block positions where mask == 0 (mask convention: 1 = allow, 0 = block)."""
    return scores + (1 - mask) * MASK_VALUE


def scaled_dot_product_attention(Q, K, V, mask=None):
    d_k = Q.shape[-1]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(d_k)
    if mask is not None:
        scores = _apply_mask(scores, mask)
    attention_weights = torch.softmax(scores, dim=-1)
    output = attention_weights @ V
    return output, attention_weights


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x, mask=None):
        batch_size, seq_len, _ = x.shape
        Q = self.q_proj(x).reshape(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        K = self.k_proj(x).reshape(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        V = self.v_proj(x).reshape(batch_size, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        attended, _ = scaled_dot_product_attention(Q, K, V, mask)
        attended = attended.transpose(1, 2).reshape(batch_size, seq_len, self.embed_dim)
        return self.out_proj(attended)


# ---- 13_transformers ----------------------------------------------------------------------------------
class TransformerBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, mlp_ratio=4):
        super().__init__()
        self.attention = MultiHeadAttention(embed_dim, num_heads)
        self.ln1 = nn.LayerNorm(embed_dim)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, mlp_ratio * embed_dim), nn.GELU(),
                                 nn.Linear(mlp_ratio * embed_dim, embed_dim))

    def forward(self, x, mask=None):
        x = x + self.attention(self.ln1(x), mask)
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, embed_dim, num_layers, num_heads, max_seq_len=64):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, embed_dim)
        self.position_embedding = nn.Embedding(max_seq_len, embed_dim)
        self.blocks = nn.ModuleList([TransformerBlock(embed_dim, num_heads) for _ in range(num_layers)])
        self.ln_f = nn.LayerNorm(embed_dim)
        self.lm_head = nn.Linear(embed_dim, vocab_size)

    def _create_causal_mask(self, seq_len):
        """Causal mask so position i only sees positions <= i."""
        if FIXED:
            return torch.tril(torch.ones(seq_len, seq_len))
        # additive form: -inf above the diagonal, 0 elsewhere
        return torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)

    def forward(self, tokens):
        batch_size, seq_len = tokens.shape
        positions = torch.arange(seq_len).unsqueeze(0).expand(batch_size, seq_len)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        mask = self._create_causal_mask(seq_len)
        for block in self.blocks:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))

    def generate(self, prompt_tokens, max_new_tokens=3):
        current = prompt_tokens
        for _ in range(max_new_tokens):
            logits = self.forward(current)
            next_token = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            current = torch.cat([current, next_token], dim=1)
        return current


def main():
    torch.manual_seed(7)
    model = GPT(vocab_size=50, embed_dim=32, num_layers=2, num_heads=4).eval()
    prompt = torch.tensor([[3, 14, 15, 9, 26, 5]])
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=3)
        logits = model(prompt)
    print("generated", out[0, prompt.shape[1]:].tolist(), "last logits", [round(v, 3) for v in logits[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
