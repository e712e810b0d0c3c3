# Correct: a GPT-style decoder whose every layer keeps its own (k, v) cache, in a beam search over two prompts of three
# beams each (six rows); after each top-k the cache of every layer is reordered with the beams (Hugging Face's
# `_reorder_cache`: index_select by beam_idx), so each row's cached keys are, in every layer, those of the hypothesis
# it continues. Eager softmax over q @ kᵀ. --fixed runs the same program.
import math

import torch
from torch import nn

VOCAB, DIM, HEADS, LAYERS, BEAMS, STEPS = 30, 32, 4, 3, 3, 6


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x, past):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(DIM, dim=-1)
        q, k, v = (z.view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for z in (q, k, v))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        att = q @ k.transpose(-2, -1) / math.sqrt(DIM // HEADS)
        if t > 1:
            causal = torch.ones(t, k.size(2), dtype=torch.bool).tril(k.size(2) - t)
            att = att.masked_fill(~causal, float("-inf"))
        y = (torch.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, DIM)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x)), (k, v)


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids, start, past=None):
        x = self.wte(ids) + self.wpe(torch.arange(start, start + ids.size(1)))
        present = []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, None if past is None else past[i])
            present.append(kv)
        return torch.log_softmax(self.head(x[:, -1]), dim=-1), present


def reorder_cache(past, beam_idx):
    return [tuple(t.index_select(0, beam_idx) for t in layer) for layer in past]


def main():
    torch.manual_seed(1)
    model = GPT().eval()
    prompts = torch.tensor([[3, 7, 11], [5, 2, 9]])
    ids = prompts.repeat_interleave(BEAMS, dim=0)  # (2 * BEAMS, 3)
    scores = torch.tensor([0.0] + [float("-inf")] * (BEAMS - 1)).repeat(2)
    with torch.no_grad():
        logp, past = model(ids, 0)
        for _ in range(STEPS):
            cand = (scores[:, None] + logp).view(2, -1)
            top, flat = cand.topk(BEAMS, dim=-1)
            beam_idx = (flat // VOCAB + torch.arange(2)[:, None] * BEAMS).view(-1)
            token = (flat % VOCAB).view(-1, 1)
            ids = torch.cat([ids[beam_idx], token], dim=1)
            scores = top.view(-1)
            past = reorder_cache(past, beam_idx)
            logp, past = model(token, ids.size(1) - 1, past)
    print(ids.tolist()[0], ids.tolist()[BEAMS])


if __name__ == "__main__":
    main()
