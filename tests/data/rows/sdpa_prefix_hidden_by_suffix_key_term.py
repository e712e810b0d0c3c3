# The pi0 prefix / action mask written another way: an openpi-style PyTorch policy whose attention is SDPA over
# separate q, k, v projections, the language tokens left-padded and `input_mask` (1 = real) over the whole sequence
# [image patches | prompt | action chunk]. The buggy mask ANDs "key is an action" into the padded causal mask, so no
# query sees the image or the prompt (their rows see nothing at all) and the actions see only earlier actions; the fix
# lets every real query see the real prefix causally and the actions see each other both ways.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def make_attention_mask(input_mask, prefix_len):
    n = input_mask.shape[1]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    causal = j <= i
    key_real = input_mask[:, None, :].bool()
    if FIXED:
        actions = (i >= prefix_len) & (j >= prefix_len)
        return (key_real & causal) | actions[None]
    return key_real & causal & (j >= prefix_len)[None]


class Block(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = (proj(x).view(b, n, self.heads, -1).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
        return x + self.o(out.transpose(1, 2).reshape(b, n, d))


class Policy(nn.Module):
    def __init__(self, dim=16, vocab=32, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.action_in = nn.Linear(3, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))

    def forward(self, patches, prompt_ids, prompt_mask, actions):
        x = torch.cat([patches, self.embed(prompt_ids), self.action_in(actions)], dim=1)
        prefix_len = patches.shape[1] + prompt_ids.shape[1]
        input_mask = torch.cat([torch.ones(patches.shape[:2], dtype=torch.bool), prompt_mask.bool(),
                                torch.ones(actions.shape[:2], dtype=torch.bool)], dim=1)
        keep = make_attention_mask(input_mask, prefix_len)
        for block in self.blocks:
            x = block(x, keep)
        return x[:, prefix_len:]


policy = Policy().eval()
patches = torch.randn(2, 3, 16)
prompt_ids = torch.tensor([[0, 0, 4, 5, 6], [7, 8, 9, 10, 11]])  # left-padded prompts
prompt_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
actions = torch.randn(2, 4, 3)
with torch.no_grad():
    out = policy(patches, prompt_ids, prompt_mask, actions)
    other = policy(patches + 1.0, prompt_ids, prompt_mask, actions)
print(f"fixed={FIXED} action change when the image changes: {(out - other).abs().max().item():.4f}")
