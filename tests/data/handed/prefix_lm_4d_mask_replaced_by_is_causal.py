"""A GLM / PaliGemma-style prefix LM trained from a collator that builds each row's 4-D mask, right-padded batch.

The collator builds a (B, 1, L, L) bool mask, True = attend: each row's prefix (its prompt, `prefix_lens`) seen both
ways, the rest causal, padding hidden. Buggy: the model's attention reads only a 2-D padding mask and otherwise calls
`F.scaled_dot_product_attention(..., is_causal=True)`, so the 4-D mask the model was handed is dropped and the prompt
attends causally. Fixed (`--fixed`): a 4-D mask is handed to SDPA as its attn_mask.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


def collate(samples, prefix_lens):
    length = max(len(s) for s in samples)
    input_ids = torch.full((len(samples), length), PAD)
    mask = torch.zeros(len(samples), 1, length, length, dtype=torch.bool)
    for i, (s, p) in enumerate(zip(samples, prefix_lens)):
        n = len(s)
        input_ids[i, :n] = torch.tensor(s)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        causal[:p, :p] = True
        mask[i, 0, :n, :n] = causal
        mask[i, 0, n:, n:] = torch.eye(length - n, dtype=torch.bool)  # (a padding query sees itself: no NaN)
    return {"input_ids": input_ids, "attention_mask": mask}


class SelfAttention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x, attention_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if attention_mask.dim() == 2:
            pad = attention_mask[:, None, None, :].bool()
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=pad & torch.ones(n, n, dtype=torch.bool).tril())
        elif FIXED:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.proj(y.transpose(1, 2).reshape(b, n, d))


class PrefixLM(nn.Module):
    def __init__(self, vocab=50, d=32, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=PAD)
        self.blocks = nn.ModuleList([SelfAttention(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, attention_mask)
        return self.head(x)


batch = collate([[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]], prefix_lens=[4, 3])
model = PrefixLM().eval()
with torch.no_grad():
    logits = model(**batch)
print(f"fixed={FIXED} logits[0, 0, :3] = {[round(v, 4) for v in logits[0, 0, :3].tolist()]}")
