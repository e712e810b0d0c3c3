# bghira/SimpleTuner commit b7e1c2c35 (PR #908): "Swap the attention mask location, because Flux swapped text and image versus other models"
# helpers/models/flux/transformer.py, FluxTransformer2DModelWithMasking (--flux_attention_masked_training).
# Flux joins the sequence as [text, image], but expand_flux_attention_mask wrote the T5 padding mask into the LAST
# mask_seq_len positions (as if text came after the image), and the double block sized it from cat([image, text])
# So the T5 pad tokens stayed fully visible and the tail image tokens got the pad mask instead. The fix writes the T5
# mask into the first mask_seq_len positions (expanded_mask[:, :mask_seq_len]) and sizes it from cat([text, image]).
# (Like the upstream code at both commits, the processor turns the mask back into a float 0/1 tensor for SDPA.)
import sys
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- pieces of diffusers (2024-08) that SimpleTuner's masked Flux transformer imports -------------------------------
def apply_rope(xq, xk, freqs_cis):
    xq_ = xq.float().reshape(*xq.shape[:-1], -1, 1, 2)
    xk_ = xk.float().reshape(*xk.shape[:-1], -1, 1, 2)
    xq_out = freqs_cis[..., 0] * xq_[..., 0] + freqs_cis[..., 1] * xq_[..., 1]
    xk_out = freqs_cis[..., 0] * xk_[..., 0] + freqs_cis[..., 1] * xk_[..., 1]
    return xq_out.reshape(*xq.shape).type_as(xq), xk_out.reshape(*xk.shape).type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, query_dim, dim_head, heads, out_dim, processor, added_kv_proj_dim=None, pre_only=False,
                 eps=1e-6, **kwargs):
        super().__init__()
        inner = dim_head * heads
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(query_dim, inner)
        self.to_v = nn.Linear(query_dim, inner)
        self.norm_q = RMSNorm(dim_head, eps)
        self.norm_k = RMSNorm(dim_head, eps)
        if added_kv_proj_dim is not None:
            self.add_q_proj = nn.Linear(added_kv_proj_dim, inner)
            self.add_k_proj = nn.Linear(added_kv_proj_dim, inner)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, inner)
            self.norm_added_q = RMSNorm(dim_head, eps)
            self.norm_added_k = RMSNorm(dim_head, eps)
            self.to_add_out = nn.Linear(inner, out_dim)
        if not pre_only:
            self.to_out = nn.ModuleList([nn.Linear(inner, out_dim), nn.Dropout(0.0)])
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def get_timestep_embedding(timesteps, embedding_dim, max_period=10000):
    half = embedding_dim // 2
    exponent = -torch.log(torch.tensor(float(max_period))) * torch.arange(half, dtype=torch.float32) / half
    emb = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)  # flip_sin_to_cos=True


class CombinedTimestepGuidanceTextProjEmbeddings(nn.Module):
    def __init__(self, embedding_dim, pooled_projection_dim):
        super().__init__()
        self.timestep_embedder = nn.Sequential(nn.Linear(256, embedding_dim), nn.SiLU(), nn.Linear(embedding_dim, embedding_dim))
        self.guidance_embedder = nn.Sequential(nn.Linear(256, embedding_dim), nn.SiLU(), nn.Linear(embedding_dim, embedding_dim))
        self.text_embedder = nn.Sequential(nn.Linear(pooled_projection_dim, embedding_dim), nn.SiLU(), nn.Linear(embedding_dim, embedding_dim))

    def forward(self, timestep, guidance, pooled_projection):
        t = self.timestep_embedder(get_timestep_embedding(timestep, 256))
        g = self.guidance_embedder(get_timestep_embedding(guidance, 256))
        return t + g + self.text_embedder(pooled_projection)


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(self.silu(emb)).chunk(6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa = self.linear(self.silu(emb)).chunk(3, dim=1)
        return self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None], gate_msa


class AdaLayerNormContinuous(nn.Module):
    def __init__(self, dim, cond_dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(cond_dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, cond):
        scale, shift = self.linear(self.silu(cond)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]


def FeedForward(dim, dim_out):
    return nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim_out))


