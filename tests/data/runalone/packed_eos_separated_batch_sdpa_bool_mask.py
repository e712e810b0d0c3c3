# Written another way (praxis#38's kind, helper fix-cd): a nanoGPT-style decoder whose config dataclass states its
# eos id; a collator packs documents into rows separated by EOS and right-pads the shorter row (attention_mask 0),
# and the block hands SDPA a bool mask of causal AND key padding only, so a document sees the one before it. The
# program checks packing by running document B alone. Fixed: the mask is also same-document (EOS ends a document).
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class GPTConfig:
    vocab_size: int = 50
    n_embd: int = 32
    n_head: int = 4
    n_layer: int = 2
    eos_token_id: int = 1


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x, attn_mask):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(CausalSelfAttention(config) for _ in range(config.n_layer))

    def forward(self, idx, attention_mask):
        T = idx.size(1)
        keep = torch.ones(T, T, dtype=torch.bool).tril()[None] & attention_mask.bool()[:, None, :]
        if FIXED:  # each EOS ends its document: a token's document is the EOS count before it
            ends = (idx == self.config.eos_token_id).long()
            doc = ends.cumsum(-1) - ends
            keep = keep & (doc[:, :, None] == doc[:, None, :])
        keep = keep | torch.eye(T, dtype=torch.bool)[None]  # (a padding row sees itself)
        x = self.wte(idx)
        for block in self.h:
            x = x + block(x, keep[:, None])
        return x


config = GPTConfig()
model = GPT(config).eval()
EOS = config.eos_token_id
doc_a, doc_b, doc_c = [5, 6, 7, EOS], [11, 12, 13, 14, EOS], [21, 22, EOS]
rows = [doc_a + doc_b, doc_c + [0] * 6]
idx = torch.tensor(rows)
attention_mask = torch.tensor([[1] * 9, [1] * 3 + [0] * 6])
with torch.no_grad():
    packed = model(idx, attention_mask)
    alone = model(torch.tensor([doc_b]), torch.ones(1, len(doc_b), dtype=torch.long))
diff = (packed[0, 4:9] - alone[0]).abs().max().item()
print(f"fixed={FIXED} document B packed vs. alone: max diff {diff:.4f}")
