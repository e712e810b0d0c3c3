"""OFA (Hugging Face port): _expand_mask put the large negative on the 1s of an HF-style mask.

Citation: OFA-Sys/OFA#214 (commit af586a1, merged as 0088a1e on branch feature/add_transformers),
transformers/src/transformers/models/ofa/modeling_ofa.py.

The bug: ``_expand_mask`` filled ``torch.finfo(dtype).min`` wherever the 2-D mask was 1. The
encoder and the cross-attention fed it OFA's ``padding_mask`` (True at pads), but the decoder's
``_prepare_decoder_attention_mask`` fed it the caller's HF ``attention_mask`` (1 at real tokens),
so while fine-tuning for captioning every real caption token got the large negative in decoder
self-attention (on top of the ``-inf`` causal triangle).

The fix: ``_expand_mask`` inverts the mask first (``1.0 - expanded_mask``), the encoder and the
cross-attention now pass ``~padding_mask``, and ``_make_causal_mask`` fills ``finfo(dtype).min``
instead of ``-inf``.

This program keeps OFA's encoder-decoder layout at toy sizes with random weights: image patch
embeddings concatenated in front of the prompt tokens in ``OFAEncoder`` (with its
``encoder_padding_mask`` / ``has_pads``), ``OFAModel.forward`` replacing ``attention_mask`` by
``decoder_input_ids.eq(pad)`` only when the decoder input has pads, eager additive attention.
The ResNet patch embedder is reduced to a linear layer and the absolute / relative position
biases are left out. One teacher-forced captioning step: two images, prompts of different
lengths (padded), two captions of the same length, the tokenizer's decoder attention mask passed
as ``attention_mask``.

Note: at the fix commit ``OFAModel.forward`` still replaced the mask by
``decoder_input_ids.eq(pad)`` (1 at pads) when the decoder input held pads, which the inverted
``_expand_mask`` then read the other way round; later commits (a500777, b3f1e6a) changed that path.
The captions here hold no pads, so that path is not taken in either run.
"""

import math
import sys
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig

FIXED = "--fixed" in sys.argv


class OFAConfig(PretrainedConfig):
    model_type = "ofa"

    def __init__(
        self,
        vocab_size=120,
        d_model=48,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=96,
        decoder_ffn_dim=96,
        patch_dim=12,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        **kwargs,
    ):
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.encoder_layers = encoder_layers
        self.decoder_layers = decoder_layers
        self.encoder_attention_heads = encoder_attention_heads
        self.decoder_attention_heads = decoder_attention_heads
        self.encoder_ffn_dim = encoder_ffn_dim
        self.decoder_ffn_dim = decoder_ffn_dim
        self.patch_dim = patch_dim
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs)


def _make_causal_mask(input_ids_shape: torch.Size, dtype: torch.dtype, past_key_values_length: int = 0):
    bsz, tgt_len = input_ids_shape
    if FIXED:
        mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min)
    else:
        mask = torch.full((tgt_len, tgt_len), float("-inf"))
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: Optional[int] = None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    if FIXED:
        inverted_mask = 1.0 - expanded_mask
        return inverted_mask.masked_fill(inverted_mask.bool(), torch.finfo(dtype).min)
    return expanded_mask.masked_fill(expanded_mask.bool(), torch.finfo(dtype).min)


class OFAAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, is_decoder=False):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, attention_mask=None, attn_bias=None):
        bsz, tgt_len, embed_dim = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        kv = hidden_states if key_value_states is None else key_value_states
        key_states = self._shape(self.k_proj(kv), -1, bsz)
        value_states = self._shape(self.v_proj(kv), -1, bsz)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attn_bias is not None:
            attn_weights += attn_bias
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, tgt_len, src_len):
                raise ValueError(
                    f"Attention mask should be of size {(bsz, 1, tgt_len, src_len)}, but is {attention_mask.size()}"
                )
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights = F.softmax(attn_weights, dim=-1)
        attn_output = torch.bmm(attn_weights, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)
        return self.out_proj(attn_output)


class OFAEncoderLayer(nn.Module):
    def __init__(self, config: OFAConfig):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = OFAAttention(self.embed_dim, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.encoder_ffn_dim)
        self.fc2 = nn.Linear(config.encoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask, attn_bias=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask, attn_bias=attn_bias)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        return (residual + hidden_states,)


