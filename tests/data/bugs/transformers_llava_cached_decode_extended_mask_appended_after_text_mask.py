"""LLaVA (transformers, legacy merge path): cached decode steps build the attention mask in the wrong order.

Citation: huggingface/transformers#29389 "Correct llava mask & fix missing setter for vocab_size"
(merged; fixes huggingface/transformers#28184 "LLaVa Left Padding Got Weird Results").
Bug: in ``LlavaForConditionalGeneration.forward``, a decode step with a cache only gets the
*text-level* ``attention_mask`` from ``generate`` (prompt tokens + generated tokens), while the cache
holds the merged sequence, where every ``<image>`` token became ``num_image_patches`` positions and
rows with fewer images were padded on the left by ``_merge_input_ids_with_image_features``. The old
code appended ``extended_attention_mask`` (ones for the ``target_seqlen - attention_mask.shape[1]``
extra positions, zeroed where the first layer's cached keys are all zero) *after* the text mask:
``torch.cat((attention_mask, extended_attention_mask), dim=1)``. The text mask's columns no longer
line up with the cached positions: the merge padding is attended, and real cached tokens are hidden.
As the PR says, "this disregards the attention_mask used during the first forward pass".
Fix: ``extended_attention_mask`` spans the whole cache (``past_length``), zero at the cached
positions whose keys are all zero, and only the last ``target_length`` text-mask columns are
appended: ``torch.cat((extended_attention_mask, attention_mask[:, -target_length:]), dim=1)``; the
merge also zeroes the embeddings of pad tokens so they are found the same way.
Reproduction: the 4.38-era merge (left padding), a one-layer Llama-style decoder (RMSNorm, no bias,
so an all-zero embedding gives an all-zero key) with an explicit tuple KV cache, a prefill with the
merged 4D mask and one decode step; attention is F.scaled_dot_product_attention. The batch has one
prompt with two images and one with one image and tokenizer left padding. I read the PR and issue
descriptions; the fixed lines follow the transformers LLaVA code after that PR.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.h, self.d = heads, hidden // heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x, attention_mask_4d, past_key_value=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.h, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.h, self.d).transpose(1, 2)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask_4d)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), (k, v)


def _prepare_4d_causal_attention_mask(attention_mask, q_len, dtype):
    b, kv_len = attention_mask.shape
    past = kv_len - q_len
    i = torch.arange(q_len)[:, None] + past
    j = torch.arange(kv_len)[None, :]
    allowed = (j <= i)[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(b, 1, q_len, kv_len, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.pad_token_id = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.input_layernorm = RMSNorm(config.hidden_size)
        self.self_attn = LlamaAttention(config.hidden_size, config.num_attention_heads)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _merge_input_ids_with_image_features(self, image_features, inputs_embeds, input_ids, attention_mask):
        num_images, num_image_patches, embed_dim = image_features.shape
        batch_size, sequence_length = input_ids.shape
        left_padding = not torch.sum(input_ids[:, -1] == torch.tensor(self.pad_token_id))
        special_image_token_mask = input_ids == self.config.image_token_index
        num_special_image_tokens = torch.sum(special_image_token_mask, dim=-1)
        max_embed_dim = (num_special_image_tokens.max() * (num_image_patches - 1)) + sequence_length
        batch_indices, non_image_indices = torch.where(input_ids != self.config.image_token_index)
        new_token_positions = torch.cumsum((special_image_token_mask * (num_image_patches - 1) + 1), -1) - 1
        nb_image_pad = max_embed_dim - 1 - new_token_positions[:, -1]
        if left_padding:
            new_token_positions += nb_image_pad[:, None]
        text_to_overwrite = new_token_positions[batch_indices, non_image_indices]
        final_embedding = torch.zeros(batch_size, max_embed_dim, embed_dim, dtype=inputs_embeds.dtype)
        final_attention_mask = torch.zeros(batch_size, max_embed_dim, dtype=attention_mask.dtype)
        final_embedding[batch_indices, text_to_overwrite] = inputs_embeds[batch_indices, non_image_indices]
        final_attention_mask[batch_indices, text_to_overwrite] = attention_mask[batch_indices, non_image_indices]
        image_to_overwrite = torch.all(final_embedding == 0, dim=-1)
        image_to_overwrite &= image_to_overwrite.cumsum(-1) - 1 >= nb_image_pad[:, None]
        final_embedding[image_to_overwrite] = image_features.contiguous().reshape(-1, embed_dim)
        final_attention_mask |= image_to_overwrite
        if FIXED:
            # zero the pad tokens' embeddings: decode steps find non-attended positions from the cache
            batch_indices, pad_indices = torch.where(input_ids == self.pad_token_id)
            indices_to_mask = new_token_positions[batch_indices, pad_indices]
            final_embedding[batch_indices, indices_to_mask] = 0
        return final_embedding, final_attention_mask

    def forward(self, input_ids, image_features=None, attention_mask=None, past_key_values=None):
        inputs_embeds = self.embed_tokens(input_ids)
        if past_key_values is None and image_features is not None:
            inputs_embeds, attention_mask = self._merge_input_ids_with_image_features(
                image_features, inputs_embeds, input_ids, attention_mask)
        elif past_key_values is not None and input_ids.shape[1] == 1:
            first_layer_past_key_value = past_key_values[0][0][:, :, :, 0]
            batch_index, non_attended_tokens = torch.where(first_layer_past_key_value.float().sum(-2) == 0)
            if FIXED:
                target_length = input_ids.shape[1]
                past_length = first_layer_past_key_value.shape[-1]
                extended_attention_mask = torch.ones((attention_mask.shape[0], past_length),
                                                     dtype=attention_mask.dtype)
            else:
                target_seqlen = first_layer_past_key_value.shape[-1] + 1
                extended_attention_mask = torch.ones((attention_mask.shape[0], target_seqlen - attention_mask.shape[1]),
                                                     dtype=attention_mask.dtype)
            valid_indices = non_attended_tokens < extended_attention_mask.size(-1)
            new_batch_index = batch_index[valid_indices]
            new_non_attended_tokens = non_attended_tokens[valid_indices]
            extended_attention_mask[new_batch_index, new_non_attended_tokens] = 0
            if FIXED:
                attention_mask = torch.cat((extended_attention_mask, attention_mask[:, -target_length:]), dim=1)
            else:
                attention_mask = torch.cat((attention_mask, extended_attention_mask), dim=1)
        mask_4d = _prepare_4d_causal_attention_mask(attention_mask, inputs_embeds.shape[1], inputs_embeds.dtype)
        attn_out, present = self.self_attn(self.input_layernorm(inputs_embeds), mask_4d,
                                           past_key_values[0] if past_key_values is not None else None)
        hidden = inputs_embeds + attn_out
        return self.lm_head(hidden), (present,)


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=40, hidden_size=32, num_attention_heads=4, image_token_index=32,
                             pad_token_id=0)
    model = LlavaForConditionalGeneration(config).eval()
    img, pad = config.image_token_index, config.pad_token_id
    input_ids = torch.tensor([[1, img, img, 5, 6, 7, 8],    # two images
                              [pad, 1, img, 9, 10, 11, 12]])  # one image, left padded by the tokenizer
    attention_mask = (input_ids != pad).long()
    image_features = torch.randn(3, 3, config.hidden_size)  # 3 images x 3 patches
    with torch.no_grad():
        logits, past_key_values = model(input_ids, image_features=image_features, attention_mask=attention_mask)
        next_tokens = logits[:, -1].argmax(-1, keepdim=True)
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=attention_mask.dtype)], dim=1)
        logits, _ = model(next_tokens, attention_mask=attention_mask, past_key_values=past_key_values)
    print("fixed" if FIXED else "buggy", logits[:, -1].argmax(-1).tolist(), f"{logits.abs().mean().item():.6f}")


if __name__ == "__main__":
    main()
