# The chunked-prefill position bug of transformers#43132 (generate's chunks handed `cache_position` for their
# position_ids) written as a hand-rolled loop: a GPT-2-style model with a learned position table, an eager softmax,
# a KV cache grown by torch.cat, a left-padded batch prefilled in chunks of 4. Before the fix each chunk numbered its
# tokens by their cache slots (`arange(start, start + n)`, counting the padding), while the decode steps number from
# the attention mask (`attention_mask.sum(-1) - 1`); the fix numbers the chunks from the mask too
# (`cumsum(attention_mask) - 1`, sliced per chunk).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(5)
VOCAB, DIM, HEADS, CHUNK = 40, 32, 4, 4
HEAD_DIM = DIM // HEADS


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.wpe = nn.Embedding(64, DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids, attention_mask, past=None):
        b, t = input_ids.shape
        x = self.wte(input_ids) + self.wpe(position_ids)
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        total = k.shape[2]
        keep = torch.ones(t, total, dtype=torch.bool).tril(total - t)[None, None] \
            & attention_mask[:, None, None, :total].bool()
        scores = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
        out = scores.softmax(-1) @ v
        return self.head(self.proj(out.transpose(1, 2).reshape(b, t, DIM)) + x), (k, v)


model = TinyGPT().eval()
input_ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [0, 0, 0, 12, 13, 14, 15]])  # pad id 0, row 1 left-padded
attention_mask = (input_ids != 0).long()
with torch.no_grad():
    past, numbered = None, (attention_mask.cumsum(-1) - 1).clamp(min=0)
    for start in range(0, input_ids.shape[1], CHUNK):
        ids = input_ids[:, start:start + CHUNK]
        if FIXED:
            position_ids = numbered[:, start:start + ids.shape[1]]
        else:
            position_ids = torch.arange(start, start + ids.shape[1])[None].expand(2, -1)
        logits, past = model(ids, position_ids, attention_mask, past)
    tokens = logits[:, -1].argmax(-1, keepdim=True)
    generated = [tokens]
    for step in range(3):
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], -1)
        position_ids = attention_mask.sum(-1, keepdim=True) - 1
        logits, past = model(tokens, position_ids, attention_mask, past)
        tokens = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(tokens)
print("generated", torch.cat(generated, -1).tolist())
