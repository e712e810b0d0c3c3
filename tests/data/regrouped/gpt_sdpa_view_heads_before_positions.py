# The same bug as Informer2020 7f8b80c (heads and positions regrouped by a view where a transpose was meant), written
# as a minGPT-style decoder writes its attention: separate q/k/v projections viewed straight to (B, nh, T, hs) from
# (B, T, C), then F.scaled_dot_product_attention over a left-padded batch with a causal + padding bool mask. Each head's
# T positions are then T / nh tokens cut into nh slices each, so the causal and padding mask orders slices, not tokens.
# The fix views (B, T, nh, hs) and transposes, as minGPT's CausalSelfAttention does.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_embd, n_embd)
        self.key = nn.Linear(n_embd, n_embd)
        self.value = nn.Linear(n_embd, n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        if FIXED:
            return x.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        return x.view(B, self.n_head, T, C // self.n_head)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.heads(self.query(x)), self.heads(self.key(x)), self.heads(self.value(x))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        allowed = causal[None, None] & attention_mask[:, None, None, :].bool()  # (B, 1, T, T): True = may attend
        allowed = allowed | torch.eye(T, dtype=torch.bool)  # (a padding row keeps its own key: no NaN)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 50, n_embd: int = 32, block: int = 16):
        super().__init__()
        self.tok = nn.Embedding(vocab, n_embd)
        self.pos = nn.Embedding(block, n_embd)
        self.attn = CausalSelfAttention(n_embd)
        self.head = nn.Linear(n_embd, vocab)

    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.tok(idx) + self.pos(positions)
        return self.head(x + self.attn(x, attention_mask))


model = TinyGPT().eval()
idx = torch.randint(1, 50, (2, 8))
attention_mask = torch.ones(2, 8, dtype=torch.long)
attention_mask[1, :3] = 0  # row 1 left-padded by 3
idx[1, :3] = 0
with torch.no_grad():
    logits = model(idx, attention_mask)
    changed = idx.clone()
    changed[:, -1] = (changed[:, -1] + 7) % 50  # only the last token changes
    later = model(changed, attention_mask)
print("logits before the last token move when it changes: max |diff| =",
      f"{(logits[:, :-1] - later[:, :-1]).abs().max().item():.6f}")
