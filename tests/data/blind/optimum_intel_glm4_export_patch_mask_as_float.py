# huggingface/optimum-intel#884 (commit d6e6e1f0): the OpenVINO export patch for GLM-4 core attention
# inverted ChatGLM's boolean "masked" tensor and then cast it to float32, so SDPA received an additive
# 0/1 bias instead of a mask. Fix: build a float mask with -inf at the masked positions.
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ChatGLMConfig:
    hidden_size = 32
    num_attention_heads = 4
    num_layers = 2
    padded_vocab_size = 64
    ffn_hidden_size = 64
    seq_length = 64


class SdpaAttention(nn.Module):  # GLM-4 "CoreAttention" for sdpa
    def __init__(self, config):
        super().__init__()
        self.hidden_size_per_partition = config.hidden_size

    def forward(self, query_layer, key_layer, value_layer, attention_mask):
        if attention_mask is None and query_layer.shape[2] == key_layer.shape[2]:
            context_layer = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, is_causal=True)
        else:
            if attention_mask is not None:
                attention_mask = ~attention_mask
            context_layer = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, attention_mask)
        context_layer = context_layer.transpose(1, 2).contiguous()
        return context_layer.reshape(*context_layer.size()[:-2], self.hidden_size_per_partition)


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.np = config.num_attention_heads
        self.hn = config.hidden_size // config.num_attention_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.core_attention = SdpaAttention(config)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, kv_cache=None):
        b, sq, _ = hidden_states.shape
        mixed = self.query_key_value(hidden_states).view(b, sq, 3, self.np, self.hn)
        query_layer, key_layer, value_layer = (t.transpose(1, 2) for t in mixed.unbind(2))
        if kv_cache is not None:
            cache_k, cache_v = kv_cache
            key_layer = torch.cat((cache_k, key_layer), dim=2)
            value_layer = torch.cat((cache_v, value_layer), dim=2)
        context_layer = self.core_attention(query_layer, key_layer, value_layer, attention_mask)
        return self.dense(context_layer), (key_layer, value_layer)


class GLMBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attention = SelfAttention(config)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.ffn_hidden_size), nn.SiLU(),
                                 nn.Linear(config.ffn_hidden_size, config.hidden_size))

    def forward(self, hidden_states, attention_mask, kv_cache):
        attn, kv = self.self_attention(self.input_layernorm(hidden_states), attention_mask, kv_cache)
        hidden_states = hidden_states + attn
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states)), kv


class GLMTransformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList(GLMBlock(config) for _ in range(config.num_layers))


class ChatGLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = nn.Embedding(config.padded_vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.seq_length, config.hidden_size)
        self.encoder = GLMTransformer(config)
        self.output_layer = nn.Linear(config.hidden_size, config.padded_vocab_size, bias=False)

    def get_masks(self, input_ids, past_key_values, padding_mask=None):
        batch_size, seq_length = input_ids.shape
        full_attention_mask = torch.ones(batch_size, seq_length, seq_length)
        full_attention_mask.tril_()
        past_length = past_key_values[0][0].shape[2] if past_key_values else 0
        if past_length:
            full_attention_mask = torch.cat((torch.ones(batch_size, seq_length, past_length), full_attention_mask), dim=-1)
        if padding_mask is not None:
            full_attention_mask = full_attention_mask * padding_mask.unsqueeze(1)
        if not past_length and padding_mask is not None:
            full_attention_mask -= padding_mask.unsqueeze(-1) - 1
        full_attention_mask = (full_attention_mask < 0.5).bool()  # True = masked out
        full_attention_mask.unsqueeze_(1)
        return full_attention_mask

    def forward(self, input_ids, position_ids, attention_mask, past_key_values):
        seq_length = input_ids.shape[1]
        full_attention_mask = None
        if (attention_mask is not None and not attention_mask.all()) or (past_key_values and seq_length != 1):
            full_attention_mask = self.get_masks(input_ids, past_key_values, padding_mask=attention_mask)
        hidden_states = self.embedding(input_ids) + self.position(position_ids)
        presents = []
        for layer, kv_cache in zip(self.encoder.layers, past_key_values):
            hidden_states, kv = layer(hidden_states, full_attention_mask, kv_cache)
            presents.append(kv)
        return self.output_layer(hidden_states), presents


def _glm4_core_attention_forward(self, query_layer, key_layer, value_layer, attention_mask):
    if FIXED:
        causal_mask = torch.zeros_like(attention_mask, dtype=torch.float32)
        causal_mask.masked_fill_(attention_mask, float("-inf"))
        context_layer = F.scaled_dot_product_attention(query_layer, key_layer, value_layer, causal_mask)
    else:
        attention_mask = ~attention_mask
        context_layer = F.scaled_dot_product_attention(
            query_layer, key_layer, value_layer, attention_mask.to(torch.float32)
        )
    context_layer = context_layer.transpose(1, 2).contiguous()
    new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
    return context_layer.reshape(*new_context_layer_shape)


class ChatGLMModelPatcher:
    def __init__(self, model):
        self._model = model

    def __enter__(self):
        for block in self._model.encoder.layers:
            block.self_attention.core_attention._orig_forward = block.self_attention.core_attention.forward
            block.self_attention.core_attention.forward = types.MethodType(
                _glm4_core_attention_forward, block.self_attention.core_attention
            )

    def __exit__(self, *exc):
        for block in self._model.encoder.layers:
            block.self_attention.core_attention.forward = block.self_attention.core_attention._orig_forward


config = ChatGLMConfig()
model = ChatGLMModel(config).eval()
# Export dummy inputs: a left-padded batch continuing from 2 cached tokens.
batch, past_len, seq_len = 2, 2, 5
hn = config.hidden_size // config.num_attention_heads
past_key_values = [
    (torch.randn(batch, config.num_attention_heads, past_len, hn), torch.randn(batch, config.num_attention_heads, past_len, hn))
    for _ in range(config.num_layers)
]
input_ids = torch.randint(1, config.padded_vocab_size, (batch, seq_len))
attention_mask = torch.ones(batch, past_len + seq_len, dtype=torch.long)
attention_mask[1, :3] = 0  # second row is left padded
position_ids = torch.arange(past_len, past_len + seq_len).expand(batch, -1)

with torch.no_grad():
    reference, _ = model(input_ids, position_ids, attention_mask, past_key_values)
    with ChatGLMModelPatcher(model):  # what gets traced into the OpenVINO IR
        patched, _ = model(input_ids, position_ids, attention_mask, past_key_values)

diff = (patched - reference).abs().max().item()
print(f"fixed={FIXED} patched export forward vs original forward: max |logit diff| = {diff:.3e}")
