# huggingface/diffusers#10103 (commit 6a51427b6a): "Fix multi-prompt inference"
# PixArtSigmaPipeline.encode_prompt (same code in PixArt-Alpha, PAG PixArt-Sigma and Allegro) repeats the T5 embeddings
# per image as p0,p0,p1,p1 (repeat(1, n, 1).view) but repeated the T5 padding mask as m0,m1,m0,m1
# (view(bs_embed, -1).repeat(n, 1)). With several prompts of different lengths and num_images_per_prompt > 1, a row's
# cross-attention gets another prompt's padding mask: it attends padded T5 tokens or loses real ones. The fix repeats the
# mask like the embeddings: repeat(1, n).view(bs_embed * n, -1).
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyT5Tokenizer:
    """Stand-in for T5TokenizerFast (word level, </s>=1, <pad>=0): what matters is the padding and attention_mask."""

    def __init__(self):
        self.vocab = {"<pad>": 0, "</s>": 1}

    class _Out(dict):
        __getattr__ = dict.__getitem__

    def __call__(self, text, padding="max_length", max_length=8, truncation=True, return_tensors="pt", **kwargs):
        text = [text] if isinstance(text, str) else text
        ids, masks = [], []
        for t in text:
            toks = [self.vocab.setdefault(w, 2 + len(self.vocab)) % 64 for w in t.split()][: max_length - 1] + [1]
            ids.append(toks + [0] * (max_length - len(toks)))
            masks.append([1] * len(toks) + [0] * (max_length - len(toks)))
        return self._Out(input_ids=torch.tensor(ids), attention_mask=torch.tensor(masks))


# ---- diffusers.models.attention_processor ---------------------------------------------------------------------------
class AttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        batch_size, sequence_length, _ = (
            hidden_states.shape if encoder_hidden_states is None else encoder_hidden_states.shape
        )
        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            # scaled_dot_product_attention expects attention_mask shape to be (batch, heads, source_length, target_length)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        query = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)

        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        hidden_states = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        return hidden_states


class Attention(nn.Module):
    def __init__(self, query_dim, cross_attention_dim=None, heads=2, dim_head=8):
        super().__init__()
        inner = heads * dim_head
        cross_attention_dim = cross_attention_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner)
        self.to_k = nn.Linear(cross_attention_dim, inner)
        self.to_v = nn.Linear(cross_attention_dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(0.0)])
        self.processor = AttnProcessor2_0()

    def prepare_attention_mask(self, attention_mask, target_length, batch_size, out_dim=3):
        head_size = self.heads
        if attention_mask is None:
            return attention_mask
        current_length: int = attention_mask.shape[-1]
        if current_length != target_length:
            attention_mask = F.pad(attention_mask, (0, target_length), value=0.0)
        if out_dim == 3:
            if attention_mask.shape[0] < batch_size * head_size:
                attention_mask = attention_mask.repeat_interleave(head_size, dim=0)
        return attention_mask

    def forward(self, hidden_states, encoder_hidden_states=None, attention_mask=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


# ---- diffusers.models.transformers.pixart_transformer_2d (ada_norm_single blocks), trimmed -----------------------------
def get_timestep_embedding(timesteps, embedding_dim, max_period=10000):
    half = embedding_dim // 2
    exponent = -torch.log(torch.tensor(float(max_period))) * torch.arange(half, dtype=torch.float32) / half
    emb = timesteps[:, None].float() * torch.exp(exponent)[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, half:], emb[:, :half]], dim=-1)


