# huggingface/transformers#31943 (fixed by #31944): GPTNeoXModel built the SDPA 4D mask only inside
# `if attention_mask is not None`; called with a cache, several new tokens and no attention_mask (e.g. the
# candidate-verification pass of assisted generation), SDPA got is_causal=True with q_len != kv_len (top-left).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class GPTNeoXConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    _attn_implementation = "sdpa"


def _prepare_4d_causal_attention_mask_for_sdpa(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    batch_size, query_length = input_shape
    key_value_length = query_length + past_key_values_length
    dtype = inputs_embeds.dtype
    if attention_mask is None:
        # is_causal in SDPA is only right when there is no offset (or a single query)
        if query_length == 1 or key_value_length == query_length:
            return None
        attention_mask = torch.ones(batch_size, key_value_length, dtype=torch.long)
    elif torch.all(attention_mask == 1) and (query_length == 1 or key_value_length == query_length):
        return None
    causal = torch.arange(key_value_length)[None, :] <= (torch.arange(query_length)[:, None] + past_key_values_length)
    allowed = causal[None, None] & attention_mask[:, None, None, :].bool()
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


class GPTNeoXSdpaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // config.num_attention_heads
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.is_causal = True

    def forward(self, hidden_states, attention_mask, layer_past=None):
        bsz, q_len, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(bsz, q_len, self.num_heads, 3 * self.head_size)
        query, key, value = qkv.permute(0, 2, 1, 3).chunk(3, dim=-1)
        if layer_past is not None:
            key = torch.cat((layer_past[0], key), dim=-2)
            value = torch.cat((layer_past[1], value), dim=-2)
        present = (key, value)
        attn_output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask,
            # The q_len > 1 is necessary to match with AttentionMaskConverter.to_causal_4d
            is_causal=self.is_causal and attention_mask is None and q_len > 1,
        )
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.dense(attn_output), present


class GPTNeoXLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.attention = GPTNeoXSdpaAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(), nn.Linear(64, config.hidden_size))

    def forward(self, h, attention_mask, layer_past):
        attn_out, present = self.attention(self.input_layernorm(h), attention_mask, layer_past)
        return h + attn_out + self.mlp(h), present  # parallel residual


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_pos = nn.Embedding(32, config.hidden_size)
        self.layers = nn.ModuleList(GPTNeoXLayer(config) for _ in range(config.num_hidden_layers))
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, past_key_values=None):
        batch_size, seq_length = input_ids.shape
        past_length = 0 if past_key_values is None else past_key_values[0][0].shape[-2]
        inputs_embeds = self.embed_in(input_ids)
        h = inputs_embeds + self.embed_pos(torch.arange(past_length, past_length + seq_length))
        if FIXED:
            attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
                attention_mask, (batch_size, seq_length), inputs_embeds, past_length)
        elif attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = _prepare_4d_causal_attention_mask_for_sdpa(
                attention_mask, (batch_size, seq_length), inputs_embeds, past_length)
        presents = []
        for i, layer in enumerate(self.layers):
            h, present = layer(h, attention_mask, None if past_key_values is None else past_key_values[i])
            presents.append(present)
        return self.embed_out(h), presents


config = GPTNeoXConfig()
model = GPTNeoXForCausalLM(config).eval()
prompt = torch.randint(0, config.vocab_size, (1, 6))
candidates = torch.randint(0, config.vocab_size, (1, 3))  # assistant-proposed tokens, verified in one pass
with torch.no_grad():
    _, past = model(prompt)
    verify_logits, _ = model(candidates, past_key_values=past)
    full_logits, _ = model(torch.cat([prompt, candidates], dim=1))
diff = (verify_logits - full_logits[:, -3:]).abs().max().item()
print(f"fixed={FIXED} max |cached verification logits - full forward logits| = {diff:.4e}")
