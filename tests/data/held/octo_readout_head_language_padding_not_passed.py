# The starVLA#315 bug written another way: an Octo-style policy whose diffusion action head cross-attends, with
# nn.MultiheadAttention, from its action tokens to per-token language features. The prompts are LEFT-padded
# (the tokenizer's padding_side="left"), the observation dict carries `language_attention_mask` (1 = real), and
# the head's cross-attention is never handed it, so the padded prompt's action tokens attend
# its pad tokens at every denoising step; the fix passes key_padding_mask (True = padding) from the same entry.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
D, HEADS, VOCAB, PAD, CHUNK, ACT = 24, 3, 40, 0, 4, 7


def tokenize(prompts):
    """padding_side="left": each prompt ends at the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD)
    keep = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p)
        keep[row, width - len(p):] = 1
    return {"language_ids": ids, "language_attention_mask": keep}


class LanguageEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.mlp = nn.Sequential(nn.LayerNorm(D), nn.Linear(D, D), nn.GELU(), nn.Linear(D, D))

    def forward(self, ids):
        return self.mlp(self.embed(ids))  # per-token features (a frozen lookup's), no attention of their own


class DiffusionActionHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(ACT + 1, D)
        self.cross = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.out = nn.Linear(D, ACT)

    def denoise(self, noisy, t, language, language_padding=None):
        x = self.inp(torch.cat([noisy, t.expand(*noisy.shape[:2], 1)], dim=-1))
        attended, _ = self.cross(x, language, language, key_padding_mask=language_padding, need_weights=False)
        return self.out(x + attended)


class OctoPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.language = LanguageEncoder()
        self.head = DiffusionActionHead()

    @torch.no_grad()
    def sample_actions(self, observation, noise, steps=3):
        tokens = self.language(observation["language_ids"])
        padding = (observation["language_attention_mask"] == 0) if FIXED else None
        actions = noise
        for step in range(steps):
            t = torch.full((1, 1, 1), 1.0 - step / steps)
            actions = actions - self.head.denoise(actions, t, tokens, padding) / steps
        return actions


policy = OctoPolicy().eval()
prompts = [[5, 9, 13, 2, 8, 31, 7], [11, 4, 6]]
noise = torch.randn(2, CHUNK, ACT)
batched = policy.sample_actions(tokenize(prompts), noise)
alone = policy.sample_actions(tokenize(prompts[1:]), noise[1:])
print(f"max |batched - alone| for the left-padded prompt: {(batched[1] - alone[0]).abs().max().item():.6f}")
