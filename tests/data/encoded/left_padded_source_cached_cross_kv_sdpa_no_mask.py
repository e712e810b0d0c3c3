# Written another way (the bug of nari-labs/dia#230: a decoder's cross-attention over a KV-cached, padded encoder
# output called with no attn_mask): a Whisper-style decoder decodes greedily, token by token, over a left-padded
# batch of sources; its `encoder_attn` projects the encoder's states to keys and values once, at the first step, and
# keeps them in the cache dict, and each step hands SDPA attn_mask=None, so every token attends the sources' pad
# slots, which the encoder's own self-attention hid. The fix hands the source's keep mask on at every step.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VOCAB, DIM, HEADS, PAD, BOS = 40, 32, 4, 1, 2


def split_heads(x):
    b, t, _ = x.shape
    return x.view(b, t, HEADS, DIM // HEADS).transpose(1, 2)


def merge_heads(x):
    b, _, t, _ = x.shape
    return x.transpose(1, 2).reshape(b, t, DIM)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM, bias=False)
        self.v_proj, self.out_proj = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, x, source=None, mask=None, cache=None, name=None):
        q = split_heads(self.q_proj(x))
        if source is not None:  # cross-attention: the source's keys and values, projected once
            if name not in cache:
                cache[name] = (split_heads(self.k_proj(source)), split_heads(self.v_proj(source)))
            k, v = cache[name]
        else:
            k, v = split_heads(self.k_proj(x)), split_heads(self.v_proj(x))
            if cache is not None:
                if name in cache:
                    k = torch.cat([cache[name][0], k], dim=2)
                    v = torch.cat([cache[name][1], v], dim=2)
                cache[name] = (k, v)
        return self.out_proj(merge_heads(F.scaled_dot_product_attention(q, k, v, attn_mask=mask)))


class EncoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.norm = Attention(), nn.LayerNorm(DIM)

    def forward(self, x, keep):
        return x + self.self_attn(self.norm(x), mask=keep[:, None, None, :])


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn, self.encoder_attn = Attention(), Attention()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)

    def forward(self, x, memory, keep, cache, i):
        x = x + self.self_attn(self.norm1(x), cache=cache, name=f"self{i}")
        cross_mask = keep[:, None, None, :] if FIXED else None
        return x + self.encoder_attn(self.norm2(x), source=memory, mask=cross_mask, cache=cache, name=f"cross{i}")


class Seq2Seq(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.ModuleList([EncoderLayer() for _ in range(layers)])
        self.decoder = nn.ModuleList([DecoderLayer() for _ in range(layers)])
        self.head = nn.Linear(DIM, VOCAB)

    def encode(self, src):
        keep = src != PAD  # (B, S): True = a real source token
        x = self.embed(src)
        for layer in self.encoder:
            x = layer(x, keep)
        return x, keep

    def greedy(self, src, steps=4):
        memory, keep = self.encode(src)
        tokens = torch.full((src.shape[0], 1), BOS)
        cache, logits = {}, []
        for _ in range(steps):
            x = self.embed(tokens[:, -1:])
            for i, layer in enumerate(self.decoder):
                x = layer(x, memory, keep, cache, i)
            logits.append(self.head(x[:, -1]))
            tokens = torch.cat([tokens, logits[-1].argmax(-1, keepdim=True)], dim=1)
        return torch.stack(logits, 1)


model = Seq2Seq().eval()
sources = [torch.randint(3, VOCAB, (n,)) for n in (4, 7)]
src = torch.full((2, 7), PAD)
for row, s in enumerate(sources):
    src[row, 7 - len(s):] = s  # left padded
with torch.no_grad():
    batched = model.greedy(src)
    diff = max((batched[i] - model.greedy(s[None])[0]).abs().max().item() for i, s in enumerate(sources))
print(f"max |logits of the left-padded batch - of each source alone|: {diff:.6f}")
