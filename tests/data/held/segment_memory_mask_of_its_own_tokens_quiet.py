"""A segment-recurrent language model (Transformer-XL's memory, as compressive-transformer-pytorch keeps it): each
segment of 6 tokens attends the previous segment's 6 hidden states and itself, causally; its padding mask covers the
segment's own tokens (the last 6 keys, after the memory), padded with True over the memory. The batch's second row
is right-padded in its last segment. Correct: the first segment's call (6 queries over 6 keys) is no prompt whose
mask later calls lay over their first keys."""

import torch
import torch.nn.functional as F


class MemoryAttention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q = torch.nn.Linear(dim, dim)
        self.kv = torch.nn.Linear(dim, 2 * dim)

    def forward(self, x, memory, input_mask):
        b, t, d = x.shape
        context = torch.cat([memory, x], dim=1)
        m = memory.shape[1]
        q = self.q(x).view(b, t, self.heads, -1).transpose(1, 2)
        k, v = self.kv(context).view(b, m + t, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = F.pad(input_mask, (m, 0), value=True)[:, None, None, :]
        causal = torch.ones(t, m + t, dtype=torch.bool).tril(diagonal=m)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep & causal)
        return x + out.transpose(1, 2).reshape(b, t, d)


class SegmentLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(40, 16)
        self.layers = torch.nn.ModuleList(MemoryAttention() for _ in range(2))
        self.out = torch.nn.Linear(16, 40)

    def forward(self, ids, memories, mask):
        x = self.embed(ids)
        new = []
        for layer, memory in zip(self.layers, memories):
            new.append(x.detach())
            x = layer(x, memory, mask)
        return self.out(x), new


torch.manual_seed(0)
model = SegmentLM().eval()
ids = torch.randint(1, 40, (2, 18))
mask = torch.ones(2, 18, dtype=torch.bool)
mask[1, 15:] = False
ids[1, 15:] = 0
memories = [torch.zeros(2, 0, 16) for _ in model.layers]
total = 0.0
with torch.no_grad():
    for seg, seg_mask in zip(ids.split(6, dim=1), mask.split(6, dim=1)):
        logits, memories = model(seg, memories, seg_mask)
        total += logits[seg_mask].sum().item()
print("logit sum over real tokens:", round(total, 4))
