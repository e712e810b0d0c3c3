"""EOS-packed training rows through a minGPT-style softmax: the document boundary taken from each row's first EOS
only (a `break` after it), so the third document of a row sees the second (--fixed: every EOS)."""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class GPTConfig:
    vocab_size: int = 16
    n_embd: int = 8
    eos_token_id: int = 2


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.key, self.query = nn.Linear(config.n_embd, config.n_embd), nn.Linear(config.n_embd, config.n_embd)

    def forward(self, idx):
        b, t = idx.shape
        doc = torch.zeros(b, t, dtype=torch.long)
        for row in range(b):  # (per row, not per token: a row's EOS positions)
            for end in (idx[row] == self.config.eos_token_id).nonzero().flatten().tolist():
                doc[row, end + 1:] += 1
                if not FIXED:
                    break
        x = self.wte(idx)
        att = self.query(x) @ self.key(x).transpose(1, 2) / 8 ** 0.5
        allowed = torch.ones(t, t, dtype=torch.bool).tril() & (doc[:, :, None] == doc[:, None, :])
        att = att.masked_fill(~allowed, float("-inf"))
        return att.softmax(-1) @ x


torch.manual_seed(0)
GPT(GPTConfig())(torch.tensor([[5, 2, 6, 7, 2, 8, 9, 10], [3, 4, 5, 2, 6, 2, 7, 8]]))
