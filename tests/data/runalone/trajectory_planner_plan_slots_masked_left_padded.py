# Written another way (the bug of Tsinghua-MARS-Lab/StateTransformer#93, in another project's style): a trajectory
# planner in the manner of Trajectory Transformer / a discretised decision transformer. Observations and actions are
# token ids, a batch of contexts is left-padded, PLAN placeholder tokens for the horizon follow each context, and a
# hand-written GPT attends by an explicit softmax over an additive mask (causal AND the attention_mask). Training runs
# the batch with the collator's mask (padding only); the buggy planner also zeroes the plan slots in the mask ("not
# observed yet"), so each plan slot's query sees neither itself nor the slots before it. Fixed: the collator's mask.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD, PLAN, VOCAB, HORIZON = 0, 1, 40, 4


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x, bias):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (c // self.heads) ** 0.5 + bias
        y = torch.softmax(scores, dim=-1) @ v
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class PlannerGPT(nn.Module):
    def __init__(self, width=32, heads=4, layers=2, max_len=32):
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, width), nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(width), nn.Linear(width, VOCAB)

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        x = self.tok(input_ids) + self.pos(positions)
        keep = torch.tril(torch.ones(t, t, dtype=torch.bool))[None] & attention_mask.bool()[:, None, :]
        bias = torch.zeros(b, 1, t, t).masked_fill(~keep[:, None], torch.finfo(torch.float32).min)
        for block in self.blocks:
            x = block(x, bias)
        return self.head(self.ln(x))


def collate(contexts):
    """Left-pad the contexts to one length and append HORIZON plan slots to each."""
    longest = max(len(c) for c in contexts)
    ids = torch.tensor([[PAD] * (longest - len(c)) + c + [PLAN] * HORIZON for c in contexts])
    return ids, (ids != PAD).long()


@torch.no_grad()
def plan(model, ids, mask):
    plan_mask = mask.clone()
    if not FIXED:
        plan_mask[:, -HORIZON:] = 0  # the plan slots are not observed yet
    logits = model(ids, attention_mask=plan_mask)
    return logits[:, -HORIZON - 1:-1].argmax(-1)


def main():
    model = PlannerGPT().eval()
    contexts = [[5, 17, 9, 23, 11, 30, 7], [12, 8, 25, 14, 6]]
    ids, mask = collate(contexts)
    with torch.no_grad():  # the training forward: teacher forcing over the whole row, the collator's mask
        train_logits = model(ids, attention_mask=mask)
    planned = plan(model, ids, mask)
    train_plan = train_logits[:, -HORIZON - 1:-1].argmax(-1)
    print("fixed" if FIXED else "buggy", "plan", planned.tolist(), "agrees with training",
          bool((planned == train_plan).all()))


if __name__ == "__main__":
    main()
