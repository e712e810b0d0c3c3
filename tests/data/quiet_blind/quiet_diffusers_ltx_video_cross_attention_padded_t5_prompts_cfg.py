# Correct program (quiet batch quiet-r115b).
#
# Ported from huggingface/diffusers @061bc7f9dcaf23ad84a8f36f93bc586c2f3f8191:
#   src/diffusers/models/transformers/transformer_ltx.py (LTXVideoAttnProcessor, LTXAttention,
#   LTXVideoRotaryPosEmbed, LTXVideoTransformerBlock, LTXVideoTransformer3DModel.forward, apply_rotary_emb),
#   AttentionModuleMixin.prepare_attention_mask, the native SDPA branch of dispatch_attention_fn, and
#   pipelines/ltx/pipeline_ltx.py (LTXPipeline._get_t5_prompt_embeds / encode_prompt / _pack_latents /
#   the classifier-free-guidance denoising loop, recalled; FlowMatch Euler step written out).
#
# A batch of text-to-video prompts of different lengths is tokenized to max_sequence_length (right padding),
# encoded by a tiny T5 encoder under its attention mask, and the LTX video transformer cross-attends the packed
# video latents to the padded prompt embeddings with encoder_attention_mask turned into a -10000 bias.
# Checked against a reference that runs every prompt (and its negative prompt) alone, unpadded, with no mask.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import T5Config, T5EncoderModel

torch.manual_seed(0)


# --------------------------------------------------------------------------------------------------------
# diffusers building blocks (normalization.py, embeddings.py, attention.py), trimmed
# --------------------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim, eps, elementwise_affine=True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if elementwise_affine else None

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            hidden_states = hidden_states.to(self.weight.dtype) * self.weight
        return hidden_states.to(input_dtype)


def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1, scale=1,
                           max_period=10000):
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half_dim, dtype=torch.float32, device=timesteps.device)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = torch.exp(exponent)
    emb = timesteps[:, None].float() * emb[None, :]
    emb = scale * emb
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    return emb


class Timesteps(nn.Module):
    def __init__(self, num_channels, flip_sin_to_cos, downscale_freq_shift):
        super().__init__()
        self.num_channels = num_channels
        self.flip_sin_to_cos = flip_sin_to_cos
        self.downscale_freq_shift = downscale_freq_shift

    def forward(self, timesteps):
        return get_timestep_embedding(timesteps, self.num_channels, flip_sin_to_cos=self.flip_sin_to_cos,
                                      downscale_freq_shift=self.downscale_freq_shift)


class TimestepEmbedding(nn.Module):
    def __init__(self, in_channels, time_embed_dim):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample):
        return self.linear_2(self.act(self.linear_1(sample)))


class PixArtAlphaCombinedTimestepSizeEmbeddings(nn.Module):
    def __init__(self, embedding_dim, size_emb_dim, use_additional_conditions=False):
        super().__init__()
        self.outdim = size_emb_dim
        self.time_proj = Timesteps(num_channels=256, flip_sin_to_cos=True, downscale_freq_shift=0)
        self.timestep_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=embedding_dim)
        self.use_additional_conditions = use_additional_conditions

    def forward(self, timestep, resolution, aspect_ratio, batch_size, hidden_dtype):
        timesteps_proj = self.time_proj(timestep)
        timesteps_emb = self.timestep_embedder(timesteps_proj.to(dtype=hidden_dtype))
        return timesteps_emb


class AdaLayerNormSingle(nn.Module):
    def __init__(self, embedding_dim, use_additional_conditions=False):
        super().__init__()
        self.emb = PixArtAlphaCombinedTimestepSizeEmbeddings(
            embedding_dim, size_emb_dim=embedding_dim // 3, use_additional_conditions=use_additional_conditions
        )
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim, bias=True)

    def forward(self, timestep, added_cond_kwargs=None, batch_size=None, hidden_dtype=None):
        added_cond_kwargs = added_cond_kwargs or {"resolution": None, "aspect_ratio": None}
        embedded_timestep = self.emb(timestep, **added_cond_kwargs, batch_size=batch_size, hidden_dtype=hidden_dtype)
        return self.linear(self.silu(embedded_timestep)), embedded_timestep


