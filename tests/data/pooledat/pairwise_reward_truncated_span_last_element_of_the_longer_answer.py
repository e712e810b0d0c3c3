"""A pairwise reward model's end scores read off a truncated span ending at the longer answer's end (right-padded).

A hand-written GPT (its forward turns the (B, L) attention_mask into BERT's additive (1 - mask) * -10000) under a
value head scores chosen and rejected answers in two calls. For each pair, the loss compares the two value rows over
`[divergence, end)`, where `end` is the later of the two answers' first pad, and the end score is the last element of
that truncated span: a pad slot for the shorter answer of the pair (DeepSpeed-Chat's RewardModel wrote it so).
--fixed reads each answer at its own last token. Self-check of the fix: each end score matches the answer run alone.
"""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, H, V, PAD = 16, 2, 30, 0


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.proj = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)

    def forward(self, x, bias):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias
        return x + self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, D))


class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.pos = torch.nn.Embedding(V, D), torch.nn.Embedding(32, D)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))

    def forward(self, input_ids, attention_mask=None):
        n = input_ids.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keep = causal[None, None] if attention_mask is None else causal[None, None] & attention_mask[:, None, None, :].bool()
        bias = (1.0 - keep.float()) * -10000.0
        x = self.emb(input_ids) + self.pos(torch.arange(n))
        for block in self.blocks:
            x = block(x, bias)
        return x


class RewardModel(torch.nn.Module):
    """DeepSpeed-Chat's: the transformer's hidden states through a value head, one value per token."""

    def __init__(self):
        super().__init__()
        self.rwtransformer, self.v_head = GPT(), torch.nn.Linear(D, 1)

    def forward(self, input_ids, attention_mask=None):
        return self.v_head(self.rwtransformer(input_ids, attention_mask=attention_mask)).squeeze(-1)


model = RewardModel().eval()
prompt = [3, 4, 5]
chosen = [prompt + a for a in ([6, 7, 8, 9], [10, 11], [12, 13, 14])]
rejected = [prompt + a for a in ([15, 16], [17, 18, 19, 20, 21], [22, 23, 24])]
width = max(len(s) for s in chosen + rejected)


def batch(seqs):
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    return ids, (ids != PAD).long()


with torch.no_grad():
    c_ids, c_mask = batch(chosen)
    r_ids, r_mask = batch(rejected)
    c_values, r_values = model(c_ids, attention_mask=c_mask), model(r_ids, attention_mask=r_mask)
    scores, loss = [], 0.0
    for i in range(len(chosen)):
        c_end, r_end = len(chosen[i]), len(rejected[i])
        end = max(c_end, r_end)
        divergence = len(prompt)
        c_span, r_span = c_values[i][divergence:end], r_values[i][divergence:end]
        loss += -torch.nn.functional.logsigmoid(c_span - r_span).mean()
        scores.append((c_values[i][c_end - 1], r_values[i][r_end - 1]) if FIXED else (c_span[-1], r_span[-1]))
    alone = [(model(torch.tensor([c]))[0, -1], model(torch.tensor([r]))[0, -1]) for c, r in zip(chosen, rejected)]
print("end scores match each answer alone:",
      all(torch.allclose(a, b, atol=1e-5) for pair, want in zip(scores, alone) for a, b in zip(pair, want)))
