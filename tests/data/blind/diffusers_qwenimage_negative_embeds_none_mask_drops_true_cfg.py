# huggingface/diffusers#13379 (commit 8d30d05de1, "fix(qwen): fix CFG failing when passing neg prompt embeds
# with none mask").
#
# Since #12987 QwenImagePipeline.encode_prompt returns `prompt_embeds_mask = None` when the mask has no padding
# (None means "every text token is valid" to the transformer, which then builds no joint mask). __call__ still
# decided whether a negative prompt was given from the mask: `has_neg_prompt = negative_prompt is not None or
# (negative_prompt_embeds is not None and negative_prompt_embeds_mask is not None)`. Negative embeds computed ahead
# with encode_prompt (unpadded, so their mask came back None) were therefore taken as "no negative prompt", and
# true CFG was silently switched off. The fix keys has_neg_prompt on the embeds alone and lets the None mask mean
# "all valid" in the uncond pass.
#
# Trimmed port: QwenImagePipeline.encode_prompt / __call__ (true CFG with norm rescale), QwenImageTransformer2DModel
# .forward (joint mask [text mask, ones for image], [:, None, None, :]), QwenDoubleStreamAttnProcessor2_0 (text then
# image tokens in one SDPA). RoPE, modulation and the VAE are left out; the text encoder is a small stand-in.
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class QwenDoubleStreamAttnProcessor2_0:
    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None):
        seq_txt = encoder_hidden_states.shape[1]
        b = hidden_states.shape[0]
        h = attn.heads

        def split(x):
            return x.unflatten(-1, (h, -1))

        img_query, img_key, img_value = (split(p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v))
        txt_query, txt_key, txt_value = (
            split(p(encoder_hidden_states)) for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
        )
        joint_query = torch.cat([txt_query, img_query], dim=1)
        joint_key = torch.cat([txt_key, img_key], dim=1)
        joint_value = torch.cat([txt_value, img_value], dim=1)

        # dispatch_attention_fn, native backend: (B, S, H, D) -> SDPA layout and back
        joint_hidden_states = F.scaled_dot_product_attention(
            joint_query.transpose(1, 2),
            joint_key.transpose(1, 2),
            joint_value.transpose(1, 2),
            attn_mask=attention_mask,
            dropout_p=0.0,
            is_causal=False,
        ).transpose(1, 2)
        joint_hidden_states = joint_hidden_states.flatten(2, 3).to(joint_query.dtype)
        txt_attn_output = joint_hidden_states[:, :seq_txt, :]
        img_attn_output = joint_hidden_states[:, seq_txt:, :]
        img_attn_output = attn.to_out[0](img_attn_output.contiguous())
        txt_attn_output = attn.to_add_out(txt_attn_output)
        return img_attn_output, txt_attn_output


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim)])
        self.to_add_out = nn.Linear(dim, dim)
        self.processor = QwenDoubleStreamAttnProcessor2_0()

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        return self.processor(self, hidden_states, encoder_hidden_states, attention_mask)


class QwenImageTransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.img_norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.txt_norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads)
        self.img_mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.txt_mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, encoder_hidden_states, temb, joint_attention_kwargs=None):
        joint_attention_kwargs = joint_attention_kwargs or {}
        img_attn, txt_attn = self.attn(
            hidden_states=self.img_norm1(hidden_states) * (1 + temb[:, None]),
            encoder_hidden_states=self.txt_norm1(encoder_hidden_states),
            **joint_attention_kwargs,
        )
        hidden_states = hidden_states + img_attn
        encoder_hidden_states = encoder_hidden_states + txt_attn
        hidden_states = hidden_states + self.img_mlp(hidden_states)
        encoder_hidden_states = encoder_hidden_states + self.txt_mlp(encoder_hidden_states)
        return encoder_hidden_states, hidden_states