class AdaLayerNorm(nn.Module):
    def __init__(self, embedding_dim, output_dim=None, norm_elementwise_affine=False, norm_eps=1e-5, chunk_dim=0):
        super().__init__()
        self.chunk_dim = chunk_dim
        output_dim = output_dim or embedding_dim * 2
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, output_dim)
        self.norm = nn.LayerNorm(output_dim // 2, norm_eps, norm_elementwise_affine)

    def forward(self, x, temb):
        temb = self.linear(self.silu(temb))
        if self.chunk_dim == 1:
            shift, scale = temb.chunk(2, dim=1)
            shift = shift[:, None, :]
            scale = scale[:, None, :]
        else:
            scale, shift = temb.chunk(2, dim=0)
        x = self.norm(x) * (1 + scale) + shift
        return x


class PixArtAlphaTextProjection(nn.Module):
    def __init__(self, in_features, hidden_size, out_features=None, act_fn="gelu_tanh"):
        super().__init__()
        if out_features is None:
            out_features = hidden_size
        self.linear_1 = nn.Linear(in_features=in_features, out_features=hidden_size, bias=True)
        self.act_1 = nn.GELU(approximate="tanh")
        self.linear_2 = nn.Linear(in_features=hidden_size, out_features=out_features, bias=True)

    def forward(self, caption):
        return self.linear_2(self.act_1(self.linear_1(caption)))


class GELU(nn.Module):
    def __init__(self, dim_in, dim_out, approximate="none", bias=True):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=bias)
        self.approximate = approximate

    def forward(self, hidden_states):
        return F.gelu(self.proj(hidden_states), approximate=self.approximate)


class FeedForward(nn.Module):
    def __init__(self, dim, dim_out=None, mult=4, dropout=0.0, activation_fn="geglu"):
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = dim_out if dim_out is not None else dim
        assert activation_fn == "gelu-approximate"
        self.net = nn.ModuleList([GELU(dim, inner_dim, approximate="tanh"), nn.Dropout(dropout),
                                  nn.Linear(inner_dim, dim_out)])

    def forward(self, hidden_states):
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


def dispatch_attention_fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, backend=None):
    # attention_dispatch._native_attention: [B, S, H, D] in, [B, S, H, D] out
    query, key, value = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                         is_causal=is_causal)
    return out.permute(0, 2, 1, 3)


