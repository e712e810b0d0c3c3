"""A decoder that attends one sample at a time (a loop over the batch handing SDPA one sample's heads, as a vmapped
kernel does), its left-padded prompts' padding dropped from the causal mask; the fix ANDs each sample's own key
padding in. Checked: each real query of the fix matches its sample run alone, unpadded."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
PAD = 0


class Decoder(nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads, self.emb = heads, nn.Embedding(40, d, padding_idx=PAD)
        self.qkv, self.out = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, 40)  # (Llama's projections: no bias)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        q, k, v = self.qkv(self.emb(input_ids)).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        outs = []
        for i in range(b):  # one sample's (heads, n, d) at a time
            allowed = causal & attention_mask[i].bool()[None, :] | torch.eye(n, dtype=torch.bool) if FIXED else causal
            outs.append(F.scaled_dot_product_attention(q[i], k[i], v[i], attn_mask=allowed))
        return self.out(torch.stack(outs).transpose(1, 2).reshape(b, n, -1))


torch.manual_seed(0)
model = Decoder().eval()
ids = torch.tensor([[PAD, PAD, PAD, 5, 6, 7], [8, 9, 10, 11, 12, 13]])
mask = (ids != PAD).long()
with torch.no_grad():
    logits = model(ids, mask)
    alone = model(ids[:1, 3:], mask[:1, 3:])
print("row 0's last logits:", logits[0, -1, :4].numpy().round(3))
if FIXED:
    assert torch.allclose(logits[0, 3:], alone[0], atol=1e-5)
