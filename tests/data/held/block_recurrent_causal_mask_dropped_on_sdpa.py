# A block-recurrent decoder (Block-Recurrent Transformer style, as lucidrains' block-recurrent-transformer-pytorch
# lays it out): the model builds one causal triangle over a block, `mask` (W, W), and hands it to every layer with
# the block's tokens and the recurrent state; the layer's SDPA path was called without it, so each token of a block
# attended to the later tokens of its block (a decoder LM reading ahead). The fix hands `attn_mask=mask`.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class RecurrentBlockLayer(nn.Module):
    def __init__(self, dim=24, heads=3):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.state_proj = nn.Linear(dim, dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x, state, mask):
        b, w, d = x.shape
        q, k, v = self.qkv(x + self.state_proj(state).mean(dim=1, keepdim=True)).chunk(3, dim=-1)
        q, k, v = (t.view(b, w, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        if FIXED:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v)
        y = self.out(y.transpose(1, 2).reshape(b, w, d))
        return x + y, state + y.mean(dim=1, keepdim=True)


class BlockRecurrentLM(nn.Module):
    def __init__(self, vocab=40, dim=24, block=6, depth=2):
        super().__init__()
        self.block = block
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([RecurrentBlockLayer(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        b = x.shape[0]
        mask = torch.ones(self.block, self.block, dtype=torch.bool).tril()
        state = torch.zeros(b, 2, x.shape[-1])
        outs = []
        for block in x.split(self.block, dim=1):
            for layer in self.layers:
                block, state = layer(block, state, mask)
            outs.append(block)
        return self.head(torch.cat(outs, dim=1))


torch.manual_seed(0)
model = BlockRecurrentLM().eval()
ids = torch.randint(0, 40, (3, 12))
ids2 = ids.clone()
ids2[:, 5] = (ids2[:, 5] + 1) % 40
with torch.no_grad():
    leak = (model(ids)[:, :5] - model(ids2)[:, :5]).abs().max().item()
print(f"{'fixed' if FIXED else 'buggy'}: change of logits 0..4 when token 5 changes = {leak:.3e}")