class QwenImageTransformer2DModel(nn.Module):
    def __init__(self, in_channels=16, joint_attention_dim=24, dim=32, heads=4, num_layers=2):
        super().__init__()
        self.img_in = nn.Linear(in_channels, dim)
        self.txt_norm = nn.LayerNorm(joint_attention_dim)
        self.txt_in = nn.Linear(joint_attention_dim, dim)
        self.time_embed = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.transformer_blocks = nn.ModuleList([QwenImageTransformerBlock(dim, heads) for _ in range(num_layers)])
        self.norm_out = nn.LayerNorm(dim)
        self.proj_out = nn.Linear(dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask=None, timestep=None):
        if encoder_hidden_states_mask is not None and encoder_hidden_states_mask.dtype != torch.bool:
            encoder_hidden_states_mask = encoder_hidden_states_mask.to(torch.bool)
        hidden_states = self.img_in(hidden_states)
        encoder_hidden_states = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self.time_embed(timestep[:, None].to(hidden_states.dtype))

        # Construct joint attention mask once to avoid reconstructing in every block
        block_attention_kwargs = {}
        if encoder_hidden_states_mask is not None:
            batch_size, image_seq_len = hidden_states.shape[:2]
            image_mask = torch.ones((batch_size, image_seq_len), dtype=torch.bool, device=hidden_states.device)
            joint_attention_mask = torch.cat([encoder_hidden_states_mask, image_mask], dim=1)
            joint_attention_mask = joint_attention_mask[:, None, None, :]
            block_attention_kwargs["attention_mask"] = joint_attention_mask

        for block in self.transformer_blocks:
            encoder_hidden_states, hidden_states = block(
                hidden_states=hidden_states,
                encoder_hidden_states=encoder_hidden_states,
                temb=temb,
                joint_attention_kwargs=block_attention_kwargs,
            )
        return (self.proj_out(self.norm_out(hidden_states)),)


