# huggingface/transformers#26137 (Falcon: batched generation): FalconAttention filled masked positions with
# float("-1e9") and cast to the query dtype; in float16 that is -inf, so left-padded rows whose keys are all
# masked give NaN, which then leaks into every token. Fix: fill with torch.finfo(dtype).min.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DTYPE = torch.float16


class FalconConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    alibi = True
    pad_token_id = 0


def build_alibi_tensor(attention_mask, num_heads, dtype):
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    slopes = torch.pow(base, torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32))
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None].bfloat16() * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def _make_causal_mask(input_ids_shape, past_key_values_length):
    batch_size, target_length = input_ids_shape
    mask = torch.triu(torch.ones((target_length, target_length), dtype=torch.bool), diagonal=1)
    past_mask = torch.zeros((target_length, past_key_values_length), dtype=torch.bool)
    mask = torch.cat([past_mask, mask], dim=-1)
    return mask[None, None, :, :].expand(batch_size, 1, target_length, target_length + past_key_values_length)


def _expand_mask(mask, past_key_values_length):
    batch_size, total_length = mask.shape
    seq_length = total_length - past_key_values_length
    expanded_mask = ~(mask[:, None, None, :].to(torch.bool))
    return expanded_mask.expand(batch_size, 1, seq_length, total_length)


class FalconAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, alibi, attention_mask):
        batch_size, query_length, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(batch_size, query_length, 3, self.num_heads, self.head_dim)
        query_layer, key_layer, value_layer = (qkv[:, :, i].transpose(1, 2) for i in range(3))
        kv_length = key_layer.shape[-2]
        if FIXED:
            attention_mask_float = (attention_mask * 1.0).masked_fill(
                attention_mask, torch.finfo(query_layer.dtype).min).to(query_layer.dtype)
        else:
            attention_mask_float = (attention_mask * 1.0).masked_fill(attention_mask, float("-1e9")).to(query_layer.dtype)
        matmul_result = query_layer @ key_layer.transpose(-1, -2)
        attention_scores = matmul_result.view(batch_size, self.num_heads, query_length, kv_length).to(torch.float32)
        attention_logits = attention_scores + alibi.view(batch_size, self.num_heads, 1, -1)
        attention_logits *= self.inv_norm_factor
        attention_probs = F.softmax(attention_logits + attention_mask_float, dim=-1, dtype=hidden_states.dtype)
        context_layer = (attention_probs @ value_layer).transpose(1, 2).reshape(batch_size, query_length, -1)
        return self.dense(context_layer)


class FalconDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attention = FalconAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(), nn.Linear(64, config.hidden_size))

    def forward(self, hidden_states, alibi, attention_mask):
        x = self.input_layernorm(hidden_states)
        return hidden_states + self.self_attention(x, alibi, attention_mask) + self.mlp(x)  # parallel attn


class FalconForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList(FalconDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.ln_f = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _prepare_attn_mask(self, attention_mask, input_shape, past_key_values_length):
        combined_attention_mask = None
        if input_shape[1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, past_key_values_length)
        expanded_attn_mask = _expand_mask(attention_mask, past_key_values_length)
        if combined_attention_mask is None:
            return expanded_attn_mask
        return expanded_attn_mask | combined_attention_mask

    def forward(self, input_ids, attention_mask):
        hidden_states = self.word_embeddings(input_ids)
        alibi = build_alibi_tensor(attention_mask, self.config.num_attention_heads, dtype=hidden_states.dtype)
        causal_mask = self._prepare_attn_mask(attention_mask, input_ids.shape, 0)
        for block in self.h:
            hidden_states = block(hidden_states, alibi, causal_mask)
        return self.lm_head(self.ln_f(hidden_states))


config = FalconConfig()
model = FalconForCausalLM(config).to(DTYPE).eval()
# batched generation prompt, left padded
input_ids = torch.tensor([[0, 0, 0, 5, 9, 11, 3], [7, 8, 2, 4, 6, 1, 9]])
attention_mask = (input_ids != config.pad_token_id).long()
with torch.no_grad():
    logits = model(input_ids, attention_mask)
    single = model(input_ids[:1, 3:], attention_mask[:1, 3:])
last = logits[0, -1].float()
print(f"fixed={FIXED} next-token logits of padded row finite: {bool(torch.isfinite(last).all())}; "
      f"max |padded - unpadded| = {(last - single[0, -1].float()).abs().max().item():.4e}")
