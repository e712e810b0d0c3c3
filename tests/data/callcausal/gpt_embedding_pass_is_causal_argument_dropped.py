"""A nanoGPT-style decoder reused as a bidirectional text embedder (`model(idx, attention_mask, is_causal=False)`),
over a left-padded batch, its attention a hand-written softmax. The blocks hand `is_causal` down, but the attention
builds its mask from its own `self.causal` flag (True), so the embedding pass that asked for both ways stays causal.
--fixed: the call's is_causal, where given, decides; the module's flag is only its default.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.causal = True

    def forward(self, x, pad, is_causal=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (k.size(-1) ** 0.5)
        keep = pad[:, None, None, :].bool()
        causal = self.causal if not FIXED or is_causal is None else is_causal
        if causal:
            keep = keep & torch.ones(T, T, dtype=torch.bool).tril()
        keep = keep | torch.eye(T, dtype=torch.bool)  # (a pad row keeps its own key: no NaN)
        att = F.softmax(att.masked_fill(~keep, float("-inf")), dim=-1)
        return self.c_proj((att @ v).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, pad, is_causal=None):
        x = x + self.attn(self.ln_1(x), pad, is_causal=is_causal)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=50, block_size=16, n_embd=24, n_head=3, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)

    def forward(self, idx, attention_mask, is_causal=None):
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # (left padding: each row's positions from its first token)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x, attention_mask, is_causal=is_causal)
        return self.ln_f(x)


def main():
    torch.manual_seed(0)
    model = GPT().eval()
    idx = torch.tensor([[0, 0, 0, 7, 8, 9, 10], [3, 4, 5, 6, 7, 8, 9]])
    attention_mask = (idx != 0).long()
    with torch.no_grad():
        hidden = model(idx, attention_mask, is_causal=False)
        emb = (hidden * attention_mask[..., None]).sum(1) / attention_mask.sum(1, keepdim=True)
    print("embeddings", tuple(emb.shape))


if __name__ == "__main__":
    main()
