"""A gpt-fast style static cache prefilled in chunks of 4: each chunk's keys are written at `current_pos`, and the
attention mask rows for the chunk are sliced from the model's causal buffer. Buggy: every chunk takes rows [:4]
and position ids 0..3, so the second and third chunks miss their own keys and the earlier ones; fixed:
rows [current_pos:current_pos + 4]. Written after Anemll/Anemll#17 in another style (a bool mask filled into the scores,
a batch of two prompts, one decode step after the prefill)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DIM, HEADS, MAX_LEN, CHUNK, VOCAB = 16, 2, 16, 4, 30
HEAD_DIM = DIM // HEADS


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.wo = nn.Linear(DIM, DIM, bias=False)
        # (a buffer kept from the previous request: its slots hold that request's stale keys until overwritten)
        self.register_buffer("k_cache", torch.randn(2, HEADS, MAX_LEN, HEAD_DIM))
        self.register_buffer("v_cache", torch.randn(2, HEADS, MAX_LEN, HEAD_DIM))

    def forward(self, x, current_pos, mask):
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).view(b, n, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        self.k_cache[:, :, current_pos:current_pos + n] = k
        self.v_cache[:, :, current_pos:current_pos + n] = v
        scores = q @ self.k_cache.transpose(-1, -2) / HEAD_DIM ** 0.5
        y = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ self.v_cache
        return self.wo(y.transpose(1, 2).reshape(b, n, DIM))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAX_LEN, DIM)
        self.layers = nn.ModuleList([Attention() for _ in range(2)])
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("causal", torch.ones(MAX_LEN, MAX_LEN, dtype=torch.bool).tril()[None, None])

    def forward(self, idx, position_ids, current_pos, mask):
        x = self.tok(idx) + self.pos(position_ids)
        for layer in self.layers:
            x = x + layer(x, current_pos, mask)
        return self.out(x)


model = Transformer().eval()
prompt = torch.randint(0, VOCAB, (2, 12))
with torch.no_grad():
    for current_pos in range(0, prompt.shape[1], CHUNK):
        start = current_pos if FIXED else 0  # (buggy: the positions and the mask rows of every chunk start at 0)
        position_ids = torch.arange(start, start + CHUNK)[None].expand(2, -1)
        logits = model(prompt[:, current_pos:current_pos + CHUNK], position_ids, current_pos,
                       model.causal[:, :, start:start + CHUNK])
    nxt = logits[:, -1].argmax(-1, keepdim=True)
    pos = prompt.shape[1]
    model(nxt, torch.full((2, 1), pos), pos, model.causal[:, :, pos:pos + 1])
