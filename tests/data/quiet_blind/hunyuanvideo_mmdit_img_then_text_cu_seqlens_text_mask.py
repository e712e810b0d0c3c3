"""HunyuanVideo-style MMDiT: image tokens first, padded text tokens after, joint attention.

Follows Tencent/HunyuanVideo hyvideo/modules/models.py:
  get_cu_seqlens(text_mask, img_len): per sample two segments, [img + real text] and [text padding],
      passed as cu_seqlens_q/kv to flash_attn_varlen_func (the pad tail forms its own sequence)
  MMDoubleStreamBlock.forward: separate img/txt modulation and qkv, RoPE on image q/k only,
      q = cat(img_q, txt_q), joint attention, split back
  MMSingleStreamBlock.forward: one stream over cat(img, txt), same cu_seqlens
and diffusers HunyuanVideoTransformer3DModel.forward (the non-varlen path): effective length
  latent_len + encoder_attention_mask.sum(1), attention_mask = arange(N) < effective length, as an SDPA bool mask.
Reduced: 2 frames of 2x2 latent patches (8 image tokens), text of 5/3/1 real tokens padded to 6, hidden 32.
Both paths are computed (a loop over cu_seqlens segments standing for the varlen kernel, and SDPA with the bool
key mask); the reference runs each sample with its unpadded text only.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

D, HEADS, IMG, TXT = 32, 4, 8, 6
HD = D // HEADS


def rope(x, pos):  # x (B, L, H, hd)
    freqs = 1.0 / (10000 ** (torch.arange(0, HD, 2) / HD))
    ang = pos[:, None] * freqs[None]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


def get_cu_seqlens(text_mask, img_len):
    b = text_mask.shape[0]
    text_len = text_mask.sum(dim=1)
    max_len = text_mask.shape[1] + img_len
    cu = torch.zeros(2 * b + 1, dtype=torch.int32)
    for i in range(b):
        cu[2 * i + 1] = i * max_len + text_len[i] + img_len
        cu[2 * i + 2] = (i + 1) * max_len
    return cu


def attention(q, k, v, mode, cu_seqlens=None, attn_mask=None):
    """q, k, v: (B, L, H, hd)."""
    b, l = q.shape[:2]
    if mode == "varlen":  # what flash_attn_varlen_func computes over the flattened batch
        qf, kf, vf = (t.reshape(b * l, HEADS, HD).transpose(0, 1) for t in (q, k, v))
        out = torch.empty_like(qf)
        for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            if e > s:
                out[:, s:e] = F.scaled_dot_product_attention(qf[:, s:e], kf[:, s:e], vf[:, s:e])
        return out.transpose(0, 1).reshape(b, l, D)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
    return o.transpose(1, 2).reshape(b, l, D)


class Mod(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.lin, self.n = nn.Linear(D, n * D), n

    def forward(self, vec):
        return self.lin(F.silu(vec)).unsqueeze(1).chunk(self.n, dim=-1)


class DoubleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_mod, self.txt_mod = Mod(6), Mod(6)
        self.img_qkv, self.txt_qkv = nn.Linear(D, 3 * D), nn.Linear(D, 3 * D)
        self.img_proj, self.txt_proj = nn.Linear(D, D), nn.Linear(D, D)
        self.img_mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(approximate="tanh"), nn.Linear(2 * D, D))
        self.txt_mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(approximate="tanh"), nn.Linear(2 * D, D))

    def forward(self, img, txt, vec, pos, **attn_kw):
        ish, isc, ig, ish2, isc2, ig2 = self.img_mod(vec)
        tsh, tsc, tg, tsh2, tsc2, tg2 = self.txt_mod(vec)
        ln = lambda x: F.layer_norm(x, (D,))
        iq, ik, iv = self.img_qkv(ln(img) * (1 + isc) + ish).view(*img.shape[:2], 3, HEADS, HD).unbind(2)
        tq, tk, tv = self.txt_qkv(ln(txt) * (1 + tsc) + tsh).view(*txt.shape[:2], 3, HEADS, HD).unbind(2)
        iq, ik = rope(iq, pos), rope(ik, pos)
        a = attention(torch.cat([iq, tq], 1), torch.cat([ik, tk], 1), torch.cat([iv, tv], 1), **attn_kw)
        ia, ta = a[:, :IMG], a[:, IMG:]
        img = img + ig * self.img_proj(ia)
        img = img + ig2 * self.img_mlp(ln(img) * (1 + isc2) + ish2)
        txt = txt + tg * self.txt_proj(ta)
        txt = txt + tg2 * self.txt_mlp(ln(txt) * (1 + tsc2) + tsh2)
        return img, txt


class SingleBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mod = Mod(3)
        self.linear1 = nn.Linear(D, 3 * D + 2 * D)
        self.linear2 = nn.Linear(D + 2 * D, D)

    def forward(self, x, vec, pos, **attn_kw):
        sh, sc, g = self.mod(vec)
        qkv, mlp = self.linear1(F.layer_norm(x, (D,)) * (1 + sc) + sh).split([3 * D, 2 * D], -1)
        q, k, v = qkv.view(*x.shape[:2], 3, HEADS, HD).unbind(2)
        q = torch.cat([rope(q[:, :IMG], pos), q[:, IMG:]], 1)
        k = torch.cat([rope(k[:, :IMG], pos), k[:, IMG:]], 1)
        a = attention(q, k, v, **attn_kw)
        return x + g * self.linear2(torch.cat([a, F.gelu(mlp, approximate="tanh")], -1))


class TinyHunyuan(nn.Module):
    def __init__(self):
        super().__init__()
        self.img_in, self.txt_in, self.t_in = nn.Linear(4, D), nn.Linear(12, D), nn.Linear(1, D)
        self.double_block, self.single_block = DoubleBlock(), SingleBlock()
        self.final = nn.Linear(D, 4)

    def forward(self, latents, text_states, text_mask, t, mode):
        img, txt = self.img_in(latents), self.txt_in(text_states)
        pooled = (text_states * text_mask[..., None]).sum(1) / text_mask.sum(1, keepdim=True)
        vec = self.t_in(t[:, None]) + self.txt_in(pooled)
        pos = torch.arange(IMG, dtype=torch.float64)
        if mode == "varlen":
            kw = dict(mode="varlen", cu_seqlens=get_cu_seqlens(text_mask, IMG))
        else:
            eff = IMG + text_mask.sum(1)
            keep = torch.arange(IMG + text_mask.shape[1])[None] < eff[:, None]
            kw = dict(mode="sdpa", attn_mask=keep[:, None, None, :])
        img, txt = self.double_block(img, txt, vec, pos, **kw)
        x = self.single_block(torch.cat([img, txt], 1), vec, pos, **kw)
        return self.final(x[:, :IMG])


lens = [5, 3, 1]
latents = torch.randn(3, IMG, 4)
texts = [torch.randn(n, 12) for n in lens]
text_states = torch.zeros(3, TXT, 12)
text_mask = torch.zeros(3, TXT, dtype=torch.long)
for i, t_ in enumerate(texts):
    text_states[i, : len(t_)] = t_
    text_mask[i, : len(t_)] = 1
t = torch.tensor([0.3, 0.7, 0.9])

model = TinyHunyuan().eval()
with torch.no_grad():
    out_varlen = model(latents, text_states, text_mask, t, "varlen")
    out_sdpa = model(latents, text_states, text_mask, t, "sdpa")
    max_diff = (out_varlen - out_sdpa).abs().max().item()
    for i, t_ in enumerate(texts):
        ref = model(latents[i:i + 1], t_.unsqueeze(0), torch.ones(1, len(t_), dtype=torch.long), t[i:i + 1], "sdpa")
        max_diff = max(max_diff, (out_sdpa[i] - ref[0]).abs().max().item(),
                       (out_varlen[i] - ref[0]).abs().max().item())

print("velocity", tuple(out_sdpa.shape))
print("max |varlen vs sdpa-mask vs unpadded text|:", max_diff)
assert max_diff < 1e-10
