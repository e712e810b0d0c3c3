# The draft-tree verify bug of mlxcel#1214 written as a Hugging Face-style Medusa step: a left-padded batch of two
# prompts, a (B, 1, T, past + T) bool mask from the tree's ancestor matrix and the prompt's attention_mask, and
# position_ids handed beside it. Before the fix the tree nodes got `prompt length + arange(T)` (their index in the
# flattened tree); the fix gives them `prompt length + depth`, as Medusa's `medusa_position_ids` does.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)
VOCAB, DIM, HEADS, HEAD_DIM = 40, 32, 2, 16


def rotary(x, position_ids):  # x (B, H, T, D), position_ids (B, T)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    freqs = position_ids.float()[..., None] * inv
    emb = torch.cat([freqs, freqs], -1)[:, None]
    half = x.shape[-1] // 2
    return x * emb.cos() + torch.cat([-x[..., half:], x[..., :half]], -1) * emb.sin()


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.v_proj, self.o_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, hidden, position_ids, attention_mask, past):
        b, t, _ = hidden.shape
        shape = lambda x: x.view(b, t, HEADS, HEAD_DIM).transpose(1, 2)  # noqa: E731
        q = rotary(shape(self.q_proj(hidden)), position_ids)
        k = rotary(shape(self.k_proj(hidden)), position_ids)
        v = shape(self.v_proj(hidden))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, DIM)), (k, v)


class MedusaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([Attention() for _ in range(2)])
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids, attention_mask, past_key_values=None):
        hidden, cache = self.embed_tokens(input_ids), []
        for i, layer in enumerate(self.layers):
            out, kv = layer(hidden, position_ids, attention_mask, None if past_key_values is None else past_key_values[i])
            hidden = hidden + out
            cache.append(kv)
        return self.lm_head(hidden), cache


model = MedusaModel().eval()
prompt = torch.tensor([[11, 12, 13, 14, 15, 16], [0, 0, 21, 22, 23, 24]])  # row 1 left-padded by two
prompt_mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
# the tree: root, two candidates of head 1 (siblings), then one child under each candidate
tree_parents = [-1, 0, 0, 1, 2]
depth = [0, 1, 1, 2, 2]
tree_mask = torch.zeros(5, 5, dtype=torch.bool)
for node, parent in enumerate(tree_parents):
    tree_mask[node, node] = True
    while parent >= 0:
        tree_mask[node, parent] = True
        parent = tree_parents[parent]

with torch.no_grad():
    length = prompt.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = causal[None, None] & prompt_mask[:, None, None, :].bool()
    mask = mask | torch.eye(length, dtype=torch.bool)[None, None]  # a padding row keeps its own key (no NaN)
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    logits, past = model(prompt, positions, mask, None)

    candidates = torch.tensor([[7, 8, 9, 10, 11], [7, 8, 9, 10, 11]])
    tree_attn = torch.cat([prompt_mask[:, None, None, :].bool().expand(2, 1, 5, length),
                           tree_mask[None, None].expand(2, 1, 5, 5)], dim=-1)
    real_length = prompt_mask.sum(-1, keepdim=True)  # each row's tokens so far
    if FIXED:
        medusa_position_ids = real_length + torch.tensor(depth)[None]
    else:
        medusa_position_ids = real_length + torch.arange(5)[None]
    tree_logits, _ = model(candidates, medusa_position_ids, tree_attn, past)
    print("tree positions:", medusa_position_ids.tolist())
