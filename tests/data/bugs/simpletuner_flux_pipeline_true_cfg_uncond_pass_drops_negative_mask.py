# SimpleTuner (bghira/SimpleTuner commit 295decc9b, "flux: use negative attn masking"), helpers/models/flux/pipeline.py.
# Bug: in the true-CFG denoising loop the unconditional transformer call gets no attention_mask, so the padded
# negative-prompt T5 tokens are attended in joint attention; the fix passes negative_mask to that call.
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    # the parts of diffusers.models.attention_processor.Attention that the Flux processor touches
    def __init__(self, query_dim, dim_head, heads, out_dim, added_kv_proj_dim=None, pre_only=False, processor=None):
        super().__init__()
        inner = dim_head * heads
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(query_dim, inner)
        self.to_v = nn.Linear(query_dim, inner)
        self.norm_q = RMSNorm(dim_head)
        self.norm_k = RMSNorm(dim_head)
        self.norm_added_q = None
        self.norm_added_k = None
        if added_kv_proj_dim is not None:
            self.add_q_proj = nn.Linear(added_kv_proj_dim, inner)
            self.add_k_proj = nn.Linear(added_kv_proj_dim, inner)
            self.add_v_proj = nn.Linear(added_kv_proj_dim, inner)
            self.norm_added_q = RMSNorm(dim_head)
            self.norm_added_k = RMSNorm(dim_head)
            self.to_add_out = nn.Linear(inner, query_dim)
        if not pre_only:
            self.to_out = nn.ModuleList([nn.Linear(inner, out_dim), nn.Dropout(0.0)])
        self.processor = processor

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class FluxAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        batch_size, _, _ = hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if encoder_hidden_states is not None:
            eq = attn.add_q_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            ek = attn.add_k_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            ev = attn.add_v_proj(encoder_hidden_states).view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query = torch.cat([eq, query], dim=2)
            key = torch.cat([ek, key], dim=2)
            value = torch.cat([ev, value], dim=2)
        # (image_rotary_emb omitted in this trimmed reproduction)
        if attention_mask is not None:
            attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
            attention_mask = (attention_mask > 0).bool()
            attention_mask = attention_mask.to(device=hidden_states.device, dtype=hidden_states.dtype)
        hidden_states = F.scaled_dot_product_attention(
            query, key, value, dropout_p=0.0, is_causal=False, attn_mask=attention_mask
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        if encoder_hidden_states is not None:
            encoder_hidden_states, hidden_states = (
                hidden_states[:, : encoder_hidden_states.shape[1]],
                hidden_states[:, encoder_hidden_states.shape[1]:],
            )
            hidden_states = attn.to_out[0](hidden_states)
            hidden_states = attn.to_out[1](hidden_states)
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
            return hidden_states, encoder_hidden_states
        return hidden_states


def expand_flux_attention_mask(hidden_states, attn_mask):
    """Expand a mask so that the image is included."""
    bsz = attn_mask.shape[0]
    assert bsz == hidden_states.shape[0]
    residual_seq_len = hidden_states.shape[1]
    mask_seq_len = attn_mask.shape[1]
    expanded_mask = torch.ones(bsz, residual_seq_len)
    expanded_mask[:, :mask_seq_len] = attn_mask
    return expanded_mask


class AdaLayerNormZero(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.linear(F.silu(emb)).chunk(6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp


class AdaLayerNormZeroSingle(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.linear = nn.Linear(dim, 3 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)

    def forward(self, x, emb):
        shift_msa, scale_msa, gate_msa = self.linear(F.silu(emb)).chunk(3, dim=1)
        return self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None], gate_msa


class FeedForward(nn.Module):
    def __init__(self, dim, dim_out):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim_out))

    def forward(self, x):
        return self.net(x)


class FluxSingleTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, mlp_ratio=4.0):
        super().__init__()
        self.mlp_hidden_dim = int(dim * mlp_ratio)
        self.norm = AdaLayerNormZeroSingle(dim)
        self.proj_mlp = nn.Linear(dim, self.mlp_hidden_dim)
        self.act_mlp = nn.GELU(approximate="tanh")
        self.proj_out = nn.Linear(dim + self.mlp_hidden_dim, dim)
        self.attn = Attention(dim, attention_head_dim, num_attention_heads, dim, pre_only=True,
                              processor=FluxAttnProcessor2_0())

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
    def __init__(self, dim, num_attention_heads, attention_head_dim):
        super().__init__()
        self.norm1 = AdaLayerNormZero(dim)
        self.norm1_context = AdaLayerNormZero(dim)
        self.attn = Attention(dim, attention_head_dim, num_attention_heads, dim, added_kv_proj_dim=dim,
                              processor=FluxAttnProcessor2_0())
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim, dim)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff_context = FeedForward(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None, attention_mask=None):
        norm_hidden_states, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(hidden_states, emb=temb)
        norm_encoder_hidden_states, c_gate_msa, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.norm1_context(
            encoder_hidden_states, emb=temb)
        if attention_mask is not None:
            attention_mask = expand_flux_attention_mask(
                torch.cat([encoder_hidden_states, hidden_states], dim=1), attention_mask)
        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states, encoder_hidden_states=norm_encoder_hidden_states,
            image_rotary_emb=image_rotary_emb, attention_mask=attention_mask)
        hidden_states = hidden_states + gate_msa.unsqueeze(1) * attn_output
        norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        hidden_states = hidden_states + gate_mlp.unsqueeze(1) * self.ff(norm_hidden_states)
        encoder_hidden_states = encoder_hidden_states + c_gate_msa.unsqueeze(1) * context_attn_output
        norm_encoder_hidden_states = self.norm2_context(encoder_hidden_states) * (1 + c_scale_mlp[:, None]) + c_shift_mlp[:, None]
        encoder_hidden_states = encoder_hidden_states + c_gate_mlp.unsqueeze(1) * self.ff_context(norm_encoder_hidden_states)
        return encoder_hidden_states, hidden_states


