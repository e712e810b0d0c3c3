"""Chroma MMDiT joint attention gets its 0/1 padding mask as floats, so SDPA adds it instead of masking.

Citation: huggingface/diffusers#12116, fixed by huggingface/diffusers#12263 (commit 0a151115bb, "Fix
#12116: preserve boolean dtype for attention masks in ChromaPipeline"); diff read upstream.

Bug: ``ChromaPipeline._get_t5_prompt_embeds`` built the "real tokens plus one pad" mask as ``.long()`` and
then cast it to the text encoder's dtype; ``_prepare_attention_mask`` concatenated float ones for the
image tokens and cast again to ``dtype``. ``ChromaTransformerBlock`` forms
``attention_mask[:, None, None, :] * attention_mask[:, None, :, None]`` and the Flux attention processor
hands it to ``F.scaled_dot_product_attention``. A float mask is an additive bias there: the padded text
tokens get +0 and everything else +1, so no padding is masked in the joint text+image attention.
Fix: keep the mask boolean (``.bool()``, ``dtype=torch.bool`` ones for the image tokens, no cast).

This program keeps the pipeline's mask code and one Chroma double-stream block (text tokens first, then
packed image tokens, as the Flux processor concatenates them). The T5 encoder is replaced by an
embedding stand-in (no attention of its own) so that only the transformer's attention is traced.
Two prompts of 3 and 6 tokens are padded to ``max_sequence_length=10``; the image is 2x2 packed latents.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class StandInTextEncoder(nn.Module):
    """Returns per-token embeddings like ``T5EncoderModel(...)[0]`` (no attention)."""

    dtype = torch.float32

    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)

    def forward(self, input_ids, output_hidden_states=False, attention_mask=None):
        return (self.embed(input_ids),)


class ChromaJointAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.add_q_proj, self.add_k_proj, self.add_v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.to_out, self.to_add_out = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        batch_size = hidden_states.shape[0]
        head_dim = hidden_states.shape[-1] // self.heads

        def split(x):
            return x.view(batch_size, -1, self.heads, head_dim).transpose(1, 2)

        query, key, value = split(self.to_q(hidden_states)), split(self.to_k(hidden_states)), split(self.to_v(hidden_states))
        encoder_query = split(self.add_q_proj(encoder_hidden_states))
        encoder_key = split(self.add_k_proj(encoder_hidden_states))
        encoder_value = split(self.add_v_proj(encoder_hidden_states))

        # attention over [text, image], text first as in FluxAttnProcessor2_0
        query = torch.cat([encoder_query, query], dim=2)
        key = torch.cat([encoder_key, key], dim=2)
        value = torch.cat([encoder_value, value], dim=2)

        hidden_states = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                                       is_causal=False)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        txt_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :txt_len], hidden_states[:, txt_len:]
        return self.to_out(hidden_states), self.to_add_out(encoder_hidden_states)


class ChromaTransformerBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = ChromaJointAttention(dim, heads)

    def forward(self, hidden_states, encoder_hidden_states, attention_mask=None):
        norm_hidden_states = self.norm1(hidden_states)
        norm_encoder_hidden_states = self.norm1_context(encoder_hidden_states)
        if attention_mask is not None:
            attention_mask = attention_mask[:, None, None, :] * attention_mask[:, None, :, None]

        attn_output, context_attn_output = self.attn(
            hidden_states=norm_hidden_states,
            encoder_hidden_states=norm_encoder_hidden_states,
            attention_mask=attention_mask,
        )
        return hidden_states + attn_output, encoder_hidden_states + context_attn_output


class ChromaPipelineMaskPart:
    def __init__(self, text_encoder, transformer_block):
        self.text_encoder = text_encoder
        self.transformer_block = transformer_block

    def tokenizer(self, prompt, max_length):
        ids = torch.zeros(len(prompt), max_length, dtype=torch.long)
        mask = torch.zeros(len(prompt), max_length, dtype=torch.long)
        for i, words in enumerate(prompt):
            toks = [3 + (sum(map(ord, w)) % 60) for w in words.split()] + [1]  # </s> = 1, <pad> = 0
            ids[i, :len(toks)] = torch.tensor(toks)
            mask[i, :len(toks)] = 1
        return ids, mask

    def _get_t5_prompt_embeds(self, prompt, max_sequence_length=512, device="cpu"):
        batch_size = len(prompt)
        text_input_ids, tokenizer_mask = self.tokenizer(prompt, max_sequence_length)
        attention_mask = tokenizer_mask.clone()

        # Chroma requires the attention mask to include one padding token
        seq_lengths = attention_mask.sum(dim=1)
        mask_indices = torch.arange(attention_mask.size(1)).unsqueeze(0).expand(batch_size, -1)
        if FIXED:
            attention_mask = (mask_indices <= seq_lengths.unsqueeze(1)).bool()
        else:
            attention_mask = (mask_indices <= seq_lengths.unsqueeze(1)).long()

        prompt_embeds = self.text_encoder(
            text_input_ids.to(device), output_hidden_states=False, attention_mask=attention_mask.to(device)
        )[0]

        dtype = self.text_encoder.dtype
        prompt_embeds = prompt_embeds.to(dtype=dtype, device=device)
        if FIXED:
            attention_mask = attention_mask.to(device=device)
        else:
            attention_mask = attention_mask.to(dtype=dtype, device=device)
        return prompt_embeds, attention_mask

    def _prepare_attention_mask(self, batch_size, sequence_length, dtype, attention_mask=None):
        if attention_mask is None:
            return attention_mask

        # Extend the prompt attention mask to account for image tokens in the final sequence
        if FIXED:
            attention_mask = torch.cat(
                [attention_mask, torch.ones(batch_size, sequence_length, device=attention_mask.device, dtype=torch.bool)],
                dim=1,
            )
        else:
            attention_mask = torch.cat(
                [attention_mask, torch.ones(batch_size, sequence_length, device=attention_mask.device)],
                dim=1,
            )
            attention_mask = attention_mask.to(dtype)

        return attention_mask

    def __call__(self, prompt, latents, max_sequence_length):
        prompt_embeds, prompt_attention_mask = self._get_t5_prompt_embeds(prompt, max_sequence_length)
        attention_mask = self._prepare_attention_mask(latents.shape[0], latents.shape[1], latents.dtype,
                                                      prompt_attention_mask)
        return self.transformer_block(latents, prompt_embeds, attention_mask=attention_mask)


def main():
    torch.manual_seed(0)
    dim, heads = 32, 4
    pipe = ChromaPipelineMaskPart(StandInTextEncoder(64, dim), ChromaTransformerBlock(dim, heads))
    latents = torch.randn(2, 4, dim)  # 2x2 packed latents per image
    with torch.no_grad():
        img, txt = pipe(["a cat", "a cat sat on the mat"], latents, max_sequence_length=10)
    print("image tokens", tuple(img.shape), "img[0,0,:3]", [round(v, 4) for v in img[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
