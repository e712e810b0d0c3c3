"""sgl-project/sglang#30241 ("[diffusion] Fix ragged-caption dynamic-batching accuracy bug in Ernie-Image", merged;
follow-up to #29742): with `--batching-mode dynamic`, requests whose captions have different real lengths are merged
into one batch and their Mistral3 caption hidden states are right-padded to a shared length. ErnieImagePipelineConfig
`_prepare_cond_kwargs` kept only `txt_seq_lens = [prompt_embeds[0].shape[1]]`, and the single-stream DiT's forward()
had no attention-mask parameter: the joint [image, text] self-attention (USPAttention) let every image token of the
shorter request attend its padded caption tail. The fix records per-request `prompt_seq_lens`, hands the DiT
`encoder_hidden_states_mask`, and the DiT builds a [B, S] key mask (image tokens all valid) and `build_varlen_mask_meta`
for USPAttention's varlen flash path.
Reduced: runtime/models/dits/ernie_image.py (pre-fix file; mask path from the merged one, fused kernels left out),
configs/pipeline_configs/ernie_image.py `_prepare_cond_kwargs` (rotary_emb None branch), a tiny ErnieImageDitConfig;
USPAttention is SDPA, and its varlen path is flash_attn_varlen_func emulated per cu_seqlens segment; diffusers'
Timesteps / TimestepEmbedding, RMSNorm and the parallel linears are written in plain torch. As upstream, the image
tokens' RoPE index stays the padded Tmax after the fix."""
import math
import sys
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- configs/models/dits/ernie_image.py (tiny) ----
@dataclass
class ErnieImageArchConfig:
    hidden_size: int = 32
    num_attention_heads: int = 2
    attention_head_dim: int = 16
    num_layers: int = 2
    in_channels: int = 8
    out_channels: int = 8
    patch_size: int = 1
    text_in_dim: int = 24
    ffn_hidden_size: int = 64
    eps: float = 1e-6
    qk_layernorm: bool = True
    rope_theta: int = 256
    rope_axes_dim: Tuple[int, int, int] = (8, 4, 4)


# ---- diffusers.models.embeddings ----
class Timesteps(nn.Module):
    def __init__(self, num_channels, flip_sin_to_cos, downscale_freq_shift):
        super().__init__()
        self.num_channels = num_channels
        self.flip_sin_to_cos = flip_sin_to_cos
        self.downscale_freq_shift = downscale_freq_shift

    def forward(self, timesteps):
        half_dim = self.num_channels // 2
        exponent = -math.log(10000) * torch.arange(half_dim, dtype=torch.float32) / (half_dim - self.downscale_freq_shift)
        emb = timesteps[:, None].float() * torch.exp(exponent)[None, :]
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
        if self.flip_sin_to_cos:
            emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
        return emb


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels, time_embed_dim):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample):
        return self.linear_2(self.act(self.linear_1(sample)))


# ---- runtime/layers/attention/layer.py ----
def build_varlen_mask_meta(key_mask: torch.Tensor) -> dict:
    assert key_mask.dim() == 2, "key_mask must be [B, S]"
    bs, seq = key_mask.shape
    bool_mask = key_mask.to(dtype=torch.bool)
    valid_lens = bool_mask.sum(dim=1, dtype=torch.int32)
    indices = bool_mask.reshape(-1).nonzero(as_tuple=False).flatten()
    cu_seqlens = torch.zeros(bs + 1, dtype=torch.int32, device=key_mask.device)
    cu_seqlens[1:] = torch.cumsum(valid_lens, dim=0)
    return {"cu_seqlens": cu_seqlens, "indices": indices, "max_seqlen": int(valid_lens.max())}


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    # [total, H, D] packed; one segment per sequence (plain-torch stand-in for the FA kernel)
    out = torch.empty_like(q)
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        ks, ke = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        o = F.scaled_dot_product_attention(
            q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1), is_causal=causal
        )
        out[qs:qe] = o.transpose(0, 1)
    return out


class USPAttention(nn.Module):
    def __init__(self, num_heads, head_size, prefix=""):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size

    def forward(self, q, k, v, attn_mask=None, attn_mask_meta=None):
        # q, k, v: [B, S, H, D]
        B, S, H, D = q.shape
        if attn_mask_meta is not None:
            idx = attn_mask_meta["indices"]
            cu = attn_mask_meta["cu_seqlens"]
            mx = attn_mask_meta["max_seqlen"]
            q_u, k_u, v_u = (t.reshape(B * S, H, D)[idx] for t in (q, k, v))
            o_u = flash_attn_varlen_func(q_u, k_u, v_u, cu, cu, mx, mx, causal=False)
            out = torch.zeros(B * S, H, D, dtype=q.dtype)
            out[idx] = o_u  # masked query rows zero-filled
            return out.view(B, S, H, D)
        mask = None if attn_mask is None else attn_mask[:, None, None, :].to(torch.bool)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )
        return out.transpose(1, 2)