class AdaLayerNormSingle(nn.Module):
    def __init__(self, embedding_dim):
        super().__init__()
        self.timestep_embedder = nn.Sequential(nn.Linear(256, embedding_dim), nn.SiLU(), nn.Linear(embedding_dim, embedding_dim))
        self.silu = nn.SiLU()
        self.linear = nn.Linear(embedding_dim, 6 * embedding_dim)

    def forward(self, timestep, added_cond_kwargs=None, batch_size=None, hidden_dtype=None):
        embedded_timestep = self.timestep_embedder(get_timestep_embedding(timestep, 256))
        return self.linear(self.silu(embedded_timestep)), embedded_timestep


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim, cross_attention_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn1 = Attention(dim, heads=num_attention_heads, dim_head=attention_head_dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn2 = Attention(dim, cross_attention_dim=cross_attention_dim, heads=num_attention_heads,
                               dim_head=attention_head_dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
        self.scale_shift_table = nn.Parameter(torch.randn(6, dim) / dim**0.5)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                timestep=None, cross_attention_kwargs=None, class_labels=None):
        batch_size = hidden_states.shape[0]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = (
            self.scale_shift_table[None] + timestep.reshape(batch_size, 6, -1)
        ).chunk(6, dim=1)
        norm_hidden_states = self.norm1(hidden_states) * (1 + scale_msa) + shift_msa
        attn_output = self.attn1(norm_hidden_states, encoder_hidden_states=None, attention_mask=attention_mask)
        hidden_states = gate_msa * attn_output + hidden_states

        # PixArt-Alpha/Sigma: cross-attention over the T5 caption, no norm2 modulation
        norm_hidden_states = hidden_states
        attn_output = self.attn2(norm_hidden_states, encoder_hidden_states=encoder_hidden_states,
                                 attention_mask=encoder_attention_mask)
        hidden_states = attn_output + hidden_states

        norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp
        hidden_states = gate_mlp * self.ff(norm_hidden_states) + hidden_states
        return hidden_states


class PixArtTransformer2DModel(nn.Module):
    def __init__(self, num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                 patch_size=2, caption_channels=16):
        super().__init__()
        self.inner_dim = inner_dim = num_attention_heads * attention_head_dim
        self.patch_size = patch_size
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.pos_embed = nn.Conv2d(in_channels, inner_dim, kernel_size=patch_size, stride=patch_size)
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(inner_dim, num_attention_heads, attention_head_dim, inner_dim) for _ in range(num_layers)]
        )
        self.norm_out = nn.LayerNorm(inner_dim, elementwise_affine=False, eps=1e-6)
        self.scale_shift_table = nn.Parameter(torch.randn(2, inner_dim) / inner_dim**0.5)
        self.proj_out = nn.Linear(inner_dim, patch_size * patch_size * out_channels)
        self.adaln_single = AdaLayerNormSingle(inner_dim)
        self.caption_projection = nn.Sequential(
            nn.Linear(caption_channels, inner_dim), nn.GELU(approximate="tanh"), nn.Linear(inner_dim, inner_dim)
        )

    def forward(self, hidden_states, encoder_hidden_states=None, timestep=None, added_cond_kwargs=None,
                cross_attention_kwargs=None, attention_mask: Optional[torch.Tensor] = None,
                encoder_attention_mask: Optional[torch.Tensor] = None, return_dict: bool = True):
        # convert encoder_attention_mask to a bias the same way we do for attention_mask
        if encoder_attention_mask is not None and encoder_attention_mask.ndim == 2:
            encoder_attention_mask = (1 - encoder_attention_mask.to(hidden_states.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask.unsqueeze(1)

        batch_size = hidden_states.shape[0]
        height, width = hidden_states.shape[-2] // self.patch_size, hidden_states.shape[-1] // self.patch_size
        hidden_states = self.pos_embed(hidden_states).flatten(2).transpose(1, 2)

        timestep, embedded_timestep = self.adaln_single(timestep, added_cond_kwargs, batch_size=batch_size,
                                                        hidden_dtype=hidden_states.dtype)
        encoder_hidden_states = self.caption_projection(encoder_hidden_states)
        encoder_hidden_states = encoder_hidden_states.view(batch_size, -1, hidden_states.shape[-1])

        for block in self.transformer_blocks:
            hidden_states = block(hidden_states, attention_mask=attention_mask,
                                  encoder_hidden_states=encoder_hidden_states,
                                  encoder_attention_mask=encoder_attention_mask, timestep=timestep,
                                  cross_attention_kwargs=cross_attention_kwargs, class_labels=None)

        shift, scale = (self.scale_shift_table[None] + embedded_timestep[:, None]).chunk(2, dim=1)
        hidden_states = self.norm_out(hidden_states)
        hidden_states = hidden_states * (1 + scale) + shift
        hidden_states = self.proj_out(hidden_states)
        hidden_states = hidden_states.reshape(
            shape=(-1, height, width, self.patch_size, self.patch_size, self.out_channels)
        )
        hidden_states = torch.einsum("nhwpqc->nchpwq", hidden_states)
        output = hidden_states.reshape(shape=(-1, self.out_channels, height * self.patch_size, width * self.patch_size))
        return (output,)


# ---- diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma.PixArtSigmaPipeline, trimmed -----------------------------
class PixArtSigmaPipeline:
    def __init__(self, tokenizer, text_encoder, transformer):
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.transformer = transformer

    def encode_prompt(self, prompt, do_classifier_free_guidance=True, negative_prompt="", num_images_per_prompt=1,
                      device=None, prompt_embeds=None, negative_prompt_embeds=None, prompt_attention_mask=None,
                      negative_prompt_attention_mask=None, clean_caption=False, max_sequence_length=300, **kwargs):
        device = device or torch.device("cpu")
        if prompt is not None and isinstance(prompt, str):
            batch_size = 1
        elif prompt is not None and isinstance(prompt, list):
            batch_size = len(prompt)
        else:
            batch_size = prompt_embeds.shape[0]

        max_length = max_sequence_length
        if prompt_embeds is None:
            text_inputs = self.tokenizer(prompt, padding="max_length", max_length=max_length, truncation=True,
                                         add_special_tokens=True, return_tensors="pt")
            text_input_ids = text_inputs.input_ids
            prompt_attention_mask = text_inputs.attention_mask
            prompt_attention_mask = prompt_attention_mask.to(device)
            prompt_embeds = self.text_encoder(text_input_ids.to(device), attention_mask=prompt_attention_mask)
            prompt_embeds = prompt_embeds[0]

        dtype = self.text_encoder.dtype
        prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)

        bs_embed, seq_len, _ = prompt_embeds.shape
        # duplicate text embeddings and attention mask for each generation per prompt, using mps friendly method
        prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
        prompt_embeds = prompt_embeds.view(bs_embed * num_images_per_prompt, seq_len, -1)
        if FIXED:
            prompt_attention_mask = prompt_attention_mask.repeat(1, num_images_per_prompt)
            prompt_attention_mask = prompt_attention_mask.view(bs_embed * num_images_per_prompt, -1)
        else:
            prompt_attention_mask = prompt_attention_mask.view(bs_embed, -1)
            prompt_attention_mask = prompt_attention_mask.repeat(num_images_per_prompt, 1)

        # get unconditional embeddings for classifier free guidance
        if do_classifier_free_guidance and negative_prompt_embeds is None:
            uncond_tokens = [negative_prompt] * batch_size if isinstance(negative_prompt, str) else negative_prompt
            max_length = prompt_embeds.shape[1]
            uncond_input = self.tokenizer(uncond_tokens, padding="max_length", max_length=max_length,
                                          truncation=True, return_attention_mask=True, add_special_tokens=True,
                                          return_tensors="pt")
            negative_prompt_attention_mask = uncond_input.attention_mask
            negative_prompt_attention_mask = negative_prompt_attention_mask.to(device)
            negative_prompt_embeds = self.text_encoder(uncond_input.input_ids.to(device),
                                                       attention_mask=negative_prompt_attention_mask)
            negative_prompt_embeds = negative_prompt_embeds[0]

        if do_classifier_free_guidance:
            seq_len = negative_prompt_embeds.shape[1]
            negative_prompt_embeds = negative_prompt_embeds.to(dtype=dtype, device=device)
            negative_prompt_embeds = negative_prompt_embeds.repeat(1, num_images_per_prompt, 1)
            negative_prompt_embeds = negative_prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)
            if FIXED:
                negative_prompt_attention_mask = negative_prompt_attention_mask.repeat(1, num_images_per_prompt)
                negative_prompt_attention_mask = negative_prompt_attention_mask.view(bs_embed * num_images_per_prompt, -1)
            else:
                negative_prompt_attention_mask = negative_prompt_attention_mask.view(bs_embed, -1)
                negative_prompt_attention_mask = negative_prompt_attention_mask.repeat(num_images_per_prompt, 1)
        else:
            negative_prompt_embeds = None
            negative_prompt_attention_mask = None

        return prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask

    @torch.no_grad()
    def __call__(self, prompt, negative_prompt="", num_inference_steps=3, guidance_scale=4.5, num_images_per_prompt=1,
                 height=16, width=16, max_sequence_length=300):
        batch_size = 1 if isinstance(prompt, str) else len(prompt)
        do_classifier_free_guidance = guidance_scale > 1.0
        (prompt_embeds, prompt_attention_mask, negative_prompt_embeds, negative_prompt_attention_mask) = self.encode_prompt(
            prompt, do_classifier_free_guidance, negative_prompt=negative_prompt,
            num_images_per_prompt=num_images_per_prompt, max_sequence_length=max_sequence_length,
        )
        if do_classifier_free_guidance:
            prompt_embeds = torch.cat([negative_prompt_embeds, prompt_embeds], dim=0)
            prompt_attention_mask = torch.cat([negative_prompt_attention_mask, prompt_attention_mask], dim=0)
        self.last_prompt_attention_mask = prompt_attention_mask

        latent_channels = self.transformer.in_channels
        latents = torch.randn(batch_size * num_images_per_prompt, latent_channels, height // 8, width // 8)
        added_cond_kwargs = {"resolution": None, "aspect_ratio": None}
        timesteps = torch.linspace(999, 0, num_inference_steps).long()
        for i, t in enumerate(timesteps):
            latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
            current_timestep = t[None].expand(latent_model_input.shape[0])
            noise_pred = self.transformer(
                latent_model_input,
                encoder_hidden_states=prompt_embeds,
                encoder_attention_mask=prompt_attention_mask,
                timestep=current_timestep,
                added_cond_kwargs=added_cond_kwargs,
                return_dict=False,
            )[0]
            if do_classifier_free_guidance:
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            # learned sigma
            noise_pred = noise_pred.chunk(2, dim=1)[0]
            latents = latents - noise_pred / num_inference_steps  # (scheduler.step trimmed)
        return latents


if __name__ == "__main__":
    t5_config = T5Config(vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                         relative_attention_num_buckets=8, dropout_rate=0.0)
    text_encoder = T5EncoderModel(t5_config).eval()
    transformer = PixArtTransformer2DModel(caption_channels=16, in_channels=4, out_channels=8).eval()
    pipe = PixArtSigmaPipeline(TinyT5Tokenizer(), text_encoder, transformer)

    prompts = ["a cat", "a small blue bird sitting on a branch"]
    images = pipe(prompts, num_images_per_prompt=2, max_sequence_length=10, num_inference_steps=3)

    n_rows = len(prompts) * 2
    cond_mask = pipe.last_prompt_attention_mask[n_rows:]  # conditional half of the CFG batch: rows p0,p0,p1,p1
    print("valid T5 tokens in each conditional row's mask (rows hold prompts 0,0,1,1):", cond_mask.sum(-1).tolist())
    print(f"fixed={FIXED} latents mean={images.mean().item():.6f}")