def timestep_proj(t, dim=32):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class FluxTransformer2DModelWithMasking(nn.Module):
    def __init__(self, in_channels=16, joint_attention_dim=48, pooled_projection_dim=24, heads=2, head_dim=16,
                 num_layers=1, num_single_layers=1):
        super().__init__()
        dim = heads * head_dim
        self.x_embedder = nn.Linear(in_channels, dim)
        self.context_embedder = nn.Linear(joint_attention_dim, dim)
        self.timestep_embedder = nn.Sequential(nn.Linear(32, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.text_embedder = nn.Sequential(nn.Linear(pooled_projection_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.transformer_blocks = nn.ModuleList([FluxTransformerBlock(dim, heads, head_dim) for _ in range(num_layers)])
        self.single_transformer_blocks = nn.ModuleList(
            [FluxSingleTransformerBlock(dim, heads, head_dim) for _ in range(num_single_layers)])
        self.norm_out_linear = nn.Linear(dim, 2 * dim)
        self.norm_out = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states=None, pooled_projections=None, timestep=None,
                img_ids=None, txt_ids=None, guidance=None, joint_attention_kwargs=None, return_dict=True,
                attention_mask=None):
        hidden_states = self.x_embedder(hidden_states)
        timestep = timestep.to(hidden_states.dtype) * 1000
        temb = self.timestep_embedder(timestep_proj(timestep)) + self.text_embedder(pooled_projections)
        encoder_hidden_states = self.context_embedder(encoder_hidden_states)
        image_rotary_emb = None
        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb,
                image_rotary_emb=image_rotary_emb, attention_mask=attention_mask)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        for block in self.single_transformer_blocks:
            hidden_states = block(hidden_states=hidden_states, temb=temb, image_rotary_emb=image_rotary_emb,
                                  attention_mask=attention_mask)
        hidden_states = hidden_states[:, encoder_hidden_states.shape[1]:, ...]
        scale, shift = self.norm_out_linear(F.silu(temb)).chunk(2, dim=1)
        hidden_states = self.norm_out(hidden_states) * (1 + scale)[:, None, :] + shift[:, None, :]
        return (self.proj_out(hidden_states),)


class FluxPipeline:
    def __init__(self, transformer):
        self.transformer = transformer
        self.joint_attention_kwargs = None

    @torch.no_grad()
    def __call__(self, latents, prompt_embeds, pooled_prompt_embeds, text_ids, negative_prompt_embeds,
                 negative_pooled_prompt_embeds, negative_text_ids, latent_image_ids, prompt_mask, negative_mask,
                 num_inference_steps=4, guidance_scale_real=4.0, no_cfg_until_timestep=0):
        sigmas = torch.linspace(1.0, 0.0, num_inference_steps + 1)
        timesteps = sigmas[:-1] * 1000
        guidance = None
        for i, t in enumerate(timesteps):
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            extra_transformer_args = {}
            if prompt_mask is not None:
                extra_transformer_args["attention_mask"] = prompt_mask
            noise_pred = self.transformer(
                hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                pooled_projections=pooled_prompt_embeds, encoder_hidden_states=prompt_embeds,
                txt_ids=text_ids, img_ids=latent_image_ids, joint_attention_kwargs=self.joint_attention_kwargs,
                return_dict=False, **extra_transformer_args)[0]
            if guidance_scale_real > 1.0 and i >= no_cfg_until_timestep:
                if FIXED:
                    if negative_mask is not None:
                        extra_transformer_args["attention_mask"] = negative_mask
                    noise_pred_uncond = self.transformer(
                        hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                        pooled_projections=negative_pooled_prompt_embeds,
                        encoder_hidden_states=negative_prompt_embeds, txt_ids=negative_text_ids,
                        img_ids=latent_image_ids, joint_attention_kwargs=self.joint_attention_kwargs,
                        **extra_transformer_args, return_dict=False)[0]
                else:
                    noise_pred_uncond = self.transformer(
                        hidden_states=latents, timestep=timestep / 1000, guidance=guidance,
                        pooled_projections=negative_pooled_prompt_embeds,
                        encoder_hidden_states=negative_prompt_embeds, txt_ids=negative_text_ids,
                        img_ids=latent_image_ids, joint_attention_kwargs=self.joint_attention_kwargs,
                        return_dict=False)[0]
                noise_pred = noise_pred_uncond + guidance_scale_real * (noise_pred - noise_pred_uncond)
            # FlowMatchEulerDiscreteScheduler.step
            latents = latents + (sigmas[i + 1] - sigmas[i]) * noise_pred
        return latents


transformer = FluxTransformer2DModelWithMasking().eval()
B, L_txt, L_img = 2, 12, 16
latents = torch.randn(B, L_img, 16)
latent_image_ids = torch.zeros(L_img, 3)
text_ids = torch.zeros(L_txt, 3)
# T5 outputs for the prompt and the (short) negative prompt, padded to max_sequence_length; pad embeddings nonzero
prompt_embeds = torch.randn(B, L_txt, 48)
negative_prompt_embeds = torch.randn(B, L_txt, 48)
prompt_mask = torch.zeros(B, L_txt)
prompt_mask[0, :9] = 1
prompt_mask[1, :6] = 1
negative_mask = torch.zeros(B, L_txt)
negative_mask[:, :2] = 1
pooled = torch.randn(B, 24)
neg_pooled = torch.randn(B, 24)

pipe = FluxPipeline(transformer)
out = pipe(latents.clone(), prompt_embeds, pooled, text_ids, negative_prompt_embeds, neg_pooled, text_ids,
           latent_image_ids, prompt_mask, negative_mask)

# reference: the same loop with every transformer call given the mask of its own prompt
with torch.no_grad():
    sigmas = torch.linspace(1.0, 0.0, 5)
    ref = latents.clone()
    for i in range(4):
        ts = (sigmas[i] * 1000).expand(B) / 1000
        c = transformer(ref, prompt_embeds, pooled, ts, latent_image_ids, text_ids, attention_mask=prompt_mask)[0]
        u = transformer(ref, negative_prompt_embeds, neg_pooled, ts, latent_image_ids, text_ids,
                        attention_mask=negative_mask)[0]
        ref = ref + (sigmas[i + 1] - sigmas[i]) * (u + 4.0 * (c - u))
print(f"max |pipeline latents - latents with negative mask on uncond pass| = {(out - ref).abs().max().item():.6f}")
