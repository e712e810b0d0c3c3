"""PaliGemma-style prefix-LM mask that re-opens padding tokens during training.

Citation: huggingface/transformers#35855 ("Paliegemma Pad Token not Masked", transformers
4.48.0), fixed by PR #35859 ("Fix PaliGemma Pad Token Masking During Training").
Upstream: `PaliGemmaForConditionalGeneration._update_causal_mask` in modeling_paligemma.py.

Bug: in training (`token_type_ids` and `labels` given) the mask is causal, then padding
columns are filled with min_dtype, and *afterwards* every column whose `token_type_ids == 0`
(image + prefix, meant to be bidirectional) is set back to 0. Padding tokens also carry
token type 0, so the second step un-masks them: every query attends to the pad tokens.

Fix: apply the training-time prefix unmasking first and the padding mask after it, so pad
columns stay at min_dtype.

Reproduction: plain torch; the mask builder follows the 4.48 code (min_dtype float mask,
cache_position, token_type_ids, is_training), and a small Gemma-like decoder with random
weights consumes it through F.scaled_dot_product_attention. Image features stand in for the
SigLIP tower output. A batch of two left-padded rows (as the issue describes) with image
tokens, a prompt prefix (type 0) and a suffix (type 1) is run with labels, i.e. training.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class PaliGemmaConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    image_token_index: int = 63
    pad_token_id: int = 0
    num_image_tokens: int = 4


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.num_attention_heads
        self.input_layernorm = nn.RMSNorm(config.hidden_size)
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(approximate="tanh"), nn.Linear(64, config.hidden_size))

    def forward(self, hidden_states, causal_mask):
        b, t, d = hidden_states.shape
        q, k, v = self.qkv_proj(self.input_layernorm(hidden_states)).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)
        hidden_states = hidden_states + self.o_proj(attn.transpose(1, 2).reshape(b, t, d))
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PaliGemmaForConditionalGeneration(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.dtype = torch.float32
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.multi_modal_projector = nn.Linear(16, config.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _update_causal_mask(self, attention_mask, token_type_ids, past_key_values, cache_position, input_tensor,
                            is_training=False):
        min_dtype = torch.finfo(self.dtype).min
        inputs_lead_dim, sequence_length = input_tensor.shape[:2]
        target_length = (
            attention_mask.shape[-1]
            if isinstance(attention_mask, torch.Tensor)
            else cache_position[0] + sequence_length + 1
        )
        causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=self.dtype)
        # Causal diagonal mask only if training, otherwise attend to the whole prefix. Training-specific attn for prefix is handled below
        if sequence_length != 1:
            if is_training:
                causal_mask = torch.triu(causal_mask, diagonal=1)
            else:
                causal_mask[:, :sequence_length] = 0.0
        causal_mask *= torch.arange(target_length) > cache_position.reshape(-1, 1)
        causal_mask = causal_mask[None, None, :, :].expand(inputs_lead_dim, 1, -1, -1)
        if attention_mask is not None:
            causal_mask = causal_mask.clone()  # copy to contiguous memory for in-place edit
            mask_length = attention_mask.shape[-1]
            if FIXED:
                # First unmask prefix tokens during training
                if is_training:
                    causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                        token_type_ids[:, None, None, :] == 0, 0
                    )
                # Then apply padding mask (will mask pad tokens)
                padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
                padding_mask = padding_mask == 0
                causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
            else:
                padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :]
                padding_mask = padding_mask == 0
                causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
                # we are training thus we need to create a full mask on the image + prefix but causal on suffix
                if is_training:
                    causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(
                        token_type_ids[:, None, None, :] == 0, 0
                    )
        return causal_mask

    def forward(self, input_ids, image_features, attention_mask, token_type_ids=None, labels=None):
        is_training = token_type_ids is not None and labels is not None
        inputs_embeds = self.embed_tokens(input_ids) * self.config.hidden_size ** 0.5
        special_image_mask = (input_ids == self.config.image_token_index).unsqueeze(-1).expand_as(inputs_embeds)
        image_embeds = self.multi_modal_projector(image_features).reshape(-1, self.config.hidden_size)
        inputs_embeds = inputs_embeds.masked_scatter(special_image_mask, image_embeds)
        cache_position = torch.arange(inputs_embeds.shape[1])
        causal_mask = self._update_causal_mask(attention_mask, token_type_ids, None, cache_position, inputs_embeds,
                                               is_training)
        hidden_states = inputs_embeds
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask)
        logits = self.lm_head(self.norm(hidden_states))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return loss, logits


def main():
    torch.manual_seed(0)
    config = PaliGemmaConfig()
    model = PaliGemmaForConditionalGeneration(config).eval()
    img, pad = config.image_token_index, config.pad_token_id
    # left padded: [pad..] <image>x4 <bos> prompt... \n | suffix ... <eos>
    input_ids = torch.tensor([
        [pad, pad, pad, img, img, img, img, 2, 11, 12, 10, 21, 22, 1],
        [img, img, img, img, 2, 13, 14, 15, 16, 10, 23, 24, 25, 1],
    ])
    attention_mask = (input_ids != pad).long()
    token_type_ids = torch.tensor([
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
        [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1],
    ])
    labels = input_ids.masked_fill(token_type_ids == 0, -100)
    image_features = torch.randn(2, config.num_image_tokens, 16)
    with torch.no_grad():
        loss, logits = model(input_ids, image_features, attention_mask, token_type_ids=token_type_ids, labels=labels)
    print("train loss %.5f" % loss.item())


if __name__ == "__main__":
    main()