# --------------------------------------------------------------------------------------------------------
# transformer_ltx.py
# --------------------------------------------------------------------------------------------------------
class LTXVideoAttnProcessor:
    _attention_backend = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states

        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        query = attn.norm_q(query)
        key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb)
            key = apply_rotary_emb(key, image_rotary_emb)

        query = query.unflatten(2, (attn.heads, -1))
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))

        hidden_states = dispatch_attention_fn(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False,
            backend=self._attention_backend,
        )
        hidden_states = hidden_states.flatten(2, 3)
        hidden_states = hidden_states.to(query.dtype)

        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class LTXAttention(nn.Module):
    def __init__(self, query_dim, heads=8, kv_heads=8, dim_head=64, dropout=0.0, bias=True,
                 cross_attention_dim=None, out_bias=True, qk_norm="rms_norm_across_heads", processor=None):
        super().__init__()
        if qk_norm != "rms_norm_across_heads":
            raise NotImplementedError("Only 'rms_norm_across_heads' is supported as a valid value for `qk_norm`.")
        self.head_dim = dim_head
        self.inner_dim = dim_head * heads
        self.inner_kv_dim = self.inner_dim if kv_heads is None else dim_head * kv_heads
        self.query_dim = query_dim
        self.cross_attention_dim = cross_attention_dim if cross_attention_dim is not None else query_dim
        self.out_dim = query_dim
        self.heads = heads

        norm_eps = 1e-5
        self.norm_q = nn.RMSNorm(dim_head * heads, eps=norm_eps, elementwise_affine=True)
        self.norm_k = nn.RMSNorm(dim_head * kv_heads, eps=norm_eps, elementwise_affine=True)
        self.to_q = nn.Linear(query_dim, self.inner_dim, bias=bias)
        self.to_k = nn.Linear(self.cross_attention_dim, self.inner_kv_dim, bias=bias)
        self.to_v = nn.Linear(self.cross_attention_dim, self.inner_kv_dim, bias=bias)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, self.out_dim, bias=out_bias), nn.Dropout(dropout)])
        self.processor = processor if processor is not None else LTXVideoAttnProcessor()

    def prepare_attention_mask(self, attention_mask, target_length, batch_size, out_dim=3):
        # AttentionModuleMixin.prepare_attention_mask
        head_size = self.heads
        if attention_mask is None:
            return attention_mask

        current_length = attention_mask.shape[-1]
        if current_length != target_length:
            attention_mask = F.pad(attention_mask, (0, target_length), value=0.0)

        if out_dim == 3:
            if attention_mask.shape[0] < batch_size * head_size:
                attention_mask = attention_mask.repeat_interleave(head_size, dim=0)
        elif out_dim == 4:
            attention_mask = attention_mask.unsqueeze(1)
            attention_mask = attention_mask.repeat_interleave(head_size, dim=1)
        return attention_mask

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class LTXVideoRotaryPosEmbed(nn.Module):
    def __init__(self, dim, base_num_frames=20, base_height=2048, base_width=2048, patch_size=1, patch_size_t=1,
                 theta=10000.0):
        super().__init__()
        self.dim = dim
        self.base_num_frames = base_num_frames
        self.base_height = base_height
        self.base_width = base_width
        self.patch_size = patch_size
        self.patch_size_t = patch_size_t
        self.theta = theta

    def _prepare_video_coords(self, batch_size, num_frames, height, width, rope_interpolation_scale, device):
        grid_h = torch.arange(height, dtype=torch.float32, device=device)
        grid_w = torch.arange(width, dtype=torch.float32, device=device)
        grid_f = torch.arange(num_frames, dtype=torch.float32, device=device)
        grid = torch.meshgrid(grid_f, grid_h, grid_w, indexing="ij")
        grid = torch.stack(grid, dim=0)
        grid = grid.unsqueeze(0).repeat(batch_size, 1, 1, 1, 1)

        if rope_interpolation_scale is not None:
            grid[:, 0:1] = grid[:, 0:1] * rope_interpolation_scale[0] * self.patch_size_t / self.base_num_frames
            grid[:, 1:2] = grid[:, 1:2] * rope_interpolation_scale[1] * self.patch_size / self.base_height
            grid[:, 2:3] = grid[:, 2:3] * rope_interpolation_scale[2] * self.patch_size / self.base_width

        grid = grid.flatten(2, 4).transpose(1, 2)
        return grid

    def forward(self, hidden_states, num_frames=None, height=None, width=None, rope_interpolation_scale=None,
                video_coords=None):
        batch_size = hidden_states.size(0)

        if video_coords is None:
            grid = self._prepare_video_coords(batch_size, num_frames, height, width,
                                              rope_interpolation_scale=rope_interpolation_scale,
                                              device=hidden_states.device)
        else:
            grid = torch.stack([video_coords[:, 0] / self.base_num_frames, video_coords[:, 1] / self.base_height,
                                video_coords[:, 2] / self.base_width], dim=-1)

        start = 1.0
        end = self.theta
        freqs = self.theta ** torch.linspace(math.log(start, self.theta), math.log(end, self.theta), self.dim // 6,
                                             device=hidden_states.device, dtype=torch.float32)
        freqs = freqs * math.pi / 2.0
        freqs = freqs * (grid.unsqueeze(-1) * 2 - 1)
        freqs = freqs.transpose(-1, -2).flatten(2)

        cos_freqs = freqs.cos().repeat_interleave(2, dim=-1)
        sin_freqs = freqs.sin().repeat_interleave(2, dim=-1)

        if self.dim % 6 != 0:
            cos_padding = torch.ones_like(cos_freqs[:, :, : self.dim % 6])
            sin_padding = torch.zeros_like(cos_freqs[:, :, : self.dim % 6])
            cos_freqs = torch.cat([cos_padding, cos_freqs], dim=-1)
            sin_freqs = torch.cat([sin_padding, sin_freqs], dim=-1)

        return cos_freqs, sin_freqs


class LTXVideoTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, cross_attention_dim,
                 qk_norm="rms_norm_across_heads", activation_fn="gelu-approximate", attention_bias=True,
                 attention_out_bias=True, eps=1e-6, elementwise_affine=False):
        super().__init__()

        self.norm1 = RMSNorm(dim, eps=eps, elementwise_affine=elementwise_affine)
        self.attn1 = LTXAttention(query_dim=dim, heads=num_attention_heads, kv_heads=num_attention_heads,
                                  dim_head=attention_head_dim, bias=attention_bias, cross_attention_dim=None,
                                  out_bias=attention_out_bias, qk_norm=qk_norm)

        self.norm2 = RMSNorm(dim, eps=eps, elementwise_affine=elementwise_affine)
        self.attn2 = LTXAttention(query_dim=dim, cross_attention_dim=cross_attention_dim, heads=num_attention_heads,
                                  kv_heads=num_attention_heads, dim_head=attention_head_dim, bias=attention_bias,
                                  out_bias=attention_out_bias, qk_norm=qk_norm)

        self.ff = FeedForward(dim, activation_fn=activation_fn)

        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)

    def forward(self, hidden_states, encoder_hidden_states, temb, image_rotary_emb=None,
                encoder_attention_mask=None):
        batch_size = hidden_states.size(0)
        norm_hidden_states = self.norm1(hidden_states)

        num_ada_params = self.scale_shift_table.shape[0]
        ada_values = self.scale_shift_table[None, None] + temb.reshape(batch_size, temb.size(1), num_ada_params, -1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = ada_values.unbind(dim=2)
        norm_hidden_states = norm_hidden_states * (1 + scale_msa) + shift_msa

        attn_hidden_states = self.attn1(hidden_states=norm_hidden_states, encoder_hidden_states=None,
                                        image_rotary_emb=image_rotary_emb)
        hidden_states = hidden_states + attn_hidden_states * gate_msa

        attn_hidden_states = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                        image_rotary_emb=None, attention_mask=encoder_attention_mask)
        hidden_states = hidden_states + attn_hidden_states
        norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp

        ff_output = self.ff(norm_hidden_states)
        hidden_states = hidden_states + ff_output * gate_mlp

        return hidden_states


class LTXVideoTransformer3DModel(nn.Module):
    def __init__(self, in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, num_attention_heads=32,
                 attention_head_dim=64, cross_attention_dim=2048, num_layers=28, activation_fn="gelu-approximate",
                 qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, norm_eps=1e-6,
                 caption_channels=4096, attention_bias=True, attention_out_bias=True):
        super().__init__()

        out_channels = out_channels or in_channels
        inner_dim = num_attention_heads * attention_head_dim

        self.proj_in = nn.Linear(in_channels, inner_dim)
        self.time_embed = AdaLayerNormSingle(inner_dim, use_additional_conditions=False)
        self.caption_projection = PixArtAlphaTextProjection(in_features=caption_channels, hidden_size=inner_dim)
        self.rope = LTXVideoRotaryPosEmbed(dim=inner_dim, base_num_frames=20, base_height=2048, base_width=2048,
                                           patch_size=patch_size, patch_size_t=patch_size_t, theta=10000.0)
        self.transformer_blocks = nn.ModuleList([
            LTXVideoTransformerBlock(dim=inner_dim, num_attention_heads=num_attention_heads,
                                     attention_head_dim=attention_head_dim, cross_attention_dim=cross_attention_dim,
                                     qk_norm=qk_norm, activation_fn=activation_fn, attention_bias=attention_bias,
                                     attention_out_bias=attention_out_bias, eps=norm_eps,
                                     elementwise_affine=norm_elementwise_affine)
            for _ in range(num_layers)
        ])
        self.norm_out = AdaLayerNorm(embedding_dim=inner_dim, output_dim=2 * inner_dim,
                                     norm_elementwise_affine=False, norm_eps=1e-6, chunk_dim=1)
        self.proj_out = nn.Linear(inner_dim, out_channels)

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask, num_frames=None,
                height=None, width=None, rope_interpolation_scale=None, video_coords=None, attention_kwargs=None,
                return_dict=True):
        image_rotary_emb = self.rope(hidden_states, num_frames, height, width, rope_interpolation_scale, video_coords)

        # convert encoder_attention_mask to a bias the same way we do for attention_mask
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

        batch_size = hidden_states.size(0)
        hidden_states = self.proj_in(hidden_states)

        temb, embedded_timestep = self.time_embed(timestep.flatten(), batch_size=batch_size,
                                                  hidden_dtype=hidden_states.dtype)

        temb = temb.view(batch_size, -1, temb.size(-1))
        embedded_timestep = embedded_timestep.view(batch_size, -1, embedded_timestep.size(-1))

        encoder_hidden_states = self.caption_projection(encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.size(-1))

        for block in self.transformer_blocks:
            hidden_states = block(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states, temb=temb,
                                  image_rotary_emb=image_rotary_emb, encoder_attention_mask=encoder_attention_mask)

        hidden_states = self.norm_out(hidden_states, temb=embedded_timestep.squeeze(1))
        output = self.proj_out(hidden_states)

        if not return_dict:
            return (output,)
        return {"sample": output}


