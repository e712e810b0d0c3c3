"""A decoder tuned with a soft prompt: 3 learned key/value vectors prepended to each layer's keys (prefix tuning), the
text left-padded under its attention_mask. The mask over [prompt; text] keys is built causal over the text with the
prompt always visible, but the text's padding is left out of it (--fixed: the attention_mask extended with ones for the
prompt's keys, as PEFT extends it). Checked: the fix's real tokens match the unpadded prompt run alone."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class PrefixDecoder(nn.Module):
    def __init__(self, d=16, heads=2, prefix=3):
        super().__init__()
        self.heads, self.embed = heads, nn.Embedding(40, d)
        self.prefix_k, self.prefix_v = nn.Parameter(torch.randn(prefix, d)), nn.Parameter(torch.randn(prefix, d))
        self.q, self.k, self.v, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 40)

    def split(self, x):
        return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

    def forward(self, input_ids, attention_mask):
        b, n = input_ids.shape
        x = self.embed(input_ids)
        p = self.prefix_k.shape[0]
        k = torch.cat([self.prefix_k.expand(b, -1, -1), self.k(x)], dim=1)
        v = torch.cat([self.prefix_v.expand(b, -1, -1), self.v(x)], dim=1)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        keep = torch.cat([torch.ones(n, p, dtype=torch.bool), causal], dim=1)[None, None]  # (1, 1, n, p + n)
        if FIXED:
            keep = keep & F.pad(attention_mask.bool(), (p, 0), value=True)[:, None, None, :]
        out = F.scaled_dot_product_attention(self.split(self.q(x)), self.split(k), self.split(v), attn_mask=keep)
        return self.head(out.transpose(1, 2).reshape(b, n, -1))


torch.manual_seed(0)
model = PrefixDecoder().eval()
ids = torch.tensor([[0, 0, 7, 8, 9], [10, 11, 12, 13, 14]])
mask = (ids != 0).long()
with torch.no_grad():
    logits = model(ids, mask)
    alone = model(ids[:1, 2:], mask[:1, 2:])
print("row 0, last token:", logits[0, -1, :4].numpy().round(3))
if FIXED:
    assert torch.allclose(logits[0, 2:], alone[0], atol=1e-5)
