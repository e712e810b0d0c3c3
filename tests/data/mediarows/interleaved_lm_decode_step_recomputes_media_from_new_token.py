# The OpenFlamingo bug (mlfoundations/open_flamingo 5c90779: during cached generation each step's media locations
# come from its own new token, so text_time = 0 and the generated tokens lose the image) written another way: a
# left-padded batch, generation through `model(input_ids, attention_mask=..., past_key_values=...)` with a KV cache of
# tensors, a cross-attention over (B * heads) matrices with torch.bmm and masked_fill(finfo.min), and the rows of text
# with no media zeroed after the softmax (so the generated tokens' cross-attention output is 0, not uniform). Each row
# holds two images; text attends only its immediate media. Fix: at a decode step the layers keep the prompt's media
# count and attend the last cached media.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(11)

DIM, VIS, LATENTS, HEADS, MEDIA = 24, 10, 2, 3, 5


class CrossAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.kv = nn.Linear(VIS, 2 * DIM, bias=False)
        self.o = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, media, text_time):
        b, t, _ = x.shape
        n = media.shape[1]
        q = self.q(x).view(b, t, HEADS, -1).transpose(1, 2).reshape(b * HEADS, t, -1)
        k, v = (z.view(b, n * LATENTS, HEADS, -1).transpose(1, 2).reshape(b * HEADS, n * LATENTS, -1)
                for z in self.kv(media.flatten(1, 2)).chunk(2, -1))
        scores = torch.bmm(q, k.transpose(1, 2)) / q.shape[-1] ** 0.5  # (B * H, T, n * LATENTS)
        media_time = torch.arange(1, n + 1).repeat_interleave(LATENTS)
        allowed = (text_time[:, :, None] == media_time[None, None, :]).repeat_interleave(HEADS, 0)
        weights = F.softmax(scores.masked_fill(~allowed, torch.finfo(scores.dtype).min), dim=-1)
        weights = weights.masked_fill((text_time == 0).repeat_interleave(HEADS, 0)[:, :, None], 0.0)
        out = torch.bmm(weights, v).view(b, HEADS, t, -1).transpose(1, 2).reshape(b, t, -1)
        return self.o(out)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.cross_attn = CrossAttention()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.ln = nn.LayerNorm(DIM)

    def forward(self, x, media, text_time, mask, past):
        x = x + self.cross_attn(x, media, text_time)
        b, t, _ = x.shape
        q, k, v = (z.view(b, t, HEADS, -1).transpose(1, 2) for z in self.qkv(self.ln(x)).chunk(3, -1))
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class InterleavedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.media_token_id = MEDIA
        self.embed = nn.Embedding(50, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 50, bias=False)
        self.vision = None
        self.cached_media_count = None

    def forward(self, input_ids, attention_mask, past_key_values=None):
        media_locations = input_ids == self.media_token_id
        text_time = media_locations.cumsum(-1)
        if past_key_values is None:
            self.cached_media_count = media_locations.sum(-1)
        elif FIXED and not media_locations.any():
            text_time = self.cached_media_count[:, None].expand_as(input_ids)  # the last cached media
        t, total = input_ids.shape[1], attention_mask.shape[1]
        causal = torch.arange(total)[None, :] <= torch.arange(total - t, total)[:, None]
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        own = torch.arange(total)[None, :] == torch.arange(total - t, total)[:, None]
        mask = mask | own[None, None] & ~mask.any(-1, keepdim=True)  # (a padding row sees its own key: no NaN)
        x, presents = self.embed(input_ids), []
        for i, block in enumerate(self.blocks):
            x, present = block(x, self.vision, text_time, mask, None if past_key_values is None else past_key_values[i])
            presents.append(present)
        return self.head(x), presents


model = InterleavedLM().eval()
PAD = 0
prompts = [[MEDIA, 14, 22, 9, MEDIA, 31, 17], [MEDIA, 8, MEDIA, 40, 12]]
width = max(map(len, prompts))
input_ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
attention_mask = (input_ids != PAD).long()
model.vision = torch.randn(2, 2, LATENTS, VIS)

with torch.no_grad():
    logits, past = model(input_ids, attention_mask)
    sequence = input_ids
    for _ in range(3):
        token = logits[:, -1].argmax(-1, keepdim=True)
        token = torch.where(token == MEDIA, torch.full_like(token, 3), token)  # (no new image generated)
        sequence = torch.cat([sequence, token], 1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(token)], 1)
        logits, past = model(token, attention_mask, past_key_values=past)
    step_logits = logits[:, -1]
    model.cached_media_count = None
    full_logits, _ = model(sequence, attention_mask)
print(f"max |cached decode - recompute| at the last step: {(step_logits - full_logits[:, -1]).abs().max().item():.3e}")
