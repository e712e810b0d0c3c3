# huggingface/transformers#30123 (fixes #29946): Falcon with alibi + SDPA and no attention_mask passed
# used the bare alibi bias as attn_mask, so the causal mask was lost and prompts attended to future tokens.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None].bfloat16() * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, dtype, past_key_values_length=0):
    bsz, tgt_len = input_shape
    min_dtype = torch.finfo(dtype).min
    mask = torch.full((tgt_len, tgt_len), min_dtype, dtype=dtype).triu(1)
    mask = mask[None, None].expand(bsz, 1, tgt_len, tgt_len).clone()
    if attention_mask is not None:
        mask = mask.masked_fill(attention_mask[:, None, None, :] == 0, min_dtype)
    return mask


class FalconConfig:
    vocab_size = 50
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    alibi = True


class FalconAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=False)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

    def forward(self, hidden_states, alibi, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim)
        query_layer, key_layer, value_layer = qkv.permute(2, 0, 3, 1, 4)
        # SDPA path with alibi: the bias (and mask) arrive pre-merged in attention_mask
        attn_output = F.scaled_dot_product_attention(
            query_layer, key_layer, value_layer, attn_mask=attention_mask, dropout_p=0.0, is_causal=False
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.dense(attn_output)


class FalconDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attention = FalconAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.GELU(),
                                 nn.Linear(4 * config.hidden_size, config.hidden_size))

    def forward(self, hidden_states, alibi, attention_mask):
        h = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attention(h, alibi, attention_mask) + self.mlp(h)


class FalconModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.use_alibi = config.alibi
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([FalconDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask=None):
        inputs_embeds = self.word_embeddings(input_ids)
        batch_size, seq_length = input_ids.shape
        alibi = None
        if self.use_alibi:
            mask = torch.ones((batch_size, seq_length)) if attention_mask is None else attention_mask
            alibi = build_alibi_tensor(mask, self.num_heads, dtype=inputs_embeds.dtype)
        # self._use_sdpa and not output_attentions, alibi is not None and head_mask is None
        alibi = alibi.reshape(batch_size, -1, *alibi.shape[1:])
        attention_mask_2d = attention_mask
        attention_mask = _prepare_4d_causal_attention_mask(attention_mask, (batch_size, seq_length), inputs_embeds.dtype)
        scaled_alibi = alibi / math.sqrt(self.config.hidden_size // self.num_heads)
        if attention_mask_2d is None and not FIXED:
            attention_mask = scaled_alibi
        else:
            min_dtype = torch.finfo(inputs_embeds.dtype).min
            attention_mask = torch.masked_fill(scaled_alibi, attention_mask < -1, min_dtype)
        hidden_states = inputs_embeds
        for block in self.h:
            hidden_states = block(hidden_states, alibi, attention_mask)
        return self.ln_f(hidden_states)


def main():
    torch.manual_seed(0)
    config = FalconConfig()
    model = FalconModel(config).eval()
    input_ids = torch.randint(0, config.vocab_size, (2, 7))
    with torch.no_grad():
        out_no_mask = model(input_ids)
        out_with_mask = model(input_ids, attention_mask=torch.ones_like(input_ids))
        # a causal LM's prefix must not depend on what follows it
        prefix_only = model(input_ids[:, :4])
    print("max |out(no mask) - out(all-ones mask)| =", (out_no_mask - out_with_mask).abs().max().item())
    print("max |prefix output - full output on prefix| =", (prefix_only - out_no_mask[:, :4]).abs().max().item())


if __name__ == "__main__":
    main()