class TextEncoderStandIn(nn.Module):
    """Stands in for Qwen2.5-VL: returns last hidden states for right-padded ids."""

    def __init__(self, vocab=64, dim=24):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        m = attention_mask[..., None].to(x.dtype)
        ctx = (x * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
        return x + torch.tanh(self.mix(ctx))


class QwenImagePipeline:
    prompt_template_encode_start_idx = 2

    def __init__(self, text_encoder, transformer):
        self.text_encoder = text_encoder
        self.transformer = transformer

    def _extract_masked_hidden(self, hidden_states, mask):
        bool_mask = mask.bool()
        valid_lengths = bool_mask.sum(dim=1)
        selected = hidden_states[bool_mask]
        return torch.split(selected, valid_lengths.tolist(), dim=0)

    def _get_qwen_prompt_embeds(self, token_ids):
        drop_idx = self.prompt_template_encode_start_idx
        L = max(len(t) for t in token_ids)
        input_ids = torch.zeros(len(token_ids), L, dtype=torch.long)
        attention_mask = torch.zeros(len(token_ids), L, dtype=torch.long)
        for i, t in enumerate(token_ids):
            input_ids[i, : len(t)] = torch.tensor(t)
            attention_mask[i, : len(t)] = 1
        hidden_states = self.text_encoder(input_ids=input_ids, attention_mask=attention_mask)
        split_hidden_states = self._extract_masked_hidden(hidden_states, attention_mask)
        split_hidden_states = [e[drop_idx:] for e in split_hidden_states]
        attn_mask_list = [torch.ones(e.size(0), dtype=torch.long, device=e.device) for e in split_hidden_states]
        max_seq_len = max([e.size(0) for e in split_hidden_states])
        prompt_embeds = torch.stack(
            [torch.cat([u, u.new_zeros(max_seq_len - u.size(0), u.size(1))]) for u in split_hidden_states]
        )
        encoder_attention_mask = torch.stack(
            [torch.cat([u, u.new_zeros(max_seq_len - u.size(0))]) for u in attn_mask_list]
        )
        return prompt_embeds, encoder_attention_mask

    def encode_prompt(self, prompt=None, prompt_embeds=None, prompt_embeds_mask=None, num_images_per_prompt=1,
                      max_sequence_length=1024):
        batch_size = len(prompt) if prompt_embeds is None else prompt_embeds.shape[0]
        if prompt_embeds is None:
            prompt_embeds, prompt_embeds_mask = self._get_qwen_prompt_embeds(prompt)
        prompt_embeds = prompt_embeds[:, :max_sequence_length]
        _, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
        prompt_embeds = prompt_embeds.view(batch_size * num_images_per_prompt, seq_len, -1)
        if prompt_embeds_mask is not None:
            prompt_embeds_mask = prompt_embeds_mask[:, :max_sequence_length]
            prompt_embeds_mask = prompt_embeds_mask.repeat(1, num_images_per_prompt, 1)
            prompt_embeds_mask = prompt_embeds_mask.view(batch_size * num_images_per_prompt, seq_len)
            if prompt_embeds_mask.all():
                prompt_embeds_mask = None
        return prompt_embeds, prompt_embeds_mask

    @torch.no_grad()
    def __call__(self, prompt=None, negative_prompt=None, true_cfg_scale=4.0, num_inference_steps=4,
                 prompt_embeds=None, prompt_embeds_mask=None, negative_prompt_embeds=None,
                 negative_prompt_embeds_mask=None, image_seq_len=8, in_channels=16, generator=None):
        batch_size = len(prompt) if prompt_embeds is None else prompt_embeds.shape[0]
        if FIXED:
            has_neg_prompt = negative_prompt is not None or negative_prompt_embeds is not None
        else:
            has_neg_prompt = negative_prompt is not None or (
                negative_prompt_embeds is not None and negative_prompt_embeds_mask is not None
            )
        do_true_cfg = true_cfg_scale > 1 and has_neg_prompt
        prompt_embeds, prompt_embeds_mask = self.encode_prompt(
            prompt=prompt, prompt_embeds=prompt_embeds, prompt_embeds_mask=prompt_embeds_mask
        )
        if do_true_cfg:
            negative_prompt_embeds, negative_prompt_embeds_mask = self.encode_prompt(
                prompt=negative_prompt,
                prompt_embeds=negative_prompt_embeds,
                prompt_embeds_mask=negative_prompt_embeds_mask,
            )

        latents = torch.randn(batch_size, image_seq_len, in_channels, generator=generator)
        sigmas = np.linspace(1.0, 1 / num_inference_steps, num_inference_steps)
        sigmas = torch.tensor(np.append(sigmas, 0.0), dtype=torch.float32)
        for i in range(num_inference_steps):
            t = sigmas[i] * 1000
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            noise_pred = self.transformer(
                hidden_states=latents,
                timestep=timestep / 1000,
                encoder_hidden_states_mask=prompt_embeds_mask,
                encoder_hidden_states=prompt_embeds,
            )[0]
            if do_true_cfg:
                neg_noise_pred = self.transformer(
                    hidden_states=latents,
                    timestep=timestep / 1000,
                    encoder_hidden_states_mask=negative_prompt_embeds_mask,
                    encoder_hidden_states=negative_prompt_embeds,
                )[0]
                comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
                cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
                noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
                noise_pred = comb_pred * (cond_norm / noise_norm)
            # FlowMatchEulerDiscreteScheduler.step
            latents = latents + (sigmas[i + 1] - sigmas[i]) * noise_pred
        return latents


text_encoder = TextEncoderStandIn().eval()
transformer = QwenImageTransformer2DModel().eval()
pipe = QwenImagePipeline(text_encoder, transformer)

# template tokens (2, dropped) + prompt tokens; two prompts of different lengths -> padded, mask kept
prompts = [[1, 2, 11, 12, 13, 14, 15, 16], [1, 2, 21, 22, 23]]
negative = [[1, 2, 3], [1, 2, 3]]  # the same short negative prompt for both rows: no padding

with torch.no_grad():
    prompt_embeds, prompt_embeds_mask = pipe.encode_prompt(prompts)
    negative_prompt_embeds, negative_prompt_embeds_mask = pipe.encode_prompt(negative)

images = pipe(
    prompt_embeds=prompt_embeds,
    prompt_embeds_mask=prompt_embeds_mask,
    negative_prompt_embeds=negative_prompt_embeds,
    negative_prompt_embeds_mask=negative_prompt_embeds_mask,
    true_cfg_scale=4.0,
    generator=torch.Generator().manual_seed(0),
)
print("latents", tuple(images.shape), "mean |x|", round(images.abs().mean().item(), 5))
print(images[:, 0, :4])
