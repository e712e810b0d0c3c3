"""Transformer-TTS: many mel frames (queries) attend to a few padded phonemes (keys), decoded step by step.

Follows espnet/espnet espnet2/tts/transformer/transformer.py (Transformer._forward: h_masks =
self._source_mask(ilens), y_masks = self._target_mask(olens); Transformer.inference) and
espnet/nets/pytorch_backend/transformer/decoder.py (Decoder.forward_one_step with memory_mask): the encoder
masks padded phonemes as keys; the decoder is causal over frames and cross-attends to the phoneme memory with
memory_mask = (B, 1, Tin), key padding only.  The decoder runs 12 frames over memories of 5 and 3 phonemes:
more queries than keys, by design.  The memory's K/V are projected once and reused every step (cached
cross-attention), the self-attention K/V grow by one frame per step.

Padded phoneme rows of the encoder output are garbage and are never used as keys.  Reference: each utterance
alone, unpadded, with no cache (every step recomputes the whole prefix of frames).  Max diff must be ~0.
"""
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
E, H, NPH, NMEL, TOUT = 24, 3, 11, 6, 12
D = E // H
emb = torch.nn.Embedding(NPH, E, padding_idx=0)
W = {n: torch.randn(E, E) / math.sqrt(E) for n in
     ["eq", "ek", "ev", "eo", "sq", "sk", "sv", "so", "cq", "ck", "cv", "co"]}
prenet, feat_out = torch.randn(NMEL, E) / math.sqrt(NMEL), torch.randn(E, NMEL) / math.sqrt(E)


def split(x):
    return x.view(x.shape[0], -1, H, D).transpose(1, 2)


def attn(q, k, v, mask):
    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ v


def merge(x):
    return x.transpose(1, 2).reshape(x.shape[0], -1, E)


def encode(xs, ilens):
    x = emb(xs)
    src_mask = (torch.arange(xs.shape[1])[None] < ilens[:, None])[:, None, None, :]  # _source_mask
    a = attn(split(x @ W["eq"]), split(x @ W["ek"]), split(x @ W["ev"]), src_mask)
    return torch.tanh(x + merge(a) @ W["eo"]), src_mask


def decode(hs, memory_mask, steps, cached):
    Bn = hs.shape[0]
    mk, mv = split(hs @ W["ck"]), split(hs @ W["cv"])  # projected once: cached cross-attention
    ys = torch.zeros(Bn, 1, NMEL)  # go frame
    outs, sk, sv = [], None, None
    for t in range(steps):
        if cached:
            x = torch.tanh(ys[:, -1:] @ prenet)
            k1, v1 = split(x @ W["sk"]), split(x @ W["sv"])
            sk = k1 if sk is None else torch.cat([sk, k1], 2)
            sv = v1 if sv is None else torch.cat([sv, v1], 2)
            self_mask = torch.ones(1, 1, 1, t + 1, dtype=torch.bool)
        else:
            x = torch.tanh(ys @ prenet)
            sk, sv = split(x @ W["sk"]), split(x @ W["sv"])
            self_mask = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()[None, None]  # _target_mask
        h = x + merge(attn(split(x @ W["sq"]), sk, sv, self_mask)) @ W["so"]
        h = h + merge(attn(split(h @ W["cq"]), mk, mv, memory_mask)) @ W["co"]
        frame = (h @ feat_out)[:, -1:]
        outs.append(frame)
        ys = torch.cat([ys, frame], 1)
    return torch.cat(outs, 1)


ilens = torch.tensor([5, 3])
xs = torch.zeros(2, 5, dtype=torch.long)
xs[0, :5] = torch.tensor([4, 2, 9, 7, 1])
xs[1, :3] = torch.tensor([8, 3, 6])
hs, src_mask = encode(xs, ilens)
batched = decode(hs, src_mask, TOUT, cached=True)

max_diff = 0.0
for b in range(2):
    n = int(ilens[b])
    hb, mb = encode(xs[b:b + 1, :n], ilens[b:b + 1])
    ref = decode(hb, mb, TOUT, cached=False)
    max_diff = max(max_diff, (batched[b:b + 1] - ref).abs().max().item())
print("frames decoded:", TOUT, "phonemes:", ilens.tolist())
print("max |batched cached - single uncached|:", max_diff)
assert max_diff < 1e-12
