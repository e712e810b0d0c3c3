"""pytorch/torchtitan#2297 (fixed by #2309, commit fdd3a37a0, and #3823, commit 952427842): torchtitan's FLUX
model (imported from black-forest-labs/FLUX) runs every attention through ScaledDotProductAttentionWrapper, whose
forward hard-codes `F.scaled_dot_product_attention(q, k, v, is_causal=True)`. FLUX is a DiT: the joint
[txt, img] attention of the double- and single-stream blocks must be bidirectional, as in BFL's flux/math.py.
#2309 exposed the flag on the wrapper (spelt `is_casual`) and passed False from SelfAttention.forward; the joint
calls of DoubleStreamBlock / SingleStreamBlock got `is_causal=False` in #3823. `--fixed` passes False at all three.
Reduced: models/flux/model/{layers,model}.py and utils.py at fdd3a37a0^ with a tiny FluxModelArgs, one
forward_backward_step of train.py on random latents / T5 / CLIP encodings; einops.rearrange written as
reshape + permute (patterns kept in comments)."""
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn, Tensor
from torch.nn.attention import sdpa_kernel, SDPBackend

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- torchtitan/models/attention.py ----
class ScaledDotProductAttentionWrapper(torch.nn.Module):
    sdpa_backends: list[SDPBackend] = []

    def __init__(self) -> None:
        super().__init__()
        if not self.sdpa_backends:
            self.sdpa_backends = [
                SDPBackend.CUDNN_ATTENTION,
                SDPBackend.FLASH_ATTENTION,
                SDPBackend.MATH,
            ]

    if FIXED:

        def forward(self, q, k, v, *, scale=None, enable_gqa=False, is_casual: bool = True):
            with sdpa_kernel(self.sdpa_backends, set_priority=True):
                return F.scaled_dot_product_attention(
                    q, k, v, scale=scale, is_causal=is_casual, enable_gqa=enable_gqa
                )

    else:

        def forward(self, q, k, v, *, scale=None, enable_gqa=False):
            with sdpa_kernel(self.sdpa_backends, set_priority=True):
                return F.scaled_dot_product_attention(
                    q, k, v, scale=scale, is_causal=True, enable_gqa=enable_gqa
                )


def _attend(inner_attention, q, k, v):
    if FIXED:
        return inner_attention(q, k, v, is_casual=False)
    return inner_attention(q, k, v)


# ---- torchtitan/models/flux/model/layers.py ----
def split_qkv(qkv: Tensor, num_heads: int):
    # rearrange(qkv, "B L (K H D) -> K B H L D", K=3, H=num_heads)
    B, L, _ = qkv.shape
    return qkv.reshape(B, L, 3, num_heads, -1).permute(2, 0, 3, 1, 4)


def merge_heads(x: Tensor) -> Tensor:
    # rearrange(x, "B H L D -> B L (H D)")
    B, H, L, D = x.shape
    return x.permute(0, 2, 1, 3).reshape(B, L, H * D)


def rope(pos: Tensor, dim: int, theta: int) -> Tensor:
    assert dim % 2 == 0
    scale = torch.arange(0, dim, 2, dtype=pos.dtype, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos, omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    out = out.reshape(*out.shape[:-1], 2, 2)  # "b n d (i j) -> b n d i j"
    return out.float()


def apply_rope(xq: Tensor, xk: Tensor, freqs_cis: Tensor) -> tuple[Tensor, Tensor]:
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


class EmbedND(nn.Module):
    def __init__(self, dim: int, theta: int, axes_dim: Sequence[int]):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.axes_dim = axes_dim

    def forward(self, ids: Tensor) -> Tensor:
        n_axes = ids.shape[-1]
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3)
        return emb.unsqueeze(1)


def timestep_embedding(t: Tensor, dim, max_period=10000, time_factor: float = 1000.0):
    t = time_factor * t
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    if torch.is_floating_point(t):
        embedding = embedding.to(t)
    return embedding


class MLPEmbedder(nn.Module):
    def __init__(self, in_dim: int, hidden_dim: int):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=True)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_layer(self.silu(self.in_layer(x)))


