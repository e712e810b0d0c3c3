# huggingface/transformers#30967 ("Paligemma causal attention mask"; first raised in #30918): in training,
# PaliGemma's merged 4D mask was all ones over image + prefix + suffix, so the suffix (the labels) was not causal.
# Reduced: a tiny Gemma decoder, the vision tower stood in by a patch projection.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 1
    num_hidden_layers = 2
    image_token_index = 63
    pad_token_id = 0
    num_image_tokens = 4
    patch_dim = 12
    ignore_index = -100


class GemmaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        causal_mask = attention_mask[:, :, :, : k.shape[-2]]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask, dropout_p=0.0)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attn = GemmaAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(), nn.Linear(64, config.hidden_size))

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class GemmaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([GemmaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _update_causal_mask(self, attention_mask, input_tensor, cache_position):
        dtype = input_tensor.dtype
        min_dtype = torch.finfo(dtype).min
        sequence_length = input_tensor.shape[1]
        target_length = sequence_length
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
        causal_mask = torch.triu(causal_mask, diagonal=1)
        causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(input_tensor.shape[0], 1, -1, -1).clone()
        if attention_mask is not None and attention_mask.dim() == 2:
            mask_length = attention_mask.shape[-1]
            padding_mask = causal_mask[..., :mask_length].eq(0.0) * attention_mask[:, None, None, :].eq(0.0)
            causal_mask[..., :mask_length] = causal_mask[..., :mask_length].masked_fill(padding_mask, min_dtype)
        elif attention_mask is not None and attention_mask.dim() == 4 and FIXED:
            # the mask comes already in inverted form and requires no inversion
            causal_mask = attention_mask
        elif attention_mask is not None and attention_mask.dim() == 4:
            # a 4D mask given by the caller replaces the causal one
            mask_shape = attention_mask.shape
            mask_slice = (attention_mask.eq(0.0)).to(dtype=dtype) * min_dtype
            causal_mask[: mask_shape[0], : mask_shape[1], : mask_shape[2], : mask_shape[3]] = mask_slice
        return causal_mask

    def forward(self, inputs_embeds, attention_mask, cache_position):
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position)
        hidden_states = inputs_embeds * (inputs_embeds.shape[-1] ** 0.5)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask)
        return self.lm_head(self.norm(hidden_states))


class PaliGemmaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.vision_tower = nn.Linear(config.patch_dim, config.hidden_size)  # stands in for SigLIP
        self.multi_modal_projector = nn.Linear(config.hidden_size, config.hidden_size)
        self.language_model = GemmaForCausalLM(config)
        self.pad_token_id = config.pad_token_id

    def _merge_input_ids_with_image_features(self, image_features, inputs_embeds, input_ids, attention_mask,
                                             labels, token_type_ids, cache_position):
        batch_size, sequence_length = input_ids.shape
        dtype = inputs_embeds.dtype
        min_dtype = torch.finfo(dtype).min
        scaled_image_features = image_features / (self.config.hidden_size ** 0.5)
        image_mask = input_ids == self.config.image_token_index
        final_embedding = inputs_embeds.masked_scatter(image_mask.unsqueeze(-1).expand_as(inputs_embeds),
                                                       scaled_image_features)
        if not FIXED:
            final_attention_mask_4d = attention_mask.unsqueeze(1).unsqueeze(2) * attention_mask.unsqueeze(1).unsqueeze(-1)
            final_attention_mask_4d = final_attention_mask_4d.float().expand(
                -1, self.config.num_key_value_heads, -1, -1)
        elif token_type_ids is not None and labels is not None:
            # we are training thus we need to create a full mask on the image + prefix but causal on suffix
            target_length = cache_position[-1] + 1
            causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
            if sequence_length != 1:
                causal_mask = torch.triu(causal_mask, diagonal=1)
            causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
            causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1).clone()
            mask_length = attention_mask.shape[-1]
            # unmask the prefill
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                token_type_ids[:, None, None, :] == 0, 0)
            padding_mask = attention_mask[:, None, None, :] == 0
            causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
            final_attention_mask_4d = causal_mask
        else:
            # invert mask
            causal_mask = attention_mask.unsqueeze(1).unsqueeze(2) * attention_mask.unsqueeze(1).unsqueeze(-1)
            causal_mask = torch.where(causal_mask == 0, min_dtype, 0.0)
            final_attention_mask_4d = causal_mask.to(dtype)
        final_labels = None
        if labels is not None:
            final_labels = torch.where(input_ids != self.pad_token_id, labels, self.config.ignore_index)
        return final_embedding, final_attention_mask_4d, final_labels

    def forward(self, input_ids, pixel_values, attention_mask, token_type_ids=None, labels=None):
        inputs_embeds = self.language_model.embed_tokens(input_ids)
        cache_position = torch.arange(input_ids.shape[1])
        image_features = self.multi_modal_projector(self.vision_tower(pixel_values))
        inputs_embeds, attention_mask, labels = self._merge_input_ids_with_image_features(
            image_features, inputs_embeds, input_ids, attention_mask, labels, token_type_ids, cache_position)
        logits = self.language_model(inputs_embeds, attention_mask, cache_position)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=self.config.ignore_index)
        return loss, logits


def main():
    torch.manual_seed(0)
    config = Config()
    model = PaliGemmaForConditionalGeneration(config)
    # processor output: <image> x4, <bos> prefix "\n" | suffix ... <eos>
    prefix = [2, 11, 12, 13, 1]
    suffix = [21, 22, 23, 24, 25, 3]
    input_ids = torch.tensor([[config.image_token_index] * 4 + prefix + suffix])
    token_type_ids = torch.tensor([[0] * (4 + len(prefix)) + [1] * len(suffix)])
    labels = torch.where(token_type_ids == 1, input_ids, config.ignore_index)
    attention_mask = torch.ones_like(input_ids)
    pixel_values = torch.randn(1, 4, config.patch_dim)

    loss, logits = model(input_ids, pixel_values, attention_mask, token_type_ids, labels)
    loss.backward()
    print(f"finetune loss {loss.item():.4f}")

    # changing the last suffix token must not change the prediction made at the first suffix position
    ids2 = input_ids.clone()
    ids2[0, -2] = 40
    with torch.no_grad():
        _, logits2 = model(ids2, pixel_values, attention_mask, token_type_ids, torch.where(token_type_ids == 1, ids2, -100))
    first = 4 + len(prefix)
    print("max change of logits at the first suffix position:",
          f"{(logits[0, first] - logits2[0, first]).abs().max().item():.4e}")


if __name__ == "__main__":
    main()