def apply_rotary_emb(x, freqs):
    cos, sin = freqs
    x_real, x_imag = x.unflatten(2, (-1, 2)).unbind(-1)  # [B, S, C // 2]
    x_rotated = torch.stack([-x_imag, x_real], dim=-1).flatten(2)
    out = (x.float() * cos + x_rotated.float() * sin).to(x.dtype)
    return out


# --------------------------------------------------------------------------------------------------------
# A word-level stand-in for T5TokenizerFast (pad 0, </s> 1 appended, right padding)
# --------------------------------------------------------------------------------------------------------
class WordTokenizer:
    pad_token_id, eos_token_id = 0, 1

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size
        self.padding_side = "right"

    def _ids(self, text):
        return [2 + (sum(ord(c) * (k + 1) for k, c in enumerate(w)) % (self.vocab_size - 2)) for w in text.split()]

    def __call__(self, texts, padding="max_length", max_length=None, truncation=True, add_special_tokens=True,
                 return_tensors="pt"):
        rows = []
        for text in texts:
            ids = self._ids(text)
            if truncation and max_length is not None:
                ids = ids[: max_length - 1]
            rows.append(ids + [self.eos_token_id])
        width = max_length if padding == "max_length" else max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            input_ids[i, : len(r)] = torch.tensor(r)
            attention_mask[i, : len(r)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


# --------------------------------------------------------------------------------------------------------
# pipeline_ltx.py (LTXPipeline), trimmed to output_type="latent"
# --------------------------------------------------------------------------------------------------------
class LTXPipeline:
    def __init__(self, tokenizer, text_encoder, transformer, vae_spatial_compression_ratio=32,
                 vae_temporal_compression_ratio=8):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.transformer = transformer
        self.vae_spatial_compression_ratio = vae_spatial_compression_ratio
        self.vae_temporal_compression_ratio = vae_temporal_compression_ratio
        self.transformer_spatial_patch_size = 1
        self.transformer_temporal_patch_size = 1

    def _get_t5_prompt_embeds(self, prompt, num_videos_per_prompt=1, max_sequence_length=128, device=None,
                              dtype=None):
        prompt = [prompt] if isinstance(prompt, str) else prompt
        batch_size = len(prompt)

        text_inputs = self.tokenizer(prompt, padding="max_length", max_length=max_sequence_length, truncation=True,
                                     add_special_tokens=True, return_tensors="pt")
        text_input_ids = text_inputs["input_ids"]
        prompt_attention_mask = text_inputs["attention_mask"]
        prompt_attention_mask = prompt_attention_mask.bool().to(device)

        prompt_embeds = self.text_encoder(text_input_ids.to(device), attention_mask=prompt_attention_mask)[0]
        prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)

        # duplicate text embeddings for each generation per prompt, using mps friendly method
        _, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.repeat(1, num_videos_per_prompt, 1)
        prompt_embeds = prompt_embeds.view(batch_size * num_videos_per_prompt, seq_len, -1)

        prompt_attention_mask = prompt_attention_mask.view(batch_size, -1)
        prompt_attention_mask = prompt_attention_mask.repeat(num_videos_per_prompt, 1)

        return prompt_embeds, prompt_attention_mask

    def encode_prompt(self, prompt, negative_prompt=None, do_classifier_free_guidance=True, num_videos_per_prompt=1,
                      max_sequence_length=128, device=None, dtype=None):
        prompt = [prompt] if isinstance(prompt, str) else prompt
        batch_size = len(prompt)

        prompt_embeds, prompt_attention_mask = self._get_t5_prompt_embeds(
            prompt=prompt, num_videos_per_prompt=num_videos_per_prompt, max_sequence_length=max_sequence_length,
            device=device, dtype=dtype)

        negative_prompt_embeds = negative_prompt_attention_mask = None
        if do_classifier_free_guidance:
            negative_prompt = negative_prompt or ""
            negative_prompt = batch_size * [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt
            negative_prompt_embeds, negative_prompt_attention_mask = self._get_t5_prompt_embeds(
                prompt=negative_prompt, num_videos_per_prompt=num_videos_per_prompt,
                max_sequence_length=max_sequence_length, device=device, dtype=dtype)

        return prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask

    @staticmethod
    def _pack_latents(latents, patch_size=1, patch_size_t=1):
        batch_size, num_channels, num_frames, height, width = latents.shape
        post_patch_num_frames = num_frames // patch_size_t
        post_patch_height = height // patch_size
        post_patch_width = width // patch_size
        latents = latents.reshape(batch_size, -1, post_patch_num_frames, patch_size_t, post_patch_height, patch_size,
                                  post_patch_width, patch_size)
        latents = latents.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)
        return latents

    def prepare_latents(self, batch_size, num_channels_latents, height, width, num_frames, generator):
        height = height // self.vae_spatial_compression_ratio
        width = width // self.vae_spatial_compression_ratio
        num_frames = (num_frames - 1) // self.vae_temporal_compression_ratio + 1
        shape = (batch_size, num_channels_latents, num_frames, height, width)
        latents = torch.stack([torch.randn(shape[1:], generator=g) for g in generator])
        return self._pack_latents(latents, self.transformer_spatial_patch_size, self.transformer_temporal_patch_size)

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt="", height=64, width=96, num_frames=17, frame_rate=25,
                 num_inference_steps=4, guidance_scale=3.0, num_videos_per_prompt=1, generator=None,
                 max_sequence_length=128):
        batch_size = len(prompt)
        self._guidance_scale = guidance_scale
        do_classifier_free_guidance = guidance_scale > 1.0

        prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask = \
            self.encode_prompt(prompt=prompt, negative_prompt=negative_prompt,
                               do_classifier_free_guidance=do_classifier_free_guidance,
                               num_videos_per_prompt=num_videos_per_prompt,
                               max_sequence_length=max_sequence_length, dtype=torch.float32)
        if do_classifier_free_guidance:
            prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)
            prompt_attention_mask = torch.cat([negative_prompt_attention_mask, prompt_attention_mask], dim=0)

        num_channels_latents = self.transformer.proj_in.in_features
        latents = self.prepare_latents(batch_size * num_videos_per_prompt, num_channels_latents, height, width,
                                       num_frames, generator)

        latent_num_frames = (num_frames - 1) // self.vae_temporal_compression_ratio + 1
        latent_height = height // self.vae_spatial_compression_ratio
        latent_width = width // self.vae_spatial_compression_ratio
        rope_interpolation_scale = (self.vae_temporal_compression_ratio / frame_rate,
                                    self.vae_spatial_compression_ratio, self.vae_spatial_compression_ratio)

        # FlowMatchEulerDiscreteScheduler, no shift: sigmas 1 -> 1/N, then 0
        sigmas = torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)
        sigmas = torch.cat([sigmas, torch.zeros(1)])
        timesteps = sigmas[:-1] * 1000.0

        for i, t in enumerate(timesteps):
            latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
            latent_model_input = latent_model_input.to(prompt_embeds.dtype)
            timestep = t.expand(latent_model_input.shape[0])

            noise_pred = self.transformer(
                hidden_states=latent_model_input, encoder_hidden_states=prompt_embeds, timestep=timestep,
                encoder_attention_mask=prompt_attention_mask, num_frames=latent_num_frames, height=latent_height,
                width=latent_width, rope_interpolation_scale=rope_interpolation_scale, return_dict=False,
            )[0]
            noise_pred = noise_pred.float()

            if do_classifier_free_guidance:
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + self._guidance_scale * (noise_pred_text - noise_pred_uncond)

            latents = latents + (sigmas[i + 1] - sigmas[i]) * noise_pred

        return latents


