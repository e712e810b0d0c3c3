# The slip of hyunwoongko/transformer#14 (the target's pad mask built with the source's pad id) written another way: a
# translation model whose one helper `pad_attention_bias(tokens, pad_id)` makes an additive (B, 1, L, L) bias hiding
# padded queries and keys alike, handed to SDPA; the target's bias is built with `self.src_pad_id` (1) though the
# target pads with `self.tgt_pad_id` (0), and target id 1 (`<unk>`) is a real token. Left-padded sources, right-padded
# targets. The fix builds the target's bias with tgt_pad_id.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(6)
DIM, HEADS = 16, 2


def pad_attention_bias(tokens, pad_id, causal=False):
    real = tokens != pad_id
    keep = real[:, None, :, None] & real[:, None, None, :]
    if causal:
        keep = keep & torch.ones(tokens.size(1), tokens.size(1), dtype=torch.bool).tril()
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x, bias):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(b, t, DIM))


class Translator(nn.Module):
    def __init__(self, src_pad_id=1, tgt_pad_id=0):
        super().__init__()
        self.src_pad_id, self.tgt_pad_id = src_pad_id, tgt_pad_id
        self.src_embed, self.tgt_embed = nn.Embedding(20, DIM), nn.Embedding(20, DIM)
        self.encoder, self.decoder = SelfAttention(), SelfAttention()

    def forward(self, src, tgt):
        memory = self.encoder(self.src_embed(src), pad_attention_bias(src, self.src_pad_id))
        tgt_pad = self.tgt_pad_id if FIXED else self.src_pad_id
        return self.decoder(self.tgt_embed(tgt), pad_attention_bias(tgt, tgt_pad, causal=True)), memory


model = Translator().eval()
src = torch.tensor([[1, 1, 5, 6, 7], [8, 9, 10, 11, 12]])  # source pad 1, left-padded
tgt = torch.tensor([[2, 13, 1, 14, 3, 0], [2, 15, 16, 17, 18, 3]])  # target pad 0; id 1 (<unk>) at row 0, position 2
with torch.no_grad():
    out, _ = model(src, tgt)
print(out.shape)