class OFADecoderLayer(nn.Module):
    def __init__(self, config: OFAConfig):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = OFAAttention(self.embed_dim, config.decoder_attention_heads, is_decoder=True)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.cross_attn = OFAAttention(self.embed_dim, config.decoder_attention_heads, is_decoder=True)
        self.cross_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.decoder_ffn_dim)
        self.fc2 = nn.Linear(config.decoder_ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = self.self_attn(hidden_states, attention_mask=attention_mask)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.cross_attn_layer_norm(hidden_states)
        hidden_states = self.cross_attn(
            hidden_states, key_value_states=encoder_hidden_states, attention_mask=encoder_attention_mask
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(F.gelu(self.fc1(hidden_states)))
        return (residual + hidden_states,)


class OFAEncoder(nn.Module):
    def __init__(self, config: OFAConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.padding_idx = config.pad_token_id
        self.embed_tokens = embed_tokens
        self.embed_positions = nn.Embedding(64, config.d_model)
        self.embed_images = nn.Linear(config.patch_dim, config.d_model)  # ResNet + projection, trimmed
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layers = nn.ModuleList([OFAEncoderLayer(config) for _ in range(config.encoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def get_patch_images_info(self, patch_images):
        image_embed = self.embed_images(patch_images)
        image_num_patches = image_embed.size(1)
        image_padding_mask = patch_images.new_zeros(patch_images.shape[:2], dtype=torch.bool)
        return image_embed, image_num_patches, image_padding_mask

    def forward(self, input_ids, patch_images=None, patch_masks=None):
        image_embed, image_num_patches, image_padding_mask = self.get_patch_images_info(patch_images)
        image_padding_mask[~patch_masks] = True

        encoder_padding_mask = input_ids.eq(self.padding_idx)
        encoder_padding_mask = torch.cat([image_padding_mask, encoder_padding_mask], dim=1)
        has_pads = encoder_padding_mask.any()

        positions = torch.arange(input_ids.size(1)).expand_as(input_ids)
        x = self.embed_tokens(input_ids) + self.embed_positions(positions)
        x = torch.cat([image_embed, x], dim=1)
        x = self.layernorm_embedding(x)

        # account for padding while computing the representation
        if has_pads:
            x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))

        attention_mask = None
        if has_pads:
            # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
            if FIXED:
                attention_mask = _expand_mask(~encoder_padding_mask, dtype=x.dtype)
            else:
                attention_mask = _expand_mask(encoder_padding_mask, dtype=x.dtype)

        for layer in self.layers:
            x = layer(x, attention_mask if has_pads else None)[0]
        x = self.layer_norm(x)
        return x, encoder_padding_mask


class OFADecoder(nn.Module):
    def __init__(self, config: OFAConfig, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.embed_positions = nn.Embedding(64, config.d_model)
        self.embed_scale = math.sqrt(config.d_model)
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layers = nn.ModuleList([OFADecoderLayer(config) for _ in range(config.decoder_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, dtype, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, dtype, past_key_values_length=past_key_values_length)
        if attention_mask is not None:
            # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
            expanded_attn_mask = _expand_mask(attention_mask, dtype, tgt_len=input_shape[-1])
            combined_attention_mask = (
                expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
            )
        return combined_attention_mask

    def forward(self, input_ids, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None):
        positions = torch.arange(input_ids.size(1)).expand_as(input_ids)
        x = self.embed_scale * self.embed_tokens(input_ids) + self.embed_positions(positions)
        hidden_states = self.layernorm_embedding(x)

        shape, dtype = input_ids.shape, hidden_states.dtype
        attention_mask = self._prepare_decoder_attention_mask(attention_mask, shape, dtype, 0)

        for layer in self.layers:
            hidden_states = layer(
                hidden_states,
                attention_mask=attention_mask,
                encoder_hidden_states=encoder_hidden_states,
                encoder_attention_mask=encoder_attention_mask,
            )[0]
        hidden_states = self.layer_norm(hidden_states)
        return hidden_states @ self.embed_tokens.weight.t()


class OFAModel(nn.Module):
    def __init__(self, config: OFAConfig):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        shared = nn.Embedding(config.vocab_size, config.d_model, config.pad_token_id)
        self.encoder = OFAEncoder(config, shared)
        self.decoder = OFADecoder(config, shared)

    def forward(self, input_ids=None, patch_images=None, patch_masks=None, decoder_input_ids=None, attention_mask=None):
        last_hidden_state, padding_mask = self.encoder(
            input_ids=input_ids, patch_images=patch_images, patch_masks=patch_masks
        )

        if decoder_input_ids.eq(self.config.pad_token_id).any():
            attention_mask = decoder_input_ids.eq(self.padding_idx)

        encoder_hidden_states = last_hidden_state
        if FIXED:
            encoder_attention_mask = _expand_mask(~padding_mask, encoder_hidden_states.dtype, decoder_input_ids.shape[-1])
        else:
            encoder_attention_mask = _expand_mask(padding_mask, encoder_hidden_states.dtype, decoder_input_ids.shape[-1])

        return self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=attention_mask,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
        )


def caption_batch(config):
    pad, bos, eos = config.pad_token_id, config.bos_token_id, config.eos_token_id
    # " what does the image describe?" tokenized for two samples, padded on the right
    input_ids = torch.tensor([[bos, 11, 12, 13, 14, 15, 16, eos], [bos, 21, 22, 23, 24, eos, pad, pad]])
    patch_images = torch.randn(2, 9, config.patch_dim)
    patch_masks = torch.tensor([True, True])
    # target captions of the same length; decoder input = shifted target
    target = torch.tensor([[31, 32, 33, 34, 35, eos], [41, 42, 43, 44, 45, eos]])
    decoder_input_ids = torch.cat([torch.full((2, 1), bos), target[:, :-1]], dim=1)
    decoder_attention_mask = torch.ones_like(decoder_input_ids)
    return input_ids, patch_images, patch_masks, decoder_input_ids, decoder_attention_mask, target


def main():
    torch.manual_seed(0)
    config = OFAConfig()
    model = OFAModel(config)
    input_ids, patch_images, patch_masks, decoder_input_ids, decoder_attention_mask, target = caption_batch(config)
    logits = model(
        input_ids=input_ids,
        patch_images=patch_images,
        patch_masks=patch_masks,
        decoder_input_ids=decoder_input_ids,
        attention_mask=decoder_attention_mask,
    )
    loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), target.reshape(-1), ignore_index=config.pad_token_id)
    loss.backward()
    print("fixed" if FIXED else "buggy", "caption loss: %.6f" % loss.item())
    print("first-token logits sum: %.6f" % logits[:, 0].sum().item())


if __name__ == "__main__":
    main()