def apply_qk_norm(q, k, q_norm, k_norm, head_dim):
    return q_norm(q), k_norm(k)


# ---- runtime/models/dits/ernie_image.py ----
def _rope(pos: torch.Tensor, dim: int, theta: int) -> torch.Tensor:
    assert dim % 2 == 0
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos, omega)
    return out.float()


class EmbedND3(nn.Module):
    """3D rotary positional embedding for (temporal/batch_idx, height, width)."""

    def __init__(self, dim: int, theta: int, axes_dim: Tuple[int, int, int]):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.axes_dim = list(axes_dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        emb = torch.cat([_rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(3)], dim=-1)
        emb = emb.unsqueeze(1).permute(2, 0, 1, 3)
        return torch.stack([emb, emb], dim=-1).reshape(*emb.shape[:-1], -1)


def _apply_rotary_bshd(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    freqs = freqs.permute(1, 0, 2, 3)
    rot_dim = freqs.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos_ = torch.cos(freqs).to(x.dtype)
    sin_ = torch.sin(freqs).to(x.dtype)
    x1, x2 = x_rot.chunk(2, dim=-1)
    x_rotated = torch.cat((-x2, x1), dim=-1)
    x_rot = x_rot * cos_ + x_rotated * sin_
    return torch.cat((x_rot, x_pass), dim=-1)


class ErnieImageSelfAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, head_dim, eps=1e-6, qk_layernorm=True, prefix=""):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.num_local_heads = num_heads  # tp_size == 1
        self.to_q = nn.Linear(hidden_size, hidden_size, bias=False)
        self.to_k = nn.Linear(hidden_size, hidden_size, bias=False)
        self.to_v = nn.Linear(hidden_size, hidden_size, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(hidden_size, hidden_size, bias=False)])
        self.qk_layernorm = qk_layernorm
        if qk_layernorm:
            self.norm_q = nn.RMSNorm(head_dim, eps=eps)
            self.norm_k = nn.RMSNorm(head_dim, eps=eps)
        self.attn = USPAttention(num_heads=self.num_local_heads, head_size=head_dim, prefix=f"{prefix}.attn")

    def forward(self, x, rotary_pos_emb, attn_mask=None, attn_mask_meta=None):
        B, S, H = x.shape
        q = self.to_q(x).view(B, S, self.num_local_heads, self.head_dim)
        k = self.to_k(x).view(B, S, self.num_local_heads, self.head_dim)
        v = self.to_v(x).view(B, S, self.num_local_heads, self.head_dim)
        if self.qk_layernorm:
            q, k = apply_qk_norm(q, k, self.norm_q, self.norm_k, self.head_dim)
        q = _apply_rotary_bshd(q, rotary_pos_emb)
        k = _apply_rotary_bshd(k, rotary_pos_emb)
        if FIXED:
            attn_out = self.attn(q, k, v, attn_mask=attn_mask, attn_mask_meta=attn_mask_meta)
        else:
            attn_out = self.attn(q, k, v)
        attn_out = attn_out.reshape(B, S, self.num_local_heads * self.head_dim)
        return self.to_out[0](attn_out)


class ErnieImageMLP(nn.Module):
    def __init__(self, hidden_size, ffn_hidden_size, prefix=""):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.linear_fc2(up * F.gelu(gate))


class ErnieImageSharedAdaLNBlock(nn.Module):
    """Single-stream transformer block with externally-computed Shared AdaLN."""

    def __init__(self, hidden_size, num_heads, head_dim, ffn_hidden_size, eps=1e-6, qk_layernorm=True, prefix=""):
        super().__init__()
        self.adaLN_sa_ln = nn.RMSNorm(hidden_size, eps=eps)
        self.self_attention = ErnieImageSelfAttention(
            hidden_size, num_heads, head_dim, eps, qk_layernorm, prefix=f"{prefix}.self_attention"
        )
        self.adaLN_mlp_ln = nn.RMSNorm(hidden_size, eps=eps)
        self.mlp = ErnieImageMLP(hidden_size, ffn_hidden_size, prefix=f"{prefix}.mlp")

    def forward(self, x, rotary_pos_emb, shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
                attn_mask=None, attn_mask_meta=None):
        residual = x
        x = self.adaLN_sa_ln(x) * (1 + scale_msa) + shift_msa
        x = residual + gate_msa * self.self_attention(
            x, rotary_pos_emb, attn_mask=attn_mask, attn_mask_meta=attn_mask_meta
        )
        residual = x
        x = self.adaLN_mlp_ln(x) * (1 + scale_mlp) + shift_mlp
        x = residual + gate_mlp * self.mlp(x)
        return x


