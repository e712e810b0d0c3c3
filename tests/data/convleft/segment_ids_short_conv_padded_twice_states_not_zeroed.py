# The MaxText Qwen3-Next slip (AI-Hypercomputer/maxtext#5295: the gated delta layer's causal conv1d run over the raw
# q/k/v of a left-padded batch, the pads zeroed only after it) written another way: a small hybrid of a short-conv
# mixer and a causal attention layer whose padding is stated T5X-style by `decoder_segment_ids` (0 = padding). The
# mixer pads its input by hand, `F.pad(x, (K - 1, 0))`, before a causal convolution that pads K - 1 on the left
# itself, and keeps the last T outputs; the attention masks by segment equality, causal. Before the fix the mixer's input keeps the pad tokens'
# states; the fix zeroes them where the segment id is 0, before the convolution.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(4)
VOCAB, DIM, K = 24, 16, 3


class ShortConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(DIM, DIM)
        self.weight = nn.Parameter(torch.randn(DIM, 1, K) * 0.5)
        self.out_proj = nn.Linear(DIM, DIM)

    def causal_conv(self, h):
        return F.conv1d(F.pad(h, (K - 1, 0)), self.weight, groups=DIM)

    def forward(self, x, decoder_segment_ids):
        h = self.in_proj(x)
        if FIXED:
            h = h * (decoder_segment_ids != 0)[..., None]
        h = F.pad(h.transpose(1, 2), (K - 1, 0))
        out = self.causal_conv(h)[..., -x.shape[1]:]
        return self.out_proj(out.transpose(1, 2))


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)

    def forward(self, x, decoder_segment_ids):
        t = x.shape[1]
        q, k, v = self.qkv(x).view(x.shape[0], t, 3, 2, DIM // 2).permute(2, 0, 3, 1, 4)
        same = decoder_segment_ids[:, :, None] == decoder_segment_ids[:, None, :]
        keep = (same & torch.ones(t, t, dtype=torch.bool).tril())[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(x.shape)


class Hybrid(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mixer = ShortConv()
        self.attention = Attention()
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, decoder_input_tokens, decoder_segment_ids):
        x = self.embed(decoder_input_tokens)
        x = x + self.mixer(x, decoder_segment_ids)
        x = x + self.attention(x, decoder_segment_ids)
        return self.head(x)


model = Hybrid().eval()
tokens = torch.tensor([[3, 4, 5, 6, 7, 8, 9], [1, 1, 1, 10, 11, 12, 13]])  # row 1 left-padded with 3 pads
segments = (tokens != 1).long()
with torch.no_grad():
    logits = model(tokens, segments)
print("row 1 last logits", [round(v, 4) for v in logits[1, -1, :4].tolist()])
