"""Lumina-Image 2.0 unified single-stream DiT: real caption tokens then image tokens, repacked per sample.

Follows huggingface/diffusers src/diffusers/models/transformers/transformer_lumina2.py:
  Lumina2RotaryPosEmbed.forward(hidden_states, encoder_attention_mask): l_effective_cap_len = mask.sum(1);
      seq_lengths = cap_len + image_len; caption position ids (i, 0, 0) for i < cap_len, image position ids
      (cap_len, row, col); 3-axis RoPE (axes_dims) gathered per position id; padded to max(seq_lengths)
  Lumina2Transformer2DModel.forward: context_refiner on caption tokens with the caption mask, noise_refiner on
      image tokens (no mask), then joint_hidden_states[i, :seq_len] = cat(caption[i, :cap_len], image[i]),
      attention_mask[i, :seq_len] = True, layers run with that mask; image tokens read back at cap_len
  Lumina2AttnProcessor2_0: SDPA with attention_mask.bool() viewed as (B, 1, 1, L)
Reduced: image 2x3 patches, captions of 5, 2 and 4 real tokens padded to 6, hidden 48, 4 heads, 1+1+2 layers.
Note the caption padding is NOT carried into the joint sequence: the real caption is moved next to the image,
and the pad tail (after the image) is hidden by the mask. Reference: each sample with its unpadded caption alone.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, HEADS, HH, WW, CAP = 48, 4, 2, 3, 6
HD = D // HEADS
AXES = (4, 4, 4)   # rope dims per axis (sum = HD)
IMG = HH * WW


def rope_angles(pos_ids):  # pos_ids (L, 3) -> (L, HD/2)
    parts = []
    for a, d in enumerate(AXES):
        inv = 1.0 / (256 ** (torch.arange(0, d, 2) / d))
        parts.append(pos_ids[:, a:a + 1].double() * inv)
    return torch.cat(parts, -1)


def apply_rope(x, ang):  # x (B, H, L, HD), ang (B, L, HD/2), pairs (2i, 2i+1)
    c, s = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)


class Block(nn.Module):
    def __init__(self, modulated):
        super().__init__()
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.ff = nn.Sequential(nn.Linear(D, 96), nn.SiLU(), nn.Linear(96, D))
        self.mod = nn.Linear(D, 4 * D) if modulated else None

    def forward(self, x, ang, mask, temb=None):
        b, l, _ = x.shape
        sc1, g1, sc2, g2 = self.mod(F.silu(temb)).unsqueeze(1).chunk(4, -1) if self.mod else (0, 0, 0, 0)
        h = F.rms_norm(x, (D,)) * (1 + sc1)
        q, k, v = self.qkv(h).view(b, l, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        q, k = F.rms_norm(q, (HD,)), F.rms_norm(k, (HD,))
        q, k = apply_rope(q, ang), apply_rope(k, ang)
        m = None if mask is None else mask.bool().view(b, 1, 1, l)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=m).transpose(1, 2).reshape(b, l, D)
        x = x + torch.tanh(torch.as_tensor(g1)) * self.o(a) if self.mod else x + self.o(a)
        f = self.ff(F.rms_norm(x, (D,)) * (1 + sc2))
        return x + torch.tanh(torch.as_tensor(g2)) * f if self.mod else x + f


class TinyLumina2(nn.Module):
    def __init__(self):
        super().__init__()
        self.x_embed, self.cap_embed, self.t_embed = nn.Linear(4, D), nn.Linear(10, D), nn.Linear(1, D)
        self.context_refiner, self.noise_refiner = Block(False), Block(True)
        self.layers = nn.ModuleList([Block(True), Block(True)])
        self.final = nn.Linear(D, 4)

    def forward(self, x, t, cap_feats, cap_mask):
        b = x.shape[0]
        temb = self.t_embed(t[:, None])
        cap_len = cap_mask.sum(1).tolist()
        seq_lengths = [c + IMG for c in cap_len]
        max_len = max(seq_lengths)
        rows, cols = torch.meshgrid(torch.arange(HH), torch.arange(WW), indexing="ij")
        pos = torch.zeros(b, max_len, 3, dtype=torch.long)
        cap_pos = torch.zeros(b, cap_feats.shape[1], 3, dtype=torch.long)
        img_pos = torch.zeros(b, IMG, 3, dtype=torch.long)
        for i, c in enumerate(cap_len):
            pos[i, :c, 0] = torch.arange(c)
            pos[i, c:c + IMG] = torch.stack([torch.full((IMG,), c), rows.flatten(), cols.flatten()], -1)
            cap_pos[i, :c] = pos[i, :c]
            img_pos[i] = pos[i, c:c + IMG]
        ang = lambda p: torch.stack([rope_angles(pi) for pi in p])
        cap = self.context_refiner(self.cap_embed(cap_feats), ang(cap_pos), cap_mask)
        img = self.noise_refiner(self.x_embed(x), ang(img_pos), None, temb)
        joint = torch.zeros(b, max_len, D)
        attention_mask = torch.zeros(b, max_len, dtype=torch.bool)
        for i, (c, n) in enumerate(zip(cap_len, seq_lengths)):
            joint[i, :n] = torch.cat([cap[i, :c], img[i]])
            attention_mask[i, :n] = True
        full_ang = ang(pos)
        for layer in self.layers:
            joint = layer(joint, full_ang, attention_mask, temb)
        out = torch.stack([joint[i, c:c + IMG] for i, c in enumerate(cap_len)])
        return self.final(F.rms_norm(out, (D,)))


lens = [5, 2, 4]
caps = [torch.randn(n, 10) for n in lens]
cap_feats = torch.zeros(3, CAP, 10)
cap_mask = torch.zeros(3, CAP, dtype=torch.long)
for i, c in enumerate(caps):
    cap_feats[i, : len(c)], cap_mask[i, : len(c)] = c, 1
x = torch.randn(3, IMG, 4)
t = torch.tensor([0.2, 0.5, 0.8])

model = TinyLumina2().eval()
with torch.no_grad():
    out = model(x, t, cap_feats, cap_mask)
    max_diff = 0.0
    for i, c in enumerate(caps):
        ref = model(x[i:i + 1], t[i:i + 1], c[None],
                    torch.ones(1, len(c), dtype=torch.long))
        max_diff = max(max_diff, (out[i] - ref[0]).abs().max().item())

print("velocity", tuple(out.shape), "joint lengths", [n + IMG for n in lens])
print("max |repacked padded batch - unpadded caption alone|:", max_diff)
assert max_diff < 1e-10
