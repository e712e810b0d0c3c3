# The same bug as tests/data/bugs/kvpress_key_rerotation_press_yarn_positions_double_scaled.py (NVIDIA/kvpress#85)
# written another way: a StreamingLLM-style sink cache (attention sinks + recent window) in plain torch, Meta-Llama's
# complex `freqs_cis` (interleaved pairs) carrying YaRN's mscale, a batch of 2 decoded one token at a time. When the
# cache is full the oldest non-sink keys are evicted and the kept ones shifted to slots sink..n-1 by multiplying with
# `freqs_cis[new] / freqs_cis[old]`-style factors built from the scaled table: the shift multiplies every kept key
# by mscale² beside the fresh keys. Fix: shift by the unit-modulus rotation `polar(1, (new - old) * freqs)`.
import math
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
HEADS, DIM, SINK, CACHE = 2, 16, 2, 8
MSCALE = 0.1 * math.log(4.0) + 1.0  # YaRN's attention factor for a scale of 4

freqs = 1.0 / (10000 ** (torch.arange(0, DIM, 2).float() / DIM))
angles = torch.outer(torch.arange(64).float(), freqs)
freqs_cis = torch.polar(torch.full_like(angles, MSCALE), angles)  # (positions, DIM / 2): cos/sin times mscale


def rotate(x, cis):
    """x (B, H, L, DIM) times cis (L, DIM / 2) on interleaved pairs."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * cis).flatten(-2)


class SinkCache:
    def __init__(self):
        self.k = self.v = None
        self.slot_pos = []  # the position each slot's key is rotated at

    def add(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        self.slot_pos.append(len(self.slot_pos))
        if self.k.shape[2] > CACHE:  # evict the oldest key past the sinks, shift the rest one slot back
            keep = [i for i in range(self.k.shape[2]) if i != SINK]
            old = torch.tensor([self.slot_pos[i] for i in keep[SINK:]])
            new = torch.arange(SINK, CACHE)
            if FIXED:
                shift = torch.polar(torch.ones(len(new), DIM // 2), (new - old).float()[:, None] * freqs)
            else:
                shift = freqs_cis[new] * freqs_cis[old].conj()  # carries mscale twice
            kept = self.k[:, :, keep]
            self.k = torch.cat([kept[:, :, :SINK], rotate(kept[:, :, SINK:], shift)], dim=2)
            self.v = self.v[:, :, keep]
            self.slot_pos = list(range(CACHE))
        return self.k, self.v


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.kv = torch.nn.Linear(32, HEADS * DIM), torch.nn.Linear(32, 2 * HEADS * DIM)

    def forward(self, x, cache):
        b = x.shape[0]
        q = self.q(x).view(b, 1, HEADS, DIM).transpose(1, 2)
        k, v = self.kv(x).view(b, 1, 2, HEADS, DIM).permute(2, 0, 3, 1, 4)
        slot = min(len(cache.slot_pos), CACHE)  # the slot (and position) the new token is rotated at
        q, k = rotate(q, freqs_cis[slot:slot + 1]), rotate(k, freqs_cis[slot:slot + 1])
        keys, values = cache.add(k, v)
        return F.scaled_dot_product_attention(q, keys, values)


block, cache = Block().eval(), SinkCache()
with torch.no_grad():
    for step in range(12):
        out = block(torch.randn(2, 1, 32), cache)
print("steps", step + 1, "cached keys", tuple(cache.k.shape), "out", tuple(out.shape))