class QKNorm(torch.nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.query_norm = nn.RMSNorm(dim)
        self.key_norm = nn.RMSNorm(dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        q = self.query_norm(q)
        k = self.key_norm(k)
        return q.to(v), k.to(v)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int = 8, qkv_bias: bool = False):
        super().__init__()
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(head_dim)
        self.proj = nn.Linear(dim, dim)
        self.inner_attention = ScaledDotProductAttentionWrapper()

    def forward(self, x: Tensor, pe: Tensor) -> Tensor:
        qkv = self.qkv(x)
        q, k, v = split_qkv(qkv, self.num_heads)
        q, k = self.norm(q, k, v)
        q, k = apply_rope(q, k, pe)
        x = _attend(self.inner_attention, q, k, v)
        x = merge_heads(x)
        x = self.proj(x)
        return x


@dataclass
class ModulationOut:
    shift: Tensor
    scale: Tensor
    gate: Tensor


class Modulation(nn.Module):
    def __init__(self, dim: int, double: bool):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=True)

    def forward(self, vec: Tensor):
        out = self.lin(nn.functional.silu(vec))[:, None, :].chunk(self.multiplier, dim=-1)
        return ModulationOut(*out[:3]), ModulationOut(*out[3:]) if self.is_double else None


class DoubleStreamBlock(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float, qkv_bias: bool = False):
        super().__init__()
        mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.img_mod = Modulation(hidden_size, double=True)
        self.img_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_attn = SelfAttention(dim=hidden_size, num_heads=num_heads, qkv_bias=qkv_bias)
        self.img_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.img_mlp = nn.Sequential(
            nn.Linear(hidden_size, mlp_hidden_dim, bias=True),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_hidden_dim, hidden_size, bias=True),
        )
        self.txt_mod = Modulation(hidden_size, double=True)
        self.txt_norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_attn = SelfAttention(dim=hidden_size, num_heads=num_heads, qkv_bias=qkv_bias)
        self.txt_norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.txt_mlp = nn.Sequential(
            nn.Linear(hidden_size, mlp_hidden_dim, bias=True),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_hidden_dim, hidden_size, bias=True),
        )
        self.inner_attention = ScaledDotProductAttentionWrapper()

    def forward(self, img: Tensor, txt: Tensor, vec: Tensor, pe: Tensor) -> tuple[Tensor, Tensor]:
        img_mod1, img_mod2 = self.img_mod(vec)
        txt_mod1, txt_mod2 = self.txt_mod(vec)

        # prepare image for attention
        img_modulated = self.img_norm1(img)
        img_modulated = (1 + img_mod1.scale) * img_modulated + img_mod1.shift
        img_qkv = self.img_attn.qkv(img_modulated)
        img_q, img_k, img_v = split_qkv(img_qkv, self.num_heads)
        img_q, img_k = self.img_attn.norm(img_q, img_k, img_v)

        # prepare txt for attention
        txt_modulated = self.txt_norm1(txt)
        txt_modulated = (1 + txt_mod1.scale) * txt_modulated + txt_mod1.shift
        txt_qkv = self.txt_attn.qkv(txt_modulated)
        txt_q, txt_k, txt_v = split_qkv(txt_qkv, self.num_heads)
        txt_q, txt_k = self.txt_attn.norm(txt_q, txt_k, txt_v)

        # run actual attention
        q = torch.cat((txt_q, img_q), dim=2)
        k = torch.cat((txt_k, img_k), dim=2)
        v = torch.cat((txt_v, img_v), dim=2)

        q, k = apply_rope(q, k, pe)
        attn = _attend(self.inner_attention, q, k, v)
        attn = merge_heads(attn)

        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]

        # calculate the img blocks
        img = img + img_mod1.gate * self.img_attn.proj(img_attn)
        img = img + img_mod2.gate * self.img_mlp((1 + img_mod2.scale) * self.img_norm2(img) + img_mod2.shift)

        # calculate the txt blocks
        txt = txt + txt_mod1.gate * self.txt_attn.proj(txt_attn)
        txt = txt + txt_mod2.gate * self.txt_mlp((1 + txt_mod2.scale) * self.txt_norm2(txt) + txt_mod2.shift)
        return img, txt


