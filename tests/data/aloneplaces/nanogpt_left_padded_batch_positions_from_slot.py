# Written another way: the bug of CarperAI/trlx#509 (a left-padded batch scored with positions counted from each
# row's first slot) in a nanoGPT-style model of the program's own (`transformer.wpe`, F.scaled_dot_product_attention
# with a boolean mask) that scores prompts of different lengths for a best-of-n sampler. Bug: `pos = arange(T)` for
# every row; the fix counts each row's positions from its first real token (`attention_mask.cumsum(-1) - 1`).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
PAD, N_EMBD, N_HEAD, BLOCK = 0, 32, 4, 32


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(N_EMBD), nn.LayerNorm(N_EMBD)
        self.c_attn, self.c_proj = nn.Linear(N_EMBD, 3 * N_EMBD), nn.Linear(N_EMBD, N_EMBD)
        self.mlp = nn.Sequential(nn.Linear(N_EMBD, 4 * N_EMBD), nn.GELU(), nn.Linear(4 * N_EMBD, N_EMBD))

    def forward(self, x, allowed):
        B, T, C = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        x = x + self.c_proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(vocab, N_EMBD), wpe=nn.Embedding(BLOCK, N_EMBD),
                                              h=nn.ModuleList([Block() for _ in range(2)]), ln_f=nn.LayerNorm(N_EMBD)))
        self.lm_head = nn.Linear(N_EMBD, vocab, bias=False)

    def forward(self, idx, attention_mask=None):
        B, T = idx.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(idx)
        if FIXED:
            pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        else:
            pos = torch.arange(T)
        real = attention_mask.bool()
        allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None] & real[:, None, :]
        allowed = allowed | torch.eye(T, dtype=torch.bool)[None]  # (a pad query sees itself: no empty row)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x, allowed)
        return self.lm_head(self.transformer.ln_f(x))


torch.manual_seed(0)
model = GPT().eval()
candidates = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
width = max(map(len, candidates))
idx = torch.tensor([[PAD] * (width - len(c)) + c for c in candidates])
mask = (torch.arange(width)[None] >= torch.tensor([width - len(c) for c in candidates])[:, None]).long()
with torch.no_grad():
    logits = model(idx, attention_mask=mask)
    scores = F.log_softmax(logits[:, :-1], -1).gather(-1, idx[:, 1:, None])[..., 0] * mask[:, 1:]
    alone = [model(torch.tensor([c])) for c in candidates]  # each candidate scored by itself
    worst = max((logits[i, width - len(c):] - alone[i][0]).abs().max().item() for i, c in enumerate(candidates))
print("candidate scores:", [round(s, 4) for s in scores.sum(-1).tolist()])
print(f"max |batched logits - each candidate alone|: {worst:.3e}")