# ---- helpers/models/flux/transformer.py (SimpleTuner, before b7e1c2c35) ---------------------------------------------
class FluxSingleAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        batch_size, _, _ = hidden_states.shape
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        query = attn.norm_q(query)
        key = attn.norm_k(key)
        if image_rotary_emb is not None:
            query, key = apply_rope(query, key, image_rotary_emb)

        if attention_mask is not None:
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
            attention_mask = (attention_mask > 0).bool()
            attention_mask = attention_mask.to(device=hidden_states.device, dtype=hidden_states.dtype)

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, dropout_p=0.0, is_causal=False, attn_mask=attention_mask
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        return hidden_states.to(query.dtype)


class FluxAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        batch_size = encoder_hidden_states.shape[0]
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        query = attn.norm_q(query)
        key = attn.norm_k(key)

        # `context` projections.
        encoder_hidden_states_query_proj = attn.add_q_proj(encoder_hidden_states)
        encoder_hidden_states_key_proj = attn.add_k_proj(encoder_hidden_states)
        encoder_hidden_states_value_proj = attn.add_v_proj(encoder_hidden_states)
        encoder_hidden_states_query_proj = encoder_hidden_states_query_proj.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        encoder_hidden_states_key_proj = encoder_hidden_states_key_proj.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        encoder_hidden_states_value_proj = encoder_hidden_states_value_proj.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        encoder_hidden_states_query_proj = attn.norm_added_q(encoder_hidden_states_query_proj)
        encoder_hidden_states_key_proj = attn.norm_added_k(encoder_hidden_states_key_proj)

        # attention: Flux puts the text tokens first
        query = torch.cat([encoder_hidden_states_query_proj, query], dim=2)
        key = torch.cat([encoder_hidden_states_key_proj, key], dim=2)
        value = torch.cat([encoder_hidden_states_value_proj, value], dim=2)

        if image_rotary_emb is not None:
            query, key = apply_rope(query, key, image_rotary_emb)

        if attention_mask is not None:
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
            attention_mask = (attention_mask > 0).bool()
            attention_mask = attention_mask.to(device=hidden_states.device, dtype=hidden_states.dtype)

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, dropout_p=0.0, is_causal=False, attn_mask=attention_mask
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        encoder_hidden_states, hidden_states = (
            hidden_states[:, : encoder_hidden_states.shape[1]],
            hidden_states[:, encoder_hidden_states.shape[1]:],
        )
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states


def rope(pos: torch.Tensor, dim: int, theta: int) -> torch.Tensor:
    scale = torch.arange(0, dim, 2, dtype=torch.float64, device=pos.device) / dim
    omega = 1.0 / (theta**scale)
    batch_size, seq_length = pos.shape
    out = torch.einsum("...n,d->...nd", pos, omega)
    cos_out = torch.cos(out)
    sin_out = torch.sin(out)
    stacked_out = torch.stack([cos_out, -sin_out, sin_out, cos_out], dim=-1)
    out = stacked_out.view(batch_size, -1, dim // 2, 2, 2)
    return out.float()


class EmbedND(nn.Module):
    def __init__(self, dim: int, theta: int, axes_dim: List[int]):
        super().__init__()
        self.dim = dim
        self.theta = theta
        self.axes_dim = axes_dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n_axes = ids.shape[-1]
        emb = torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3)
        return emb.unsqueeze(1)


