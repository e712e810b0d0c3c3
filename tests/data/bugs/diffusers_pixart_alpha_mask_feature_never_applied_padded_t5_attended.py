# huggingface/diffusers#5695 (commit 78be400761), regression from #5677 (commit a8523bffa8).
# PixArtAlphaPipeline.encode_prompt, src/diffusers/pipelines/pixart_alpha/pipeline_pixart_alpha.py.
# The transformer gets no encoder_attention_mask: the pipeline stands for the T5 padding mask by trimming the caption
# to its real tokens (mask_text_embeddings, mask_feature=True). Bug: #5677 guarded that step with
# `prompt_embeds is None and negative_prompt_embeds is None`, tested after both were computed, so it never ran and
# every image cross-attended all 120 T5 positions, padding included. Fix: test whether the embeds were passed in
# (`embeds_initially_provided`), computed before encoding.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyT5Tokenizer:
    """Stands in for T5Tokenizer: words -> ids, </s> appended, right padding with pad id 0."""

    pad_token_id, eos_token_id = 0, 1

    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def _ids(self, text):
        return [2 + (sum(ord(c) * (i + 1) for i, c in enumerate(w)) % (self.vocab_size - 2)) for w in text.split()]

    def __call__(self, texts, padding="max_length", max_length=None, truncation=True, add_special_tokens=True,
                 return_attention_mask=True, return_tensors="pt"):
        if isinstance(texts, str):
            texts = [texts]
        rows = [self._ids(t) + ([self.eos_token_id] if add_special_tokens else []) for t in texts]
        if padding == "longest":
            max_length = max(len(r) for r in rows)
        if truncation:
            rows = [r[:max_length] for r in rows]
        ids = torch.tensor([r + [self.pad_token_id] * (max_length - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (max_length - len(r)) for r in rows])
        return type("BatchEncoding", (), {"input_ids": ids, "attention_mask": mask})()


# ----------------------------------------------------------------------------------------------- transformer
def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=True, downscale_freq_shift=0, max_period=10000):
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(0, half_dim, dtype=torch.float32) / (half_dim - downscale_freq_shift)
    emb = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    return emb


class AdaLayerNormSingle(nn.Module):
    def __init__(self, embedding_dim):
        super().__init__()
        self.linear_1 = nn.Linear(256, embedding_dim)
        self.linear_2 = nn.Linear(embedding_dim, embedding_dim)
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim)

    def forward(self, timestep):
        embedded_timestep = self.linear_2(self.silu(self.linear_1(get_timestep_embedding(timestep, 256))))
        return self.linear(self.silu(embedded_timestep)), embedded_timestep


class CaptionProjection(nn.Module):
    def __init__(self, in_features, hidden_size):
        super().__init__()
        self.linear_1 = nn.Linear(in_features, hidden_size)
        self.act_1 = nn.GELU(approximate="tanh")
        self.linear_2 = nn.Linear(hidden_size, hidden_size)

    def forward(self, caption):
        return self.linear_2(self.act_1(self.linear_1(caption)))


class Attention(nn.Module):
    def __init__(self, query_dim, cross_attention_dim=None, heads=2, dim_head=16):
        super().__init__()
        inner = heads * dim_head
        cross_attention_dim = cross_attention_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(cross_attention_dim, inner)
        self.to_v = nn.Linear(cross_attention_dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        # AttnProcessor2_0
        batch_size = hidden_states.shape[0]
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = self.to_q(hidden_states)
        key = self.to_k(encoder_hidden_states)
        value = self.to_v(encoder_hidden_states)
        head_dim = key.shape[-1] // self.heads
        query = query.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)
        hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                       is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        return self.to_out[1](self.to_out[0](hidden_states))


class BasicTransformerBlock(nn.Module):
    """norm_type="ada_norm_single" (PixArt-Alpha)."""

    def __init__(self, dim, heads, dim_head):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn1 = Attention(dim, heads=heads, dim_head=dim_head)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn2 = Attention(dim, cross_attention_dim=dim, heads=heads, dim_head=dim_head)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                timestep=None):
        batch_size = hidden_states.shape[0]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + timestep.reshape(batch_size, 6, -1)
        ).chunk(6, dim=1)
        norm_hidden_states = self.norm1(hidden_states) * (1 + scale_msa) + shift_msa
        attn_output = self.attn1(norm_hidden_states, attention_mask=attention_mask)
        hidden_states = gate_msa * attn_output + hidden_states
        # PixArt-Alpha: no norm before the cross-attention
        attn_output = self.attn2(hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 attention_mask=encoder_attention_mask)
        hidden_states = attn_output + hidden_states
        norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp
        hidden_states = gate_mlp * self.ff(norm_hidden_states) + hidden_states
        return hidden_states