class ErnieImageTransformer2DModel(nn.Module):
    """ErnieImage DiT: Single-stream transformer with Shared AdaLN."""

    def __init__(self, arch: ErnieImageArchConfig):
        super().__init__()
        self.hidden_size = arch.hidden_size
        self.num_attention_heads = arch.num_attention_heads
        self.head_dim = arch.attention_head_dim
        self.num_layers = arch.num_layers
        self.patch_size = arch.patch_size
        self.out_channels = arch.out_channels
        self.inner_dim = self.hidden_size
        self.x_embedder = nn.ModuleDict(
            {"proj": nn.Conv2d(arch.in_channels, self.inner_dim, kernel_size=arch.patch_size,
                               stride=arch.patch_size, bias=True)}
        )
        if arch.text_in_dim != self.inner_dim:
            self.text_proj = nn.Linear(arch.text_in_dim, self.inner_dim, bias=False)
        else:
            self.text_proj = None
        self.time_proj = Timesteps(self.inner_dim, flip_sin_to_cos=False, downscale_freq_shift=0)
        self.time_embedding = TimestepEmbedding(in_channels=self.inner_dim, time_embed_dim=self.inner_dim)
        self.pos_embed = EmbedND3(dim=self.head_dim, theta=arch.rope_theta, axes_dim=arch.rope_axes_dim)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(self.inner_dim, 6 * self.inner_dim))
        self.layers = nn.ModuleList(
            [
                ErnieImageSharedAdaLNBlock(
                    hidden_size=self.inner_dim, num_heads=self.num_attention_heads, head_dim=self.head_dim,
                    ffn_hidden_size=arch.ffn_hidden_size, eps=arch.eps, qk_layernorm=arch.qk_layernorm,
                    prefix=f"layers.{i}",
                )
                for i in range(self.num_layers)
            ]
        )
        self.final_norm = nn.ModuleDict(
            {
                "norm": nn.LayerNorm(self.inner_dim, elementwise_affine=False, eps=arch.eps),
                "linear": nn.Linear(self.inner_dim, self.inner_dim * 2),
            }
        )
        self.final_linear = nn.Linear(self.inner_dim, arch.patch_size * arch.patch_size * self.out_channels, bias=True)

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_hidden_states_image=None,
                guidance=None, encoder_hidden_states_mask=None, **kwargs):
        device, dtype = hidden_states.device, hidden_states.dtype
        B, C, H, W = hidden_states.shape
        p = self.patch_size
        Hp, Wp = H // p, W // p
        N_img = Hp * Wp

        img_tokens = self.x_embedder["proj"](hidden_states)  # [B, D, Hp, Wp]
        img_tokens = img_tokens.reshape(B, self.inner_dim, N_img).transpose(1, 2)  # [B, N_img, D]

        if isinstance(encoder_hidden_states, (list, tuple)):
            encoder_hidden_states = encoder_hidden_states[0]
        text_tokens = encoder_hidden_states  # [B, T, text_dim]
        if self.text_proj is not None and text_tokens.numel() > 0:
            text_tokens = self.text_proj(text_tokens)
        Tmax = text_tokens.shape[1]

        x = torch.cat([img_tokens, text_tokens], dim=1)  # [B, S, D]

        grid_yx = torch.stack(
            torch.meshgrid(
                torch.arange(Hp, device=device, dtype=torch.float32),
                torch.arange(Wp, device=device, dtype=torch.float32),
                indexing="ij",
            ),
            dim=-1,
        ).reshape(-1, 2)
        image_ids = torch.cat(
            [
                torch.full((B, N_img, 1), Tmax, device=device, dtype=torch.float32),
                grid_yx.view(1, N_img, 2).expand(B, -1, -1),
            ],
            dim=-1,
        )
        if Tmax > 0:
            text_ids = torch.cat(
                [
                    torch.arange(Tmax, device=device, dtype=torch.float32).view(1, Tmax, 1).expand(B, -1, -1),
                    torch.zeros((B, Tmax, 2), device=device),
                ],
                dim=-1,
            )
        else:
            text_ids = torch.zeros((B, 0, 3), device=device)
        all_ids = torch.cat([image_ids, text_ids], dim=1)
        rotary_pos_emb = self.pos_embed(all_ids)

        attn_mask = attn_mask_meta = None
        if FIXED and encoder_hidden_states_mask is not None:
            image_mask = torch.ones((B, N_img), dtype=torch.bool, device=device)
            attn_mask = torch.cat(
                [image_mask, encoder_hidden_states_mask.to(device=device, dtype=torch.bool)], dim=1
            )
            attn_mask_meta = build_varlen_mask_meta(attn_mask)

        t_emb = self.time_proj(timestep.to(dtype))
        c = self.time_embedding(t_emb.to(dtype=dtype))
        mod_params = self.adaLN_modulation(c)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            t.unsqueeze(1) for t in mod_params.chunk(6, dim=-1)
        )

        for layer in self.layers:
            x = layer(x, rotary_pos_emb, shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp,
                      attn_mask=attn_mask, attn_mask_meta=attn_mask_meta)

        scale, shift = self.final_norm["linear"](c).chunk(2, dim=-1)
        x = self.final_norm["norm"](x) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)
        patches = self.final_linear(x[:, :N_img, :])
        output = patches.view(B, Hp, Wp, p, p, self.out_channels)
        output = output.permute(0, 5, 1, 3, 2, 4).contiguous()
        output = output.view(B, self.out_channels, H, W)
        return output


