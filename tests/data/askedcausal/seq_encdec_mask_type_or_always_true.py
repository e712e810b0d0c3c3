# Written another way for causal-unasked (the maxjcohen/transformer 60df0da bug, in the style of a sequence-to-sequence
# forecaster on F.scaled_dot_product_attention over right-padded series): the attention block takes its future mask as a
# word of each call, `attn(x, memory, key_keep, mask_type="causal")` in the decoder's self-attention and nothing in the
# encoder's, but tests it as `if mask_type == "causal" or "future":`, always true, so the encoder (and the
# cross-attention) run causal too. The fix tests `mask_type in ("causal", "future")`.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q, self.kv, self.o = nn.Linear(d, d), nn.Linear(d, 2 * d), nn.Linear(d, d)

    def forward(self, x, source, key_keep, mask_type=None):
        b, n, d = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.kv(source).view(b, source.shape[1], 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = key_keep[:, None, None, :].expand(b, 1, n, source.shape[1])
        causal = mask_type in ("causal", "future") if FIXED else (mask_type == "causal" or "future")
        if causal:
            keep = keep & torch.ones(n, source.shape[1], dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.o(y.transpose(1, 2).reshape(b, n, d))


class EncoderDecoder(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.embed_src, self.embed_tgt = nn.Linear(1, d), nn.Linear(1, d)
        self.enc = Attention(d)
        self.dec_self, self.dec_cross = Attention(d), Attention(d)
        self.head = nn.Linear(d, 1)

    def forward(self, src, src_len, tgt):
        src_keep = torch.arange(src.shape[1])[None, :] < src_len[:, None]
        tgt_keep = torch.ones(tgt.shape[:2], dtype=torch.bool)
        memory = self.embed_src(src[..., None])
        memory = memory + self.enc(memory, memory, src_keep)
        h = self.embed_tgt(tgt[..., None])
        h = h + self.dec_self(h, h, tgt_keep, mask_type="causal")
        h = h + self.dec_cross(h, memory, src_keep)
        return self.head(h).squeeze(-1)


model = EncoderDecoder().eval()
src_len = torch.tensor([8, 5])
src = torch.randn(2, 8).cumsum(-1) * (torch.arange(8)[None, :] < src_len[:, None])
tgt = torch.randn(2, 4)
with torch.no_grad():
    before = model(src, src_len, tgt)
    changed = src.clone()
    changed[0, 7] += 5.0                      # the last real step of series 0
    after = model(changed, src_len, tgt)
print(f"fixed={FIXED}: |change of the first forecast step| when the last source step changes: "
      f"{(before[0, 0] - after[0, 0]).abs().item():.3e}")