class Transformer2DModel(nn.Module):
    def __init__(self, in_channels=4, sample_size=8, patch_size=2, heads=2, dim_head=16, num_layers=2,
                 caption_channels=32):
        super().__init__()
        inner = heads * dim_head
        self.config = type("Cfg", (), dict(in_channels=in_channels, out_channels=2 * in_channels,
                                           sample_size=sample_size, patch_size=patch_size))()
        self.pos_embed = nn.Conv2d(in_channels, inner, kernel_size=patch_size, stride=patch_size)
        self.pos = nn.Parameter(torch.randn(1, (sample_size // patch_size) ** 2, inner) * 0.1)
        self.adaln_single = AdaLayerNormSingle(inner)
        self.caption_projection = CaptionProjection(caption_channels, inner)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(inner, heads, dim_head) for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(inner, elementwise_affine=False, eps=1e-6)
        self.scale_shift_table = nn.Parameter(torch.randn(2, inner) / inner**0.5)
        self.proj_out = nn.Linear(inner, patch_size * patch_size * 2 * in_channels)

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, added_cond_kwargs=None,
                attention_mask=None, encoder_attention_mask=None, return_dict=True):
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)
        batch_size, _, height, width = hidden_states.shape
        p = self.config.patch_size
        height, width = height // p, width // p
        hidden_states = self.pos_embed(hidden_states).flatten(2).transpose(1, 2) + self.pos
        timestep, embedded_timestep = self.adaln_single(timestep)
        encoder_hidden_states = self.caption_projection(encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.shape[-1])
        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, attention_mask=attention_mask,
                                  encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, timestep=timestep)
        shift, scale = (self.scale_shift_table[None] + embedded_timestep[:, None]).chunk(2, dim=1)
        hidden_states = self.norm_out(hidden_states) * (1 + scale) + shift
        hidden_states = self.proj_out(hidden_states)
        c = self.config.out_channels
        hidden_states = hidden_states.reshape(-1, height, width, p, p, c)
        hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
        output = hidden_states.reshape(-1, c, height * p, width * p)
        return (output,)


class DDIMLikeScheduler:
    def __init__(self, num_train_timesteps=1000):
        betas = torch.linspace(0.00085**0.5, 0.012**0.5, num_train_timesteps) ** 2
        self.alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        self.num_train_timesteps = num_train_timesteps

    def set_timesteps(self, n, device=None):
        self.timesteps = torch.linspace(self.num_train_timesteps - 1, 0, n).long()

    def scale_model_input(self, sample, t):
        return sample

    def step(self, model_output, t, sample, return_dict=False):
        idx = (self.timesteps == t).nonzero().item()
        prev_t = self.timesteps[idx + 1] if idx + 1 < len(self.timesteps) else torch.tensor(-1)
        a_t = self.alphas_cumprod[t]
        a_prev = self.alphas_cumprod[prev_t] if prev_t >= 0 else torch.tensor(1.0)
        x0 = (sample - (1 - a_t).sqrt() * model_output) / a_t.sqrt()
        return (a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * model_output,)


