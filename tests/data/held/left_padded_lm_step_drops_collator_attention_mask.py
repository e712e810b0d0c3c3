# The bug of perceiver-io 6b2a825 (PR #25) written another way: a decoder-only LM on SDPA (is_causal=True) whose
# collator left-pads a batch dict {"input_ids", "attention_mask", "labels"}, but whose training step calls
# `model(batch["input_ids"])`: the attention_mask never reaches the model, so every real token attends to the left
# padding before it and positions count from the pad start. --fixed: the step hands the mask on; the model ands it
# into the causal mask and numbers each row's positions from its first real token.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x, attention_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keep = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
            keep = keep | torch.eye(T, dtype=torch.bool)  # (a padding query sees itself: no row without keys)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(y.transpose(1, 2).reshape(B, T, C))


class TinyLM(nn.Module):
    def __init__(self, vocab=40, width=32, heads=4, layers=2):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(32, width)
        self.attn = nn.ModuleList(CausalSelfAttention(width, heads) for _ in range(layers))
        self.norm = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None):
        if attention_mask is None:
            positions = torch.arange(input_ids.shape[1])[None]
        else:
            positions = (attention_mask.cumsum(-1) - 1).clamp_min(0)
        x = self.tok(input_ids) + self.pos(positions)
        for attn, norm in zip(self.attn, self.norm):
            x = x + attn(norm(x), attention_mask)
        return self.head(x)


def collate(samples):
    longest = max(len(s) for s in samples)
    ids = torch.full((len(samples), longest), PAD)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, longest - len(s):] = torch.tensor(s)
        mask[i, longest - len(s):] = 1
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def training_step(model, batch):
    if FIXED:
        logits = model(batch["input_ids"], attention_mask=batch["attention_mask"])
    else:
        logits = model(batch["input_ids"])
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())


if __name__ == "__main__":
    model = TinyLM()
    g = torch.Generator().manual_seed(3)
    samples = [torch.randint(1, 40, (n,), generator=g).tolist() for n in (6, 10, 8)]
    batch = collate(samples)
    loss = training_step(model, batch)
    loss.backward()
    print(f"loss {loss.item():.4f}")
