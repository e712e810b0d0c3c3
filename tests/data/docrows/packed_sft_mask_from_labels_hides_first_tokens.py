# A packed SFT step written by hand: examples are packed into rows with position_ids restarting at 0 (and
# right-padded, attention_mask 0 there), and the 4-D mask is built as causal & same document & "trainable" keys and
# queries, where trainable is read from the shifted labels (-100 on each example's first token, which has no
# previous token to predict it). So each packed example's first token sees no key at all and its example never
# sees it: SDPA gives that row 0 and the rest of the example attends without its first token. Fixed: the padding
# comes from the attention_mask, not from the labels.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
IGNORE = -100


def packed_mask(position_ids, attention_mask, labels):
    doc = (position_ids == 0).cumsum(-1)
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = doc[:, :, None] == doc[:, None, :]
    live = attention_mask.bool() if FIXED else labels != IGNORE
    return (causal & same & live[:, None, :] & live[:, :, None])[:, None]


class Block(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(d, d) for _ in range(3))
        self.o_proj = nn.Linear(d, d)

    def forward(self, h, mask):
        b, t, d = h.shape
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return h + self.o_proj(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, d))


class PackedLM(nn.Module):
    def __init__(self, vocab=60, d=32):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Embedding(32, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, attention_mask, position_ids, labels):
        h = self.embed(input_ids) + self.pos(position_ids)
        mask = packed_mask(position_ids, attention_mask, labels)
        for block in self.blocks:
            h = block(h, mask)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE)


model = PackedLM()
# row 0 packs examples of 4 and 5 tokens; row 1 one of 6 and one of 3, no padding; row 0 padded to 9 with 0
input_ids = torch.tensor([[7, 8, 9, 10, 21, 22, 23, 24, 25], [31, 32, 33, 34, 35, 36, 41, 42, 43]])
position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 0, 1, 2]])
attention_mask = torch.ones_like(input_ids)
input_ids = torch.cat([input_ids, torch.tensor([[0, 0], [0, 0]])], 1)
position_ids = torch.cat([position_ids, torch.tensor([[0, 0], [0, 0]])], 1)
attention_mask = torch.cat([attention_mask, torch.tensor([[0, 0], [0, 0]])], 1)
labels = input_ids.clone()
labels[position_ids == 0] = IGNORE  # each example's first token predicts nothing
labels[attention_mask == 0] = IGNORE
loss = model(input_ids, attention_mask, position_ids, labels)
loss.backward()
print(f"fixed={FIXED} loss={loss.item():.4f}")