# ----------------------------------------------------------------------------------------------- pipeline
class PixArtAlphaPipeline:
    def __init__(self, tokenizer, text_encoder, transformer, scheduler):
        self.tokenizer, self.text_encoder, self.transformer, self.scheduler = tokenizer, text_encoder, transformer, scheduler

    # Adapted from https://github.com/PixArt-alpha/PixArt-alpha/blob/master/diffusion/model/utils.py
    def mask_text_embeddings(self, emb, mask):
        if emb.shape[0] == 1:
            keep_index = mask.sum().item()
            return emb[:, :, :keep_index, :], keep_index
        else:
            masked_feature = emb * mask[:, None, :, None]
            return masked_feature, emb.shape[2]

    def encode_prompt(self, prompt, do_classifier_free_guidance=True, negative_prompt="", num_images_per_prompt=1,
                      device=None, prompt_embeds=None, negative_prompt_embeds=None, mask_feature=True):
        embeds_initially_provided = prompt_embeds is not None and negative_prompt_embeds is not None

        if prompt is not None and isinstance(prompt, str):
            batch_size = 1
        elif prompt is not None and isinstance(prompt, list):
            batch_size = len(prompt)
        else:
            batch_size = prompt_embeds.shape[0]

        # See Section 3.1. of the paper.
        max_length = 120

        if prompt_embeds is None:
            text_inputs = self.tokenizer(prompt, padding="max_length", max_length=max_length, truncation=True,
                                         add_special_tokens=True, return_tensors="pt")
            text_input_ids = text_inputs.input_ids
            attention_mask = text_inputs.attention_mask
            prompt_embeds_attention_mask = attention_mask

            prompt_embeds = self.text_encoder(text_input_ids, attention_mask=attention_mask)
            prompt_embeds = prompt_embeds[0]
        else:
            prompt_embeds_attention_mask = torch.ones_like(prompt_embeds)

        dtype = self.text_encoder.dtype
        prompt_embeds = prompt_embeds.to(dtype=dtype)

        bs_embed, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
        prompt_embeds = prompt_embeds.view(bs_embed * num_images_per_prompt, seq_len, -1)
        prompt_embeds_attention_mask = prompt_embeds_attention_mask.view(bs_embed, -1)
        prompt_embeds_attention_mask = prompt_embeds_attention_mask.repeat(num_images_per_prompt, 1)

        if do_classifier_free_guidance and negative_prompt_embeds is None:
            uncond_tokens = [negative_prompt] * batch_size
            max_length = prompt_embeds.shape[1]
            uncond_input = self.tokenizer(uncond_tokens, padding="max_length", max_length=max_length,
                                          truncation=True, return_attention_mask=True, add_special_tokens=True,
                                          return_tensors="pt")
            attention_mask = uncond_input.attention_mask
            negative_prompt_embeds = self.text_encoder(uncond_input.input_ids, attention_mask=attention_mask)
            negative_prompt_embeds = negative_prompt_embeds[0]

        if do_classifier_free_guidance:
            seq_len = negative_prompt_embeds.shape[1]
            negative_prompt_embeds = negative_prompt_embeds.to(dtype=dtype)
            negative_prompt_embeds = negative_prompt_embeds.repeat(1, num_images_per_prompt, 1)
            negative_prompt_embeds = negative_prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)
        else:
            negative_prompt_embeds = None

        # Perform additional masking.
        if FIXED:
            do_mask = mask_feature and not embeds_initially_provided
        else:
            do_mask = mask_feature and prompt_embeds is None and negative_prompt_embeds is None
        if do_mask:
            prompt_embeds = prompt_embeds.unsqueeze(1)
            masked_prompt_embeds, keep_indices = self.mask_text_embeddings(prompt_embeds, prompt_embeds_attention_mask)
            masked_prompt_embeds = masked_prompt_embeds.squeeze(1)
            masked_negative_prompt_embeds = (
                negative_prompt_embeds[:, :keep_indices, :] if negative_prompt_embeds is not None else None
            )
            return masked_prompt_embeds, masked_negative_prompt_embeds

        return prompt_embeds, negative_prompt_embeds

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt="", num_inference_steps=4, guidance_scale=4.5,
                 num_images_per_prompt=1, generator=None, mask_feature=True):
        batch_size = 1 if isinstance(prompt, str) else len(prompt)
        do_classifier_free_guidance = guidance_scale > 1.0
        prompt_embeds, negative_prompt_embeds = self.encode_prompt(
            prompt, do_classifier_free_guidance, negative_prompt=negative_prompt,
            num_images_per_prompt=num_images_per_prompt, mask_feature=mask_feature)
        if do_classifier_free_guidance:
            prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)

        self.scheduler.set_timesteps(num_inference_steps)
        timesteps = self.scheduler.timesteps
        cfg = self.transformer.config
        latent_channels = cfg.in_channels
        latents = torch.randn(batch_size * num_images_per_prompt, latent_channels, cfg.sample_size, cfg.sample_size,
                              generator=generator)
        added_cond_kwargs = {"resolution": None, "aspect_ratio": None}

        for t in timesteps:
            latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
            latent_model_input = self.scheduler.scale_model_input(latent_model_input, t)
            current_timestep = t[None].expand(latent_model_input.shape[0])
            noise_pred = self.transformer(latent_model_input, encoder_hidden_states=prompt_embeds,
                                          timestep=current_timestep, added_cond_kwargs=added_cond_kwargs,
                                          return_dict=False)[0]
            if do_classifier_free_guidance:
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            if cfg.out_channels // 2 == latent_channels:
                noise_pred = noise_pred.chunk(2, dim=1)[0]
            latents = self.scheduler.step(noise_pred, t, latents, return_dict=False)[0]
        return latents, prompt_embeds


def main():
    t5_config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                         relative_attention_num_buckets=8, feed_forward_proj="gated-gelu", dropout_rate=0.0,
                         pad_token_id=0, eos_token_id=1)
    text_encoder = T5EncoderModel(t5_config).eval()
    transformer = Transformer2DModel(caption_channels=t5_config.d_model).eval()
    pipe = PixArtAlphaPipeline(TinyT5Tokenizer(t5_config.vocab_size), text_encoder, transformer, DDIMLikeScheduler())

    latents, prompt_embeds = pipe("a small red fox sitting in the snow", num_inference_steps=4,
                                  generator=torch.Generator().manual_seed(1))
    print("caption tokens seen by cross-attention:", prompt_embeds.shape[1])
    print("final latents mean/std: %.6f %.6f" % (latents.mean().item(), latents.std().item()))
    print("latents[0, :, 0, 0]:", [round(v, 5) for v in latents[0, :, 0, 0].tolist()])


if __name__ == "__main__":
    main()