def expand_flux_attention_mask(hidden_states: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """
    Expand a mask so that the image is included.
    """
    bsz = attn_mask.shape[0]
    assert bsz == hidden_states.shape[0]
    residual_seq_len = hidden_states.shape[1]
    mask_seq_len = attn_mask.shape[1]

    expanded_mask = torch.ones(bsz, residual_seq_len)

    if FIXED:
        expanded_mask[:, :mask_seq_len] = attn_mask
    else:
        start_index = residual_seq_len - mask_seq_len
        expanded_mask[:, start_index:] = attn_mask

    return expanded_mask


class FluxSingleTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, mlp_ratio=4.0):
        super().__init__()
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, self.mlp_hidden_dim)
        self.act_mlp = nn.GELU(approximate="tanh")
        self.proj_out = nn.Linear(dim + self.mlp_hidden_dim, dim)
        self.attn = Attention(query_dim=dim, dim_head=attention_head_dim, heads=num_attention_heads, out_dim=dim,
                              processor=FluxSingleAttnProcessor2_0(), pre_only=True, eps=1e-6)

    def forward(self, hidden_states, temb, image_rotary_emb=None, attention_mask=None):
        residual = hidden_states
        norm_hidden_states, gate = self.norm(hidden_states, emb=temb)
        mlp_hidden_states = self.act_mlp(self.proj_mlp(norm_hidden_states))

        if attention_mask is not None:
            attention_mask = expand_flux_attention_mask(hidden_states, attention_mask)

        attn_output = self.attn(hidden_states=norm_hidden_states, image_rotary_emb=image_rotary_emb,
                                attention_mask=attention_mask)
        hidden_states = torch.cat([attn_output, mlp_hidden_states], dim=2)
        gate = gate.unsqueeze(1)
        hidden_states = gate * self.proj_out(hidden_states)
        return residual + hidden_states


class FluxTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, eps=1e-6):
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormZero(dim)
        self.attn = Attention(query_dim=dim, added_kv_proj_dim=dim, dim_head=attention_head_dim,
                              heads=num_attention_heads, out_dim=dim, processor=FluxAttnProcessor2_0(), eps=eps)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim=dim, dim_out=dim)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff_context = FeedForward(dim=dim, dim_out=dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_mask=None):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb
        )

        if attention_mask is not None:
            if FIXED:
                attention_mask = expand_flux_attention_mask(
                    torch.cat([encoder_hidden_states, hidden_states], dim=1),
                    attention_mask,
                )
            else:
                attention_mask = expand_flux_attention_mask(
                    torch.cat([hidden_states, encoder_hidden_states], dim=1),
                    attention_mask,
                )

        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            image_rotary_emb=image_rotary_emb,
            attention_mask=attention_mask,
        )

        attn_output = gate_msa.unsqueeze(1) * attn_output
        hidden_states = hidden_states + attn_output
        norm_hidden_states = self.norm2(hidden_states)
        norm_hidden_states = norm_hidden_states * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)

        context_attn_output = c_gate_msa.unsqueeze(1) * context_attn_output
        encoder_hidden_states = encoder_hidden_states + context_attn_output
        norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states)
        norm_encoder_hidden_states = norm_encoder_hidden_states * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(norm_encoder_hidden_states)
        return encoder_hidden_states, hidden_states


class FluxTransformer2DModelWithMasking(nn.Module):
    def __init__(self, patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, guidance_embeds=True,
                 axes_dims_rope=(4, 6, 6)):
        super().__init__()
        self.out_channels = in_channels
        self.inner_dim = num_attention_heads * attention_head_dim
        self.pos_embed = EmbedND(dim=self.inner_dim, theta=10000, axes_dim=list(axes_dims_rope))
        self.time_text_embed = CombinedTimestepGuidanceTextProjEmbeddings(self.inner_dim, pooled_projection_dim)
        self.context_embedder = nn.Linear(joint_attention_dim, self.inner_dim)
        self.x_embedder = nn.Linear(in_channels, self.inner_dim)
        self.transformer_blocks = nn.ModuleList(
            [FluxTransformerBlock(self.inner_dim, num_attention_heads, attention_head_dim) for _ in range(num_layers)]
        )
        self.single_transformer_blocks = nn.ModuleList(
            [FluxSingleTransformerBlock(self.inner_dim, num_attention_heads, attention_head_dim)
             for _ in range(num_single_layers)]
        )
        self.norm_out = AdaLayerNormContinuous(self.inner_dim, self.inner_dim)
        self.proj_out = nn.Linear(self.inner_dim, patch_size * patch_size * self.out_channels, bias=True)

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None, return_dict=True,
                attention_mask: Optional[torch.Tensor] = None):
        hidden_states = self.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        guidance = guidance.to(hidden_states.dtype) * 1000
        temb = self.time_text_embed(timestep, guidance, pooled_projections)
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)

        ids = torch.cat((txt_ids, img_ids), dim=1)
        image_rotary_emb = self.pos_embed(ids)

        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=temb,
                image_rotary_emb=image_rotary_emb,
                attention_mask=attention_mask,
            )

        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)

        for block in self.single_transformer_blocks:
            hidden_states = block(
                hidden_states=hidden_states,
                temb=temb,
                image_rotary_emb=image_rotary_emb,
                attention_mask=attention_mask,
            )

        hidden_states = hidden_states[:, encoder_hidden_states.shape[1]:, ...]
        hidden_states = self.norm_out(hidden_states, temb)
        output = self.proj_out(hidden_states)
        return (output,)


