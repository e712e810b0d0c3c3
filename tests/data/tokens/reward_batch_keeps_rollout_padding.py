# A reward-scoring batch built from rollouts that were generated to a fixed length: a sample that finished early keeps
# the pad ids generation filled it with, and the collator marks real every token it was handed (right-padding the
# shorter rows with the same pad id, marked 0). The reward is read at each row's last real token, so the reward of
# the finished sample is read on a pad. A hand-written causal model (SDPA, bool mask), its pad id a module attribute.
# Fixed: each rollout cut after its EOS before collating.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(4)


class RewardModel(nn.Module):
    def __init__(self, vocab=40, dim=32, heads=4):
        super().__init__()
        self.pad_token_id, self.eos_token_id, self.heads = 0, 2, heads
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Embedding(32, dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.score = nn.Linear(dim, 1)

    def forward(self, input_ids, attention_mask):
        B, T = input_ids.shape
        x = self.emb(input_ids) + self.pos(torch.arange(T))[None]
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + self.out(h.transpose(1, 2).reshape(B, T, -1))
        last = attention_mask.sum(-1) - 1
        return self.score(x).squeeze(-1)[torch.arange(B), last]


def rollout_to_length(prompt, generated, length, pad):
    return prompt + generated + [pad] * (length - len(generated))


def collate(samples, pad):
    width = max(map(len, samples))
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in samples])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in samples])
    return ids, mask


model = RewardModel().eval()
prompts = [[5, 6, 7, 8], [9, 10]]
generated = [[11, 12, 2], [13, 14, 15, 16, 2]]  # the first finished after 3 tokens (EOS 2)
samples = [rollout_to_length(p, g, 6, model.pad_token_id) for p, g in zip(prompts, generated)]
if FIXED:
    samples = [s[: s.index(model.eos_token_id) + 1] for s in samples]
ids, mask = collate(samples, model.pad_token_id)
with torch.no_grad():
    rewards = model(ids, mask)
    alone = torch.tensor([prompts[0] + generated[0]])
    ref = model(alone, torch.ones_like(alone))
print(f"fixed={FIXED} attention_mask={mask.tolist()}")
print(f"reward of sample 0 = {rewards[0].item():.4f}, scored alone = {ref[0].item():.4f}")