# --------------------------------------------------------------------------------------------------------
# Reference: each prompt and its negative prompt alone, unpadded, no mask anywhere
# --------------------------------------------------------------------------------------------------------
@torch.no_grad()
def reference_one(pipe, prompt, negative_prompt, generator, height=64, width=96, num_frames=17, frame_rate=25,
                  num_inference_steps=4, guidance_scale=3.0):
    def embed(text):
        ids = pipe.tokenizer([text], padding="longest", max_length=None, truncation=False)["input_ids"]
        return pipe.text_encoder(ids)[0]

    cond, uncond = embed(prompt), embed(negative_prompt)
    latents = pipe.prepare_latents(1, pipe.transformer.proj_in.in_features, height, width, num_frames, [generator])
    f = (num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
    h = height // pipe.vae_spatial_compression_ratio
    w = width // pipe.vae_spatial_compression_ratio
    scale = (pipe.vae_temporal_compression_ratio / frame_rate, pipe.vae_spatial_compression_ratio,
             pipe.vae_spatial_compression_ratio)
    sigmas = torch.cat([torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps), torch.zeros(1)])
    for i in range(num_inference_steps):
        t = (sigmas[i] * 1000.0).expand(1)
        kw = dict(timestep=t, encoder_attention_mask=None, num_frames=f, height=h, width=w,
                  rope_interpolation_scale=scale, return_dict=False)
        eps_u = pipe.transformer(latents, uncond, **kw)[0]
        eps_c = pipe.transformer(latents, cond, **kw)[0]
        latents = latents + (sigmas[i + 1] - sigmas[i]) * (eps_u + guidance_scale * (eps_c - eps_u))
    return latents[0]