def _pack_latents(latents, batch_size, num_channels_latents, height, width):
    latents = latents.view(batch_size, num_channels_latents, height // 2, 2, width // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(batch_size, (height // 2) * (width // 2), num_channels_latents * 4)


def _prepare_latent_image_ids(batch_size, height, width):
    latent_image_ids = torch.zeros(height // 2, width // 2, 3)
    latent_image_ids[..., 1] = latent_image_ids[..., 1] + torch.arange(height // 2)[:, None]
    latent_image_ids[..., 2] = latent_image_ids[..., 2] + torch.arange(width // 2)[None, :]
    h, w, c = latent_image_ids.shape
    latent_image_ids = latent_image_ids[None, :].repeat(batch_size, 1, 1, 1)
    return latent_image_ids.reshape(batch_size, h * w, c)


if __name__ == "__main__":
    # One --flux_attention_masked_training step on a batch of two captions of different T5 lengths.
    bsz, t5_max_length, t5_dim, pooled_dim = 2, 8, 24, 12
    caption_lengths = [3, 6]  # tokens incl. </s>; the rest of the 8 are T5 padding
    encoder_attention_mask = torch.zeros(bsz, t5_max_length, dtype=torch.long)
    for i, n in enumerate(caption_lengths):
        encoder_attention_mask[i, :n] = 1
    prompt_embeds = torch.randn(bsz, t5_max_length, t5_dim)
    add_text_embeds = torch.randn(bsz, pooled_dim)

    latents = torch.randn(bsz, 4, 8, 8)  # VAE latents (4 channels, 8x8) -> 16 packed image tokens
    noise = torch.randn_like(latents)
    sigmas = torch.tensor([0.3, 0.7]).view(-1, 1, 1, 1)
    noisy_latents = (1 - sigmas) * latents + sigmas * noise
    packed_noisy_latents = _pack_latents(noisy_latents, bsz, 4, 8, 8)
    img_ids = _prepare_latent_image_ids(bsz, 8, 8)
    text_ids = torch.zeros(bsz, t5_max_length, 3)
    timesteps = sigmas.flatten()
    guidance = torch.full((bsz,), 1.0)

    transformer = FluxTransformer2DModelWithMasking()
    transformer.train()
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-4)

    flux_transformer_kwargs = {
        "hidden_states": packed_noisy_latents,
        "timestep": timesteps,
        "guidance": guidance,
        "pooled_projections": add_text_embeds,
        "encoder_hidden_states": prompt_embeds,
        "txt_ids": text_ids,
        "img_ids": img_ids,
        "joint_attention_kwargs": None,
        "return_dict": False,
        "attention_mask": encoder_attention_mask,  # flux_attention_masked_training
    }
    model_pred = transformer(**flux_transformer_kwargs)[0]
    target = _pack_latents(noise - latents, bsz, 4, 8, 8)
    loss = F.mse_loss(model_pred.float(), target.float())
    loss.backward()
    optimizer.step()

    seq = torch.cat([torch.zeros(bsz, t5_max_length), torch.zeros(bsz, packed_noisy_latents.shape[1])], dim=1)
    m = expand_flux_attention_mask(seq, encoder_attention_mask)
    for i in range(bsz):
        off = (m[i] == 0).nonzero().flatten().tolist()
        print(f"row {i}: caption tokens 0..{caption_lengths[i] - 1}, joint positions given mask 0: {off}")
    print(f"fixed={FIXED} loss={loss.item():.6f}")
