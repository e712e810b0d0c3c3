"""A text-to-audio decoder with classifier-free guidance (MusicGen / Parler-TTS style): each prompt is paired with a
null prompt (one BOS token), both left-padded to the longest; the text encoder's SDPA hides the pads by a key padding
mask, and the decoder's cross-attention reads the text's projected keys and values from a dict (`cross_kv`) filled once
before generation. The bug (as nari-labs/dia#230, written another way): each cached decode step's cross-attention is
handed no attn_mask, so every audio query attends the text's left padding. The fix hands the padding on."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, BOS, VOCAB, CODES, DIM, HEADS, STEPS = 0, 1, 50, 64, 32, 4, 6


def attend(q, k, v, mask=None):
    """The one attention helper both layers call: (B, H, Lq, D) against (B, H, Lk, D)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def split(x):
    return x.unflatten(-1, (HEADS, DIM // HEADS)).transpose(1, 2)


class TextEncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, h, real):
        q, k, v = (split(t) for t in self.qkv(self.norm(h)).chunk(3, dim=-1))
        o = attend(q, k, v, real[:, None, None, :])  # (B, 1, 1, L): every query sees its row's real tokens
        return h + self.out(o.transpose(1, 2).flatten(-2))


class AudioDecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_qkv = nn.Linear(DIM, 3 * DIM)
        self.cross_q = nn.Linear(DIM, DIM)
        self.cross_k = nn.Linear(DIM, DIM)
        self.cross_v = nn.Linear(DIM, DIM)
        self.out = nn.Linear(DIM, DIM)

    def fill(self, text_states):
        return {"k": split(self.cross_k(text_states)), "v": split(self.cross_v(text_states))}

    def forward(self, x, past, cross_kv, text_real):
        q, k, v = (split(t) for t in self.self_qkv(x).chunk(3, dim=-1))
        past["k"] = k if past.get("k") is None else torch.cat([past["k"], k], dim=2)
        past["v"] = v if past.get("v") is None else torch.cat([past["v"], v], dim=2)
        x = x + attend(q, past["k"], past["v"]).transpose(1, 2).flatten(-2)  # one new query: every cached key
        q = split(self.cross_q(x))
        mask = text_real[:, None, None, :] if FIXED else None
        return x + self.out(attend(q, cross_kv["k"], cross_kv["v"], mask).transpose(1, 2).flatten(-2))


class TextToAudio(nn.Module):
    def __init__(self):
        super().__init__()
        self.text_embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.ModuleList([TextEncoderLayer() for _ in range(2)])
        self.code_embed = nn.Embedding(CODES, DIM)
        self.decoder = nn.ModuleList([AudioDecoderLayer() for _ in range(2)])
        self.head = nn.Linear(DIM, CODES)

    @torch.no_grad()
    def generate(self, prompts, guidance=3.0):
        texts = [p for prompt in prompts for p in ([BOS], prompt)]  # (null, conditional) rows of each prompt
        width = max(len(t) for t in texts)
        ids = torch.tensor([[PAD] * (width - len(t)) + t for t in texts])  # left-padded
        real = ids != PAD
        h = self.text_embed(ids)
        for layer in self.encoder:
            h = layer(h, real)
        caches = [layer.fill(h) for layer in self.decoder]
        pasts = [{} for _ in self.decoder]
        code = torch.zeros(len(texts), 1, dtype=torch.long)
        out = []
        for _ in range(STEPS):
            x = self.code_embed(code)
            for layer, past, cross_kv in zip(self.decoder, pasts, caches):
                x = layer(x, past, cross_kv, real)
            logits = self.head(x[:, -1]).view(len(prompts), 2, CODES)
            guided = logits[:, 0] + guidance * (logits[:, 1] - logits[:, 0])
            code = guided.argmax(-1).repeat_interleave(2)[:, None]
            out.append(guided)
        return torch.stack(out, dim=1)


model = TextToAudio().eval()
prompts = [[5, 9, 13, 4, 22, 7], [31, 8, 2]]
batched = model.generate(prompts)
alone = torch.cat([model.generate([p]) for p in prompts])
print(f"fixed={FIXED} max |guided logits batched - alone| = {(batched - alone).abs().max().item():.6f}")
