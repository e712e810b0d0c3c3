# huggingface/diffusers#5752 (commit a5720e9e31): PixArtAlphaPipeline with more than one image per prompt only
# zeroed the padded T5 embeddings ("mask_feature") and called the transformer without encoder_attention_mask,
# so the image tokens still attended the padded caption tokens in cross-attention.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Attention(nn.Module):
    def __init__(self, query_dim, cross_attention_dim=None, heads=2):
        super().__init__()
        kv_dim = cross_attention_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, query_dim)
        self.to_k = nn.Linear(kv_dim, query_dim)
        self.to_v = nn.Linear(kv_dim, query_dim)
        self.to_out = nn.Linear(query_dim, query_dim)

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        # AttnProcessor2_0
        B, N, C = hidden_states.shape
        ctx = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        if attention_mask is not None:
            attention_mask = attention_mask.view(B, 1, -1, attention_mask.shape[-1])  # [B, 1, 1, S]
        q = self.to_q(hidden_states).view(B, -1, self.heads, C // self.heads).transpose(1, 2)
        k = self.to_k(ctx).view(B, -1, self.heads, C // self.heads).transpose(1, 2)
        v = self.to_v(ctx).view(B, -1, self.heads, C // self.heads).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        return self.to_out(out.transpose(1, 2).reshape(B, N, C))


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, cross_attention_dim):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, elementwise_affine=False), nn.LayerNorm(dim)
        self.attn1 = Attention(dim)
        self.attn2 = Attention(dim, cross_attention_dim=cross_attention_dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim ** 0.5)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + timestep.reshape(-1, 6, hidden_states.shape[-1])).chunk(6, dim=1)
        h = self.norm1(hidden_states) * (1 + scale_msa) + shift_msa
        hidden_states = hidden_states + gate_msa * self.attn1(h)
        hidden_states = hidden_states + self.attn2(hidden_states, encoder_hidden_states,
                                                   attention_mask=encoder_attention_mask)
        h = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp
        return hidden_states + gate_mlp * self.ff(h)


class Transformer2DModel(nn.Module):
    def __init__(self, in_channels=4, patch_size=2, dim=32, caption_channels=16, num_layers=2):
        super().__init__()
        self.p = patch_size
        self.pos_embed = nn.Linear(in_channels * patch_size * patch_size, dim)
        self.caption_projection = nn.Sequential(nn.Linear(caption_channels, dim), nn.GELU(approximate="tanh"),
                                                nn.Linear(dim, dim))
        self.adaln_single = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(dim, dim) for _ in range(num_layers)])
        self.proj_out = nn.Linear(dim, in_channels * patch_size * patch_size)

    def forward(self, hidden_states, encoder_hidden_states, timestep, encoder_attention_mask=None):
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            # convert keep-mask (1 = keep, 0 = discard) to a bias
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)
        B, C, H, W = hidden_states.shape
        p = self.p
        x = hidden_states.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, -1, C * p * p)
        x = self.pos_embed(x)
        t = self.adaln_single(timestep.float().view(B, 1) / 1000.0)
        y = self.caption_projection(encoder_hidden_states)
        for block in self.transformer_blocks:
            x = block(x, y, encoder_attention_mask, t)
        x = self.proj_out(x).reshape(B, H // p, W // p, C, p, p).permute(0, 3, 1, 4, 2, 5)
        return x.reshape(B, C, H, W)


class PixArtAlphaPipeline:
    max_length = 8

    def __init__(self):
        self.text_encoder = nn.Embedding(32, 16)  # stands in for the T5 encoder
        self.transformer = Transformer2DModel()

    def tokenizer(self, ids):
        input_ids = torch.zeros(1, self.max_length, dtype=torch.long)
        input_ids[0, :len(ids)] = torch.tensor(ids)
        attention_mask = (torch.arange(self.max_length) < len(ids)).long()[None]
        return input_ids, attention_mask

    def mask_text_embeddings(self, emb, mask):
        if emb.shape[0] == 1:
            keep_index = mask.sum().item()
            return emb[:, :, :keep_index, :], keep_index
        masked_feature = emb * mask[:, None, :, None]
        return masked_feature, emb.shape[2]

    def encode_prompt(self, prompt_ids, num_images_per_prompt, mask_feature=True):
        text_input_ids, prompt_attention_mask = self.tokenizer(prompt_ids)
        prompt_embeds = self.text_encoder(text_input_ids)
        prompt_embeds = prompt_embeds.repeat(num_images_per_prompt, 1, 1)
        prompt_attention_mask = prompt_attention_mask.repeat(num_images_per_prompt, 1)
        uncond_ids, negative_prompt_attention_mask = self.tokenizer([1])  # "" -> </s>
        negative_prompt_embeds = self.text_encoder(uncond_ids).repeat(num_images_per_prompt, 1, 1)
        negative_prompt_attention_mask = negative_prompt_attention_mask.repeat(num_images_per_prompt, 1)
        if FIXED:
            return prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask
        if mask_feature:
            prompt_embeds = prompt_embeds.unsqueeze(1)
            masked_prompt_embeds, keep_indices = self.mask_text_embeddings(prompt_embeds, prompt_attention_mask)
            masked_prompt_embeds = masked_prompt_embeds.squeeze(1)
            masked_negative_prompt_embeds = negative_prompt_embeds[:, :keep_indices, :]
            return masked_prompt_embeds, None, masked_negative_prompt_embeds, None
        return prompt_embeds, None, negative_prompt_embeds, None

    @torch.no_grad()
    def __call__(self, prompt_ids, num_images_per_prompt=2, num_inference_steps=3, guidance_scale=4.5):
        prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask = \
            self.encode_prompt(prompt_ids, num_images_per_prompt)
        prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)
        if prompt_attention_mask is not None:
            prompt_attention_mask = torch.cat([negative_prompt_attention_mask, prompt_attention_mask], dim=0)
        latents = torch.randn(num_images_per_prompt, 4, 4, 4)
        first_text_pred = None
        for t in torch.linspace(999, 1, num_inference_steps):
            latent_model_input = torch.cat([latents] * 2)
            current_timestep = t.expand(latent_model_input.shape[0])
            noise_pred = self.transformer(latent_model_input, encoder_hidden_states=prompt_embeds,
                                          encoder_attention_mask=prompt_attention_mask, timestep=current_timestep)
            noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
            if first_text_pred is None:
                first_text_pred = (noise_pred_text.clone(), latents.clone(), t)
            noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            latents = latents - 0.3 * noise_pred
        return latents, first_text_pred


pipe = PixArtAlphaPipeline()
prompt_ids = [5, 9, 14]  # three real caption tokens, five padding tokens
images, (text_pred, latents0, t0) = pipe(prompt_ids)
print("image latents mean", images.mean().item())

# reference: the conditional prediction with only the real caption tokens as keys
with torch.no_grad():
    ids, _ = pipe.tokenizer(prompt_ids)
    emb = pipe.text_encoder(ids[:, :len(prompt_ids)]).repeat(2, 1, 1)
    ref = pipe.transformer(latents0, encoder_hidden_states=emb, timestep=t0.expand(2))
print("max |text-conditioned prediction - unpadded reference|:", (text_pred - ref).abs().max().item())