# ---- dynamic batching: merge requests, pad their caption hidden states to a shared length ----
class Req:
    def __init__(self, prompt_embeds, latents):
        self.prompt_embeds = [prompt_embeds]  # one text encoder; [1, T_i, text_dim], tokenized with padding=False
        self.latents = latents
        self.height = latents.shape[-2] * 16
        self.width = latents.shape[-1] * 16
        self.prompt_seq_lens = None


def merge_requests(reqs):
    tmax = max(r.prompt_embeds[0].shape[1] for r in reqs)
    padded = [F.pad(r.prompt_embeds[0], (0, 0, 0, tmax - r.prompt_embeds[0].shape[1])) for r in reqs]
    batch = Req(torch.cat(padded, dim=0), torch.cat([r.latents for r in reqs], dim=0))
    batch.prompt_seq_lens = [[r.prompt_embeds[0].shape[1] for r in reqs]]
    return batch


# ---- configs/pipeline_configs/ernie_image.py ----
class ErnieImagePipelineConfig:
    def get_vae_scale_factor(self):
        return 16

    def require_text_seq_lens(self, batch, encoder_index, *, expected_batch_size=None):
        seq_lens = [int(x) for x in batch.prompt_seq_lens[encoder_index]]
        assert expected_batch_size is None or len(seq_lens) == expected_batch_size
        return seq_lens

    def _prepare_cond_kwargs(self, batch, prompt_embeds, rotary_emb, device, dtype):
        batch_size = prompt_embeds[0].shape[0]
        height = batch.height
        width = batch.width
        vae_scale_factor = self.get_vae_scale_factor()
        img_shapes = [[(1, height // vae_scale_factor, width // vae_scale_factor)]] * batch_size
        if FIXED:
            txt_seq_lens = self.require_text_seq_lens(batch, 0, expected_batch_size=batch_size)
            positions = torch.arange(prompt_embeds[0].shape[1], device=device).unsqueeze(0)
            encoder_hidden_states_mask = positions < torch.tensor(txt_seq_lens, device=device).unsqueeze(1)
            return {
                "img_shapes": img_shapes,
                "txt_seq_lens": txt_seq_lens,
                "freqs_cis": None,
                "encoder_hidden_states_mask": encoder_hidden_states_mask,
            }
        txt_seq_lens = [prompt_embeds[0].shape[1]]
        return {"img_shapes": img_shapes, "txt_seq_lens": txt_seq_lens, "freqs_cis": None}


def main():
    arch = ErnieImageArchConfig()
    dit = ErnieImageTransformer2DModel(arch).eval()
    pipeline_config = ErnieImagePipelineConfig()

    # two requests with captions of 7 and 3 real tokens (Mistral3 hidden_states[-2]); 4x4 patchified latents
    reqs = [Req(torch.randn(1, n, arch.text_in_dim), torch.randn(1, arch.in_channels, 4, 4)) for n in (7, 3)]
    batch = merge_requests(reqs)
    cond = pipeline_config._prepare_cond_kwargs(batch, batch.prompt_embeds, None, "cpu", torch.float32)
    timestep = torch.full((2,), 500.0)
    with torch.no_grad():
        noise_pred = dit(
            hidden_states=batch.latents,
            encoder_hidden_states=batch.prompt_embeds,
            timestep=timestep,
            encoder_hidden_states_mask=cond.get("encoder_hidden_states_mask"),
        )
    print(f"fixed={FIXED} txt_seq_lens={cond['txt_seq_lens']}")
    for i in range(2):
        print(f"request {i}: noise_pred[0, 0, :2] = {[round(v, 5) for v in noise_pred[i, 0, 0, :2].tolist()]}")


if __name__ == "__main__":
    main()