class SingleStreamBlock(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0, qk_scale: float | None = None):
        super().__init__()
        self.hidden_dim = hidden_size
        self.num_heads = num_heads
        head_dim = hidden_size // num_heads
        self.scale = qk_scale or head_dim**-0.5
        self.mlp_hidden_dim = int(hidden_size * mlp_ratio)
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size)
        self.norm = QKNorm(head_dim)
        self.hidden_size = hidden_size
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.modulation = Modulation(hidden_size, double=False)
        self.inner_attention = ScaledDotProductAttentionWrapper()

    def forward(self, x: Tensor, vec: Tensor, pe: Tensor) -> Tensor:
        mod, _ = self.modulation(vec)
        x_mod = (1 + mod.scale) * self.pre_norm(x) + mod.shift
        qkv, mlp = torch.split(self.linear1(x_mod), [3 * self.hidden_size, self.mlp_hidden_dim], dim=-1)

        q, k, v = split_qkv(qkv, self.num_heads)
        q, k = self.norm(q, k, v)

        # compute attention
        q, k = apply_rope(q, k, pe)
        attn = _attend(self.inner_attention, q, k, v)
        attn = merge_heads(attn)

        # compute activation in mlp stream, cat again and run second linear layer
        output = self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
        return x + mod.gate * output


class LastLayer(nn.Module):
    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, vec: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=1)
        x = (1 + scale[:, None, :]) * self.norm_final(x) + shift[:, None, :]
        x = self.linear(x)
        return x


# ---- torchtitan/models/flux/model/args.py + model.py ----
@dataclass
class FluxModelArgs:
    in_channels: int = 16
    out_channels: int = 16
    vec_in_dim: int = 8
    context_in_dim: int = 12
    hidden_size: int = 32
    mlp_ratio: float = 4.0
    num_heads: int = 2
    depth: int = 1
    depth_single_blocks: int = 1
    axes_dim: tuple = (4, 6, 6)
    theta: int = 10_000
    qkv_bias: bool = True


class FluxModel(nn.Module):
    def __init__(self, model_args: FluxModelArgs):
        super().__init__()
        self.model_args = model_args
        self.in_channels = model_args.in_channels
        self.out_channels = model_args.out_channels
        pe_dim = model_args.hidden_size // model_args.num_heads
        if sum(model_args.axes_dim) != pe_dim:
            raise ValueError(f"Got {model_args.axes_dim} but expected positional dim {pe_dim}")
        self.hidden_size = model_args.hidden_size
        self.num_heads = model_args.num_heads
        self.pe_embedder = EmbedND(dim=pe_dim, theta=model_args.theta, axes_dim=model_args.axes_dim)
        self.img_in = nn.Linear(self.in_channels, self.hidden_size, bias=True)
        self.time_in = MLPEmbedder(in_dim=256, hidden_dim=self.hidden_size)
        self.vector_in = MLPEmbedder(model_args.vec_in_dim, self.hidden_size)
        self.txt_in = nn.Linear(model_args.context_in_dim, self.hidden_size)
        self.double_blocks = nn.ModuleList(
            [
                DoubleStreamBlock(self.hidden_size, self.num_heads, mlp_ratio=model_args.mlp_ratio,
                                  qkv_bias=model_args.qkv_bias)
                for _ in range(model_args.depth)
            ]
        )
        self.single_blocks = nn.ModuleList(
            [
                SingleStreamBlock(self.hidden_size, self.num_heads, mlp_ratio=model_args.mlp_ratio)
                for _ in range(model_args.depth_single_blocks)
            ]
        )
        self.final_layer = LastLayer(self.hidden_size, 1, self.out_channels)

    def forward(self, img, img_ids, txt, txt_ids, timesteps, y):
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("Input img and txt tensors must have 3 dimensions.")
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256))
        vec = vec + self.vector_in(y)
        txt = self.txt_in(txt)

        ids = torch.cat((txt_ids, img_ids), dim=1)
        pe = self.pe_embedder(ids)

        for block in self.double_blocks:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe)

        img = torch.cat((txt, img), 1)
        for block in self.single_blocks:
            img = block(img, vec=vec, pe=pe)
        img = img[:, txt.shape[1] :, ...]

        img = self.final_layer(img, vec)
        return img


