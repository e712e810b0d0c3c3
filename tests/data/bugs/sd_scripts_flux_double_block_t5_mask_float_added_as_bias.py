# kohya-ss/sd-scripts commit 2b07a92c ("Fix error in applying mask in Attention"), library/flux_models.py DoubleStreamBlock.
# Bug: the T5 attention mask (int 0/1) is concatenated with float ones, so SDPA gets a float 0/1 mask that is ADDED
# to the logits instead of hiding padded text tokens; the fix casts it to bool before building the joint mask.
import sys
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def attention(q: Tensor, k: Tensor, v: Tensor, pe: Tensor, attn_mask: Optional[Tensor] = None) -> Tensor:
    q, k = apply_rope(q, k, pe)
    x = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
    B, H, L, D = x.shape
    x = x.transpose(1, 2).reshape(B, L, H * D)  # rearrange "B H L D -> B L (H D)"
    return x


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    assert dim % 2 == 0
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos, omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    out = out.reshape(*out.shape[:-1], 2, 2)  # rearrange "b n d (i j) -> b n d i j"
    return out.float()


def apply_rope(xq: Tensor, xk: Tensor, freqs_cis: Tensor):
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


class EmbedND(nn.Module):
    def __init__(self, dim, theta, axes_dim):
        super().__init__()
        self.dim, self.theta, self.axes_dim = dim, theta, axes_dim

    def forward(self, ids: Tensor) -> Tensor:
        n_axes = ids.shape[-1]
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3)
        return emb.unsqueeze(1)


def timestep_embedding(t: Tensor, dim, max_period=10000, time_factor: float = 1000.0):
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim, hidden_dim):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x):
        return self.out_layer(self.silu(self.in_layer(x)))


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_dtype = x.dtype
        x = x.float()
        rrms = torch.rsqrt(torch.mean(x**2, dim=-1, keepdim=True) + 1e-6)
        return ((x * rrms) * self.scale.float()).to(dtype=x_dtype)


class QKNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.query_norm = RMSNorm(dim)
        self.key_norm = RMSNorm(dim)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    def __init__(self, dim, num_heads=8, qkv_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim)


@dataclass
class ModulationOut:
    shift: Tensor
    scale: Tensor
    gate: Tensor


class Modulation(nn.Module):
    def __init__(self, dim, double):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec):
        out = self.lin(nn.functional.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)
        return ModulationOut(*out[:3]), ModulationOut(*out[3:]) if self.is_double else None


def split_qkv(qkv, num_heads):
    # rearrange "B L (K H D) -> K B H L D", K=3
    B, L, _ = qkv.shape
    return qkv.view(B, L, 3, num_heads, -1).permute(2, 0, 3, 1, 4)


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=False):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(dim=hidden_size, num_heads=num_heads, qkv_bias=qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = nn.Sequential(nn.Linear(hidden_size, mlp_hidden_dim), nn.GELU(approximate="tanh"),
                                     nn.Linear(mlp_hidden_dim, hidden_size))
        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(dim=hidden_size, num_heads=num_heads, qkv_bias=qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = nn.Sequential(nn.Linear(hidden_size, mlp_hidden_dim), nn.GELU(approximate="tanh"),
                                     nn.Linear(mlp_hidden_dim, hidden_size))

    def forward(self, img, txt, vec, pe, txt_attention_mask: Optional[Tensor] = None):
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)

        img_modulated = (1 + img_mod1.scale) * self.img_norm1(img) + img_mod1.shift
        img_q, img_k, img_v = split_qkv(self.img_attn.qkv(img_modulated), self.num_heads)
        img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)

        txt_modulated = (1 + txt_mod1.scale) * self.txt_norm1(txt) + txt_mod1.shift
        txt_q, txt_k, txt_v = split_qkv(self.txt_attn.qkv(txt_modulated), self.num_heads)
        txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)

        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)

        # make attention mask if not None
        attn_mask = None
        if txt_attention_mask is not None:
            if FIXED:
                # F.scaled_dot_product_attention expects attn_mask to be bool for binary mask
                attn_mask = txt_attention_mask.to(torch.bool)  # b, seq_len
                attn_mask = torch.cat(
                    (attn_mask, torch.ones(attn_mask.shape[0], img.shape[1], device=attn_mask.device, dtype=torch.bool)), dim=1
                )  # b, seq_len + img_len
            else:
                attn_mask = txt_attention_mask  # b, seq_len
                attn_mask = torch.cat(
                    (attn_mask, torch.ones(attn_mask.shape[0], img.shape[1]).to(attn_mask.device)), dim=1
                )  # b, seq_len + img_len
            # broadcast attn_mask to all heads
            attn_mask = attn_mask[:, None, None, :].expand(-1, q.shape[1], q.shape[2], -1)

        attn = attention(q, k, v, pe=pe, attn_mask=attn_mask)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1]:]

        img = img + img_mod1.gate * self.img_attn.proj(img_attn)
        img = img + img_mod2.gate * self.img_mlp((1 + img_mod2.scale) * self.img_norm2(img) + img_mod2.shift)
        txt = txt + txt_mod1.gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt_mod2.gate * self.txt_mlp((1 + txt_mod2.scale) * self.txt_norm2(txt) + txt_mod2.shift)
        return img, txt


class LastLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x, vec):
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        x = (1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :]
        return self.linear(x)


class Flux(nn.Module):
    # depth_single_blocks=0: at this commit SingleStreamBlock took no txt_attention_mask at all (that is the
    # separate bug fixed later in 2e89cd2c), so the reproduction keeps only the double blocks this fix touched.
    def __init__(self, in_channels=16, vec_in_dim=24, context_in_dim=48, hidden_size=64, num_heads=4, depth=2,
                 axes_dim=(4, 6, 6), theta=10000):
        super().__init__()
        self.in_channels = in_channels
        self.pe_embedder = EmbedND(dim=hidden_size // num_heads, theta=theta, axes_dim=list(axes_dim))
        self.img_in = nn.Linear(in_channels, hidden_size, bias=True)
        self.time_in = MLPEmbedder(in_dim=256, hidden_dim=hidden_size)
        self.vector_in = MLPEmbedder(vec_in_dim, hidden_size)
        self.txt_in = nn.Linear(context_in_dim, hidden_size)
        self.double_blocks = nn.ModuleList([DoubleStreamBlock(hidden_size, num_heads, 4.0, qkv_bias=True)
                                            for _ in range(depth)])
        self.final_layer = LastLayer(hidden_size, 1, in_channels)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, txt_attention_mask=None):
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256))
        vec = vec + self.vector_in(y)
        txt = self.txt_in(txt)
        ids = torch.cat((txt_ids, img_ids), dim=1)
        pe = self.pe_embedder(ids)
        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe, txt_attention_mask=txt_attention_mask)
        return self.final_layer(img, vec)


model = Flux().eval()
B, L_txt, L_img = 2, 16, 16
lengths = [11, 5]
t5_out = torch.randn(B, L_txt, 48)                     # T5 hidden states, pad rows nonzero
t5_attn_mask = torch.zeros(B, L_txt, dtype=torch.long)  # tokenizer attention_mask (int64)
for i, n in enumerate(lengths):
    t5_attn_mask[i, :n] = 1
noisy = torch.randn(B, L_img, 16)
img_ids = torch.zeros(B, L_img, 3)
img_ids[..., 1] = torch.arange(L_img).div(4, rounding_mode="floor").float()[None]
img_ids[..., 2] = (torch.arange(L_img) % 4).float()[None]
txt_ids = torch.zeros(B, L_txt, 3)
timesteps = torch.tensor([0.3, 0.8])
l_pooled = torch.randn(B, 24)

with torch.no_grad():
    # flux_train_network: model_pred = unet(..., txt_attention_mask=t5_attn_mask) when --apply_t5_attn_mask
    pred = model(noisy, img_ids, t5_out, txt_ids, timesteps, l_pooled, txt_attention_mask=t5_attn_mask)
    # reference: each sample alone with its T5 output cut to the real tokens (no padding, no mask)
    ref = torch.cat([model(noisy[i:i + 1], img_ids[i:i + 1], t5_out[i:i + 1, :n], txt_ids[i:i + 1, :n],
                           timesteps[i:i + 1], l_pooled[i:i + 1]) for i, n in enumerate(lengths)])
print(f"max |padded+masked prediction - unpadded per-sample prediction| = {(pred - ref).abs().max().item():.6f}")