def main():
    t5_config = T5Config(vocab_size=97, d_model=48, d_kv=12, d_ff=96, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
                         feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    text_encoder = T5EncoderModel(t5_config).eval()
    transformer = LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4,
                                             attention_head_dim=12, cross_attention_dim=48, num_layers=2,
                                             caption_channels=48).eval()
    pipe = LTXPipeline(WordTokenizer(t5_config.vocab_size), text_encoder, transformer)

    prompts = [
        "a red fox runs through fresh snow at dawn",
        "waves",
        "a slow dolly shot over a neon city street in the rain at night with reflections",
        "two cats play chess",
    ]
    negative_prompt = "worst quality, blurry, jittery"
    seeds = [11, 12, 13, 14]

    latents = pipe(prompts, negative_prompt=negative_prompt, max_sequence_length=20,
                   generator=[torch.Generator().manual_seed(s) for s in seeds])

    mask = pipe.tokenizer(prompts, padding="max_length", max_length=20)["attention_mask"]
    print("prompt tokens kept of 20:", mask.sum(-1).tolist())
    worst = 0.0
    for i, (p, s) in enumerate(zip(prompts, seeds)):
        ref = reference_one(pipe, p, negative_prompt, torch.Generator().manual_seed(s))
        err = (latents[i] - ref).abs().max().item()
        worst = max(worst, err)
        print(f"prompt {i}: max |batched - alone| = {err:.2e}")
    assert worst < 1e-4, worst
    # the prompt itself steers the result: two prompts on the same noise do not land on the same latents
    other = reference_one(pipe, prompts[1], negative_prompt, torch.Generator().manual_seed(seeds[0]))
    assert (other - latents[0]).abs().max().item() > 1e-3
    print("ok: padded, masked batch with CFG matches every prompt run alone")


if __name__ == "__main__":
    main()
