# A small GPT-style decoder trained on packed rows (nanoGPT's attention, SDPA): alone, each sequence goes through
# is_causal=True; packed, the model builds a document mask from the position_ids and hands it as attn_mask, but
# forgets the causal part, so inside each packed document a token sees the tokens after it. Fixed: the document
# mask ANDed with the lower triangle.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=32, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x, doc_mask=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if doc_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=doc_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPT(nn.Module):
    def __init__(self, vocab=64, n_embd=32, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(32, n_embd)
        self.h = nn.ModuleList([CausalSelfAttention(n_embd) for _ in range(n_layer)])
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, position_ids):
        doc_mask = None
        if (position_ids[:, 1:] == 0).any():  # packed documents: position_ids restart at 0
            doc = torch.cumsum((position_ids == 0).long(), dim=1)
            doc_mask = (doc[:, :, None] == doc[:, None, :])[:, None]
            if FIXED:
                T = idx.shape[1]
                doc_mask = doc_mask & torch.tril(torch.ones(T, T, dtype=torch.bool))
        x = self.wte(idx) + self.wpe(position_ids)
        for block in self.h:
            x = x + block(x, doc_mask)
        return self.lm_head(x)


lengths = (5, 6)
docs = [torch.randint(0, 64, (n,)) for n in lengths]
packed = torch.cat(docs)[None]
position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
model = GPT().eval()
with torch.no_grad():
    logits = model(packed, position_ids)
    alone = torch.cat([model(d[None], torch.arange(len(d))[None])[0] for d in docs])
print(f"fixed={FIXED} packed vs each document alone, max |logit diff| = {(logits[0] - alone).abs().max().item():.4f}")
