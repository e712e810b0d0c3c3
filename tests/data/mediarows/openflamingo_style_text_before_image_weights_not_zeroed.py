# The flamingo-mini bug (dhansmair/flamingo-mini 196c64b: text before the first <image> sees no latent, and its softmax
# spreads uniform weights over all of them) written as an OpenFlamingo-style language model: the model call takes
# `lang_x` and `attention_mask` (a left-padded batch), states its `media_token_id`, and conditions each layer's
# MaskedCrossAttention on `lang_x == media_token_id`; the cross-attention attends every previous image
# (only_attend_immediate_media=False: torch.ge), its scores filled with -1e9 where masked, no row max subtracted.
# Bug: nothing zeroes the rows of text with no media before it; fix: the weights multiplied by (text_time > 0).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(5)

DIM, VIS, LATENTS, HEADS = 32, 12, 3, 4


class MaskedCrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.norm = nn.LayerNorm(DIM)
        self.to_q = nn.Linear(DIM, DIM, bias=False)
        self.to_kv = nn.Linear(VIS, 2 * DIM, bias=False)
        self.to_out = nn.Linear(DIM, DIM, bias=False)
        self.media_locations = None

    def forward(self, x, media):
        b, t, _ = x.shape
        n_media = media.shape[1]
        q = self.to_q(self.norm(x)).view(b, t, self.heads, -1).permute(0, 2, 1, 3)
        k, v = (z.view(b, n_media * LATENTS, self.heads, -1).permute(0, 2, 1, 3)
                for z in self.to_kv(media.flatten(1, 2)).chunk(2, -1))
        scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        text_time = self.media_locations.cumsum(-1)  # (B, T): media tokens up to each text token
        media_time = torch.arange(1, n_media + 1).repeat_interleave(LATENTS)  # (n_media * LATENTS,)
        allowed = torch.ge(text_time[:, None, :, None], media_time[None, None, None, :])
        scores = scores.masked_fill(~allowed, -1e9)
        attn = F.softmax(scores, dim=-1)
        if FIXED:
            attn = attn * (text_time > 0)[:, None, :, None].to(attn.dtype)
        return self.to_out(torch.matmul(attn, v).permute(0, 2, 1, 3).reshape(b, t, -1))


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.xattn = MaskedCrossAttention()
        self.gate = nn.Parameter(torch.tensor(0.7))
        self.ln = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x, media, self_mask):
        x = x + torch.tanh(self.gate) * self.xattn(x, media)
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.qkv(self.ln(x)).chunk(3, -1))
        return x + self.proj(F.scaled_dot_product_attention(q, k, v, attn_mask=self_mask).transpose(1, 2).reshape(b, t, -1))


class FlamingoLM(nn.Module):
    def __init__(self, media_token_id=4):
        super().__init__()
        self.media_token_id = media_token_id
        self.embed = nn.Embedding(60, DIM)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(2))

    def forward(self, lang_x, attention_mask, vision_x):
        for layer in self.layers:
            layer.xattn.media_locations = lang_x == self.media_token_id
        t = lang_x.shape[1]
        self_mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        self_mask = self_mask | ~self_mask.any(-1, keepdim=True)  # (padding rows see everything: no NaN)
        x = self.embed(lang_x)
        for layer in self.layers:
            x = layer(x, vision_x, self_mask)
        return x


model = FlamingoLM().eval()
PAD, IMG = 0, model.media_token_id
# "Describe <image> ..." and a shorter "<image> ..." prompt after two pads, then a third with text before its image
lang_x = torch.tensor([[17, 23, IMG, 31, 8, 9, 40],
                       [PAD, PAD, IMG, 12, 19, 26, 33],
                       [PAD, 44, 13, IMG, 21, 7, 50]])
attention_mask = (lang_x != PAD).long()
vision_a, vision_b = torch.randn(3, 1, LATENTS, VIS), torch.randn(3, 1, LATENTS, VIS)

with torch.no_grad():
    out_a = model(lang_x, attention_mask, vision_a)
    out_b = model(lang_x, attention_mask, vision_b)
before = (lang_x == IMG).cumsum(-1) == 0
diff = (out_a - out_b).abs().amax(-1)[before & attention_mask.bool()].max().item()
print(f"max change of real text before its first image when the images are swapped: {diff:.3e}")
