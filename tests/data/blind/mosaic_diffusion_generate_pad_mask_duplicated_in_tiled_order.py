"""mosaicml/diffusion StableDiffusion.generate: the text pad mask is duplicated in a different row order
from the prompt embeddings when ``num_images_per_prompt > 1``.

Citation: mosaicml/diffusion#130 ("fixed masked padding bug.", merged 2024-03-26, commit 5f3c9aa) in
diffusion/models/stable_diffusion.py.  (Not #147, the later ``mask_pad_tokens=False`` fix.)

Bug: ``_prepare_text_embeddings`` duplicated the embeddings per image with
``prompt_embeds.repeat(1, n, 1).view(bs * n, seq_len, -1)`` (rows p0,p0,p1,p1) but the U-Net's
cross-attention pad mask, a ``[B, 77]`` tensor, with ``tokenized_pad_mask.repeat(1, n, 1).view(bs * n,
seq_len)``; on a 2-D tensor that ``repeat`` prepends a dimension and tiles the batch (rows p0,p1,p0,p1).
With several prompts and several images per prompt, images were generated with another prompt's padding
mask: real text tokens hidden from cross-attention, or padding attended.

Fix (5f3c9aa): ``_create_unet_attention_mask`` then ``_duplicate_tensor(tensor, n)`` for embeddings, pad
mask and pooled embeddings alike (``tensor.repeat(1, n, ...)`` then ``view(batch * n, seq_len, ...)``).

This program keeps ``generate`` / ``_prepare_text_embeddings`` (abridged: no SDXL, no VAE, one scheduler
step) with the flag ``mask_pad_tokens=True``; the U-Net is a single cross-attention block that turns
``encoder_attention_mask`` into a diffusers-style additive bias for ``F.scaled_dot_product_attention``.
Two prompts of 5 and 2 tokens padded to 8, ``num_images_per_prompt=2``, guidance on (negative prompt '').
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class TokenizerStub:
    model_max_length = 8
    pad_token_id = 0

    def __call__(self, prompts, padding="max_length", max_length=None, truncation=True, return_tensors="pt"):
        max_length = max_length or self.model_max_length
        ids, mask = [], []
        for p in prompts:
            toks = [1] + [3 + sum(map(ord, w)) % 50 for w in p.split()][: max_length - 2] + [2]
            ids.append(toks + [self.pad_token_id] * (max_length - len(toks)))
            mask.append([1] * len(toks) + [0] * (max_length - len(toks)))
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


class TextEncoder(nn.Module):
    def __init__(self, vocab=64, dim=32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, input_ids, attention_mask=None):
        return (self.norm(self.embed(input_ids)),)


class CrossAttnUNet(nn.Module):
    """One transformer block of a U-Net: latents (as tokens) cross-attend the text embeddings."""

    def __init__(self, channels=4, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.proj_in = nn.Linear(channels, dim)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.proj_out = nn.Linear(dim, channels)

    def forward(self, sample, timestep, encoder_hidden_states, encoder_attention_mask=None):
        B, C, H, W = sample.shape
        x = self.proj_in(sample.flatten(2).transpose(1, 2))
        if encoder_attention_mask is not None:
            # diffusers UNet2DConditionModel: keep mask -> bias, then one row per query broadcast
            encoder_attention_mask = (1 - encoder_attention_mask.to(x.dtype)) * -10000.0
            encoder_attention_mask = encoder_attention_mask[:, None, None, :]
        q = self.to_q(x).view(B, -1, self.heads, 8).transpose(1, 2)
        k = self.to_k(encoder_hidden_states).view(B, -1, self.heads, 8).transpose(1, 2)
        v = self.to_v(encoder_hidden_states).view(B, -1, self.heads, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=encoder_attention_mask)
        out = self.proj_out(out.transpose(1, 2).reshape(B, H * W, -1))
        return (out.transpose(1, 2).reshape(B, C, H, W),)


def _create_unet_attention_mask(attention_mask):
    """Takes the union of multiple attention masks if given more than one mask."""
    if len(attention_mask.shape) == 2:
        return attention_mask
    elif len(attention_mask.shape) == 3:
        encoder_attention_mask = attention_mask[:, 0]
        for i in range(1, attention_mask.shape[1]):
            encoder_attention_mask |= attention_mask[:, i]
        return encoder_attention_mask
    raise ValueError(f'attention_mask should have either 2 or 3 dimensions: {attention_mask.shape}')


def _duplicate_tensor(tensor, num_images_per_prompt):
    """Duplicate tensor for multiple generations from a single prompt."""
    batch_size, seq_len = tensor.shape[:2]
    tensor = tensor.repeat(1, num_images_per_prompt, *[1] * len(tensor.shape[2:]))
    return tensor.view(batch_size * num_images_per_prompt, seq_len, *[-1] * len(tensor.shape[2:]))


class StableDiffusion(nn.Module):
    def __init__(self, mask_pad_tokens: bool = True):
        super().__init__()
        self.tokenizer = TokenizerStub()
        self.text_encoder = TextEncoder()
        self.unet = CrossAttnUNet()
        self.mask_pad_tokens = mask_pad_tokens

    @torch.no_grad()
    def generate(self, prompt, negative_prompt=None, height=4, width=4, guidance_scale=3.0,
                 num_images_per_prompt=1, seed=0):
        text_embeddings, pad_attn_mask = self._prepare_text_embeddings(prompt, num_images_per_prompt)
        batch_size = len(text_embeddings)  # len prompts * num_images_per_prompt
        do_classifier_free_guidance = guidance_scale > 1.0
        encoder_attn_mask = pad_attn_mask
        if do_classifier_free_guidance:
            if negative_prompt is None:
                negative_prompt = [''] * (batch_size // num_images_per_prompt)
            unconditional_embeddings, uncond_pad_attn_mask = self._prepare_text_embeddings(
                negative_prompt, num_images_per_prompt)
            text_embeddings = torch.cat([unconditional_embeddings, text_embeddings])
            if pad_attn_mask is not None:
                encoder_attn_mask = torch.cat([uncond_pad_attn_mask, pad_attn_mask])
        generator = torch.Generator().manual_seed(seed)
        latents = torch.randn((batch_size, 4, height, width), generator=generator)
        latent_model_input = torch.cat([latents] * 2) if do_classifier_free_guidance else latents
        pred = self.unet(latent_model_input, torch.tensor(999), encoder_hidden_states=text_embeddings,
                         encoder_attention_mask=encoder_attn_mask)[0]
        if do_classifier_free_guidance:
            pred_uncond, pred_text = pred.chunk(2)
            pred = pred_uncond + guidance_scale * (pred_text - pred_uncond)
        return latents - pred  # one scheduler step stands in for the loop

    def _prepare_text_embeddings(self, prompt, num_images_per_prompt):
        tokenized_out = self.tokenizer(prompt, padding='max_length', max_length=self.tokenizer.model_max_length)
        tokenized_prompts = tokenized_out['input_ids']
        tokenized_pad_mask = tokenized_out['attention_mask']
        prompt_embeds = self.text_encoder(tokenized_prompts, attention_mask=tokenized_pad_mask)[0]
        if FIXED:
            prompt_embeds = _duplicate_tensor(prompt_embeds, num_images_per_prompt)
            if not self.mask_pad_tokens:
                tokenized_pad_mask = None
            if tokenized_pad_mask is not None:
                tokenized_pad_mask = _create_unet_attention_mask(tokenized_pad_mask)
                tokenized_pad_mask = _duplicate_tensor(tokenized_pad_mask, num_images_per_prompt)
            return prompt_embeds, tokenized_pad_mask
        # duplicate text embeddings for each generation per prompt
        bs_embed, seq_len, _ = prompt_embeds.shape
        prompt_embeds = prompt_embeds.repeat(1, num_images_per_prompt, 1)
        prompt_embeds = prompt_embeds.view(bs_embed * num_images_per_prompt, seq_len, -1)
        if self.mask_pad_tokens and tokenized_pad_mask is not None:
            if len(tokenized_pad_mask.shape) == 3:
                attention_mask = tokenized_pad_mask[:, 0]
                for i in range(1, tokenized_pad_mask.shape[1]):
                    attention_mask |= tokenized_pad_mask[:, i]
                tokenized_pad_mask = attention_mask
            tokenized_pad_mask = tokenized_pad_mask.repeat(1, num_images_per_prompt, 1)
            tokenized_pad_mask = tokenized_pad_mask.view(bs_embed * num_images_per_prompt, seq_len)  # [B, 77]
        return prompt_embeds, tokenized_pad_mask


def main():
    torch.manual_seed(0)
    model = StableDiffusion(mask_pad_tokens=True).eval()
    images = model.generate(["a red fox in snow", "lighthouse"], num_images_per_prompt=2)
    print(f"{'fixed' if FIXED else 'buggy'} image means {[round(v, 4) for v in images.mean((1, 2, 3)).tolist()]}")


if __name__ == "__main__":
    main()
