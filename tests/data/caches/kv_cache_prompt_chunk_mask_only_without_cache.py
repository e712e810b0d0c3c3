# The slip of OpenNMT-py 628b4726 written another way: a nanoGPT-style model with its own per-layer KV cache builds
# its causal mask only while no cache is attached (`if kv_cache is None`: training and scoring), so a left-padded
# batch of prompts fed in one chunk once the cache is attached (generation) sees later prompt tokens; the padding mask
# still reaches it. The fix builds the causal part for every chunk of more than one token, behind the cache.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class KVCache:
    def __init__(self):
        self.k = self.v = None

    def update(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x, pad_keep, kv_cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        S = k.size(2)
        mask = pad_keep[:, None, None, :S]  # (B, 1, 1, S) real keys
        if kv_cache is None or (FIXED and T > 1):
            causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)  # bottom-right: behind the cache
            mask = mask & causal
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, pad_keep, kv_cache=None):
        x = x + self.attn(self.ln_1(x), pad_keep, kv_cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=50, n_embd=32, n_head=4, n_layer=2, block_size=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, attention_mask, caches=None):
        T = idx.size(1)
        seen = attention_mask.size(1) - T  # tokens already in the cache
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, seen:]
        x = self.wte(idx) + self.wpe(pos)
        keep = attention_mask.bool()
        for i, block in enumerate(self.h):
            x = block(x, keep, None if caches is None else caches[i])
        return self.lm_head(self.ln_f(x))


model = GPT().eval()
pad_id = 0
prompts = torch.tensor([[pad_id, pad_id, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])  # left-padded
attention_mask = (prompts != pad_id).long()

with torch.no_grad():
    scored = model(prompts, attention_mask)  # scoring pass, no cache: causal
    caches = [KVCache() for _ in model.h]
    logits = model(prompts, attention_mask, caches)  # the prompt chunk, behind the (empty) cache
    real = attention_mask.bool()
    diff = (logits - scored)[real].abs().max().item()
    out = [logits[:, -1].argmax(-1, keepdim=True)]
    for _ in range(3):
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        logits = model(out[-1], attention_mask, caches)
        out.append(logits[:, -1].argmax(-1, keepdim=True))

print(f"max |cached prompt chunk - scoring pass| over real tokens = {diff:.6f}")
