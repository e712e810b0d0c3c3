# A robot policy that joins [2 register tokens | a left-padded instruction | 1 state token] and runs
# nn.MultiheadAttention over it with a key_padding_mask. The instruction's pad mask (ids == self.pad_token_id) must be
# padded out to the joined length at the instruction's place; the bug pads it with the registers' and the state's
# columns on the wrong sides (all three on the left), so the mask lands one key late: a real instruction token is
# hidden and the last pad token (before the state) is attended. The fix pads (registers, state) on their own sides.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)

    def forward(self, x, key_padding_mask):
        h = self.norm(x)
        out, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)
        return x + out


class Policy(nn.Module):
    def __init__(self, vocab=40, d=16, n_registers=2):
        super().__init__()
        self.pad_token_id = 0
        self.n_registers = n_registers
        self.embed_tokens = nn.Embedding(vocab, d)
        self.registers = nn.Parameter(torch.randn(n_registers, d))
        self.state_proj = nn.Linear(5, d)
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, 3)

    def forward(self, input_ids, state):
        b = input_ids.shape[0]
        text = self.embed_tokens(input_ids)
        x = torch.cat([self.registers.expand(b, -1, -1), text, self.state_proj(state)[:, None]], dim=1)
        text_pad = input_ids == self.pad_token_id                 # True = padding (left)
        if FIXED:
            key_padding_mask = F.pad(text_pad, (self.n_registers, 1), value=False)
        else:
            key_padding_mask = F.pad(text_pad, (self.n_registers + 1, 0), value=False)
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return self.head(x[:, -1])


prompts = [[5, 17, 9, 30, 12], [22, 7, 3], [11, 8, 25, 6]]
width = max(len(p) for p in prompts)
input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left-padded with pad id 0
state = torch.randn(3, 5)
model = Policy().eval()
with torch.no_grad():
    batched = model(input_ids, state)
    alone = model(torch.tensor([prompts[1]]), state[1:2])
print(f"max |row 1 batched - alone| = {(batched[1] - alone[0]).abs().max():.3e}")