# ---- torchtitan/models/flux/utils.py ----
def create_position_encoding_for_latents(bsz, latent_height, latent_width, position_dim=3):
    PATCH_HEIGHT, PATCH_WIDTH = 2, 2
    height = latent_height // PATCH_HEIGHT
    width = latent_width // PATCH_WIDTH
    position_encoding = torch.zeros(height, width, position_dim)
    row_indices = torch.arange(height)
    position_encoding[:, :, 1] = row_indices.unsqueeze(1)
    col_indices = torch.arange(width)
    position_encoding[:, :, 2] = col_indices.unsqueeze(0)
    position_encoding = position_encoding.view(1, height * width, position_dim)
    position_encoding = position_encoding.repeat(bsz, 1, 1)
    return position_encoding


def pack_latents(x: Tensor) -> Tensor:
    PATCH_HEIGHT, PATCH_WIDTH = 2, 2
    b, c, latent_height, latent_width = x.shape
    h = latent_height // PATCH_HEIGHT
    w = latent_width // PATCH_WIDTH
    x = x.unfold(2, PATCH_HEIGHT, PATCH_HEIGHT).unfold(3, PATCH_WIDTH, PATCH_WIDTH)
    x = x.permute(0, 2, 3, 1, 4, 5)
    return x.reshape(b, h * w, c * PATCH_HEIGHT * PATCH_WIDTH)


# ---- torchtitan/models/flux/train.py: FluxTrainer.forward_backward_step ----
def forward_backward_step(model, labels, t5_encodings, clip_encodings):
    local_valid_tokens = torch.tensor(labels.numel(), dtype=torch.float32)
    global_valid_tokens = local_valid_tokens.float()
    bsz = labels.shape[0]
    with torch.no_grad():
        noise = torch.randn_like(labels)
        timesteps = torch.rand((bsz,))
        sigmas = timesteps.view(-1, 1, 1, 1)
        latents = (1 - sigmas) * labels + sigmas * noise

    bsz, _, latent_height, latent_width = latents.shape
    POSITION_DIM = 3
    with torch.no_grad():
        latent_pos_enc = create_position_encoding_for_latents(bsz, latent_height, latent_width, POSITION_DIM)
        text_pos_enc = torch.zeros(bsz, t5_encodings.shape[1], POSITION_DIM)
        latents = pack_latents(latents)
        target = pack_latents(noise - labels)

    latent_noise_pred = model(
        img=latents,
        img_ids=latent_pos_enc,
        txt=t5_encodings,
        txt_ids=text_pos_enc,
        y=clip_encodings,
        timesteps=timesteps,
    )
    loss = F.mse_loss(latent_noise_pred, target, reduction="sum") / global_valid_tokens
    loss.backward()
    return loss, latent_noise_pred.detach()


def main():
    args = FluxModelArgs()
    model = FluxModel(args)
    bsz = 2
    labels = torch.randn(bsz, args.in_channels // 4, 8, 8)  # autoencoder latents: 4 ch, 8x8 -> 16 patches
    t5_encodings = torch.randn(bsz, 6, args.context_in_dim)  # T5 hidden states, max_length 6
    clip_encodings = torch.randn(bsz, args.vec_in_dim)  # pooled CLIP
    loss, pred = forward_backward_step(model, labels, t5_encodings, clip_encodings)
    print(f"fixed={FIXED} loss={loss.item():.6f}")
    print("first image patch prediction[:4]:", [round(v, 5) for v in pred[0, 0, :4].tolist()])


if __name__ == "__main__":
    main()
