"""mosaicml/diffusion: generation masked the text encoder's pad tokens although mask_pad_tokens=False.

Citation: mosaicml/diffusion#147 ("Fix bug in stable diffusion when mask_pad_tokens is false", merged).
Read: the PR description only (the diff itself was not available to me); the surrounding code
(`StableDiffusion._prepare_text_embeddings` / `generate`) is written after the repository's
diffusion/models/stable_diffusion.py.

Bug (PR text): "when `mask_pad_tokens=False` in the stable diffusion model, the mask is still passed
to the text encoder at generation time.  This introduces a train/test mismatch because the masked
tokens in the text encoder output are different from the unmasked tokens, and the model is trained
with the unmasked pad tokens."  The tokenizer's attention_mask was taken unconditionally and handed
to the CLIP text encoder (and on to the U-Net as `encoder_attention_mask`).
Fix: "only use the mask from the tokenizer output if `mask_pad_tokens=True`".

Reproduction: a StableDiffusion-like wrapper with `mask_pad_tokens=False`, a random-weight
transformers CLIPTextModel (causal self-attention + padding mask), prompts padded to
`model_max_length` (16 here), and one U-Net cross-attention block (diffusers' `Attention` written
out with F.scaled_dot_product_attention) consuming `encoder_hidden_states` /
`encoder_attention_mask`.  The tokenizer is replaced by a tiny whitespace tokenizer that returns
`input_ids` and `attention_mask` like a HF tokenizer with padding='max_length'.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import CLIPTextConfig, CLIPTextModel

FIXED = "--fixed" in sys.argv


class WhitespaceTokenizer:
    """Stands in for CLIPTokenizer(padding='max_length'): BOS, words, EOS, then pad."""

    model_max_length = 16
    bos, eos, pad = 1, 2, 0

    def __call__(self, prompts, padding='max_length', max_length=None, truncation=True, return_tensors='pt'):
        max_length = max_length or self.model_max_length
        ids, masks = [], []
        for p in prompts:
            toks = [self.bos] + [3 + (sum(map(ord, w)) % 90) for w in p.split()] + [self.eos]
            toks = toks[:max_length]
            ids.append(toks + [self.pad] * (max_length - len(toks)))
            masks.append([1] * len(toks) + [0] * (max_length - len(toks)))
        out = type('BatchEncoding', (), {})()
        out.input_ids = torch.tensor(ids)
        out.attention_mask = torch.tensor(masks)
        return out


class CrossAttention(nn.Module):
    """The U-Net's attn2: latent queries over text keys, `encoder_attention_mask` as key padding."""

    def __init__(self, query_dim, cross_attention_dim, heads=2, dim_head=8):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(cross_attention_dim, inner, bias=False)
        self.to_v = nn.Linear(cross_attention_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask=None):
        b, n, _ = hidden_states.shape
        q = self.to_q(hidden_states).view(b, n, self.heads, -1).transpose(1, 2)
        k = self.to_k(encoder_hidden_states).view(b, -1, self.heads, q.shape[-1]).transpose(1, 2)
        v = self.to_v(encoder_hidden_states).view(b, -1, self.heads, q.shape[-1]).transpose(1, 2)
        attn_mask = None
        if encoder_attention_mask is not None:
            # diffusers: (1 - mask) * -10000.0 as an additive bias over keys
            attn_mask = ((1 - encoder_attention_mask.to(q.dtype)) * -10000.0)[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class StableDiffusion(nn.Module):
    def __init__(self, text_encoder, tokenizer, mask_pad_tokens: bool = False, sdxl: bool = False):
        super().__init__()
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.mask_pad_tokens = mask_pad_tokens
        self.sdxl = sdxl
        self.attn2 = CrossAttention(8, text_encoder.config.hidden_size)

    def _prepare_text_embeddings(self, prompt, tokenized_prompts, tokenized_pad_mask, prompt_embeds,
                                 num_images_per_prompt):
        """Tokenizes and embeds prompts if needed, then duplicates embeddings per generation."""
        max_length = None if self.sdxl else self.tokenizer.model_max_length
        if tokenized_prompts is None:
            tokenized_out = self.tokenizer(prompt, padding='max_length', max_length=max_length,
                                           truncation=True, return_tensors='pt')
            tokenized_prompts = tokenized_out.input_ids
            if FIXED:
                if self.mask_pad_tokens:
                    tokenized_pad_mask = tokenized_out.attention_mask
            else:
                tokenized_pad_mask = tokenized_out.attention_mask
        text_embeddings = self.text_encoder(tokenized_prompts, attention_mask=tokenized_pad_mask)[0]

        bs_embed, seq_len, _ = text_embeddings.shape
        text_embeddings = text_embeddings.repeat(1, num_images_per_prompt, 1)
        text_embeddings = text_embeddings.view(bs_embed * num_images_per_prompt, seq_len, -1)
        if tokenized_pad_mask is not None:
            tokenized_pad_mask = tokenized_pad_mask.repeat(1, num_images_per_prompt, 1)
            tokenized_pad_mask = tokenized_pad_mask.view(bs_embed * num_images_per_prompt, seq_len)
        return text_embeddings, None, tokenized_pad_mask

    @torch.no_grad()
    def generate(self, prompt, num_images_per_prompt=1, steps=2):
        text_embeddings, _, pad_attn_mask = self._prepare_text_embeddings(
            prompt, None, None, None, num_images_per_prompt)
        encoder_attn_mask = pad_attn_mask if pad_attn_mask is not None else None
        latents = torch.randn(text_embeddings.shape[0], 4, 8)  # (B, H*W tokens, C)
        for _ in range(steps):
            latents = latents - 0.1 * self.attn2(latents, text_embeddings, encoder_attention_mask=encoder_attn_mask)
        return latents


def main():
    torch.manual_seed(0)
    config = CLIPTextConfig(vocab_size=96, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=16, bos_token_id=1,
                            eos_token_id=2, pad_token_id=0)
    config._attn_implementation = "sdpa"
    text_encoder = CLIPTextModel(config).eval()
    model = StableDiffusion(text_encoder, WhitespaceTokenizer(), mask_pad_tokens=False).eval()
    out = model.generate(["a photo of an astronaut riding a horse", "a red cube"])
    print("latents checksum", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
