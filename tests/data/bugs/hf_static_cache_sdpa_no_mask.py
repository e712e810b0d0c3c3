"""huggingface/transformers#30400 (introduced by #30317, fixed by #30437): Llama's SDPA path passed no attn_mask when
the batch had no padding (`causal_mask is None`, `is_causal=q_len > 1`), but a StaticCache hands attention every one of
its max_cache_len slots; at decode (one query, is_causal False) the new token attended the slots not yet written, and
generation turned to gibberish at some max_new_tokens. The fix crops the keys to the slots written so far,
`key_states[:, :, : cache_position[-1] + 1]`. Written as LlamaSdpaAttention was, over transformers' own StaticCache."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.cache_utils import StaticCache

FIXED = "--fixed" in sys.argv
config = LlamaConfig(vocab_size=16, hidden_size=8, num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1)


class LlamaSdpaAttention(nn.Module):
    def __init__(self, layer_idx=0):
        super().__init__()
        self.layer_idx = layer_idx
        self.qkv = nn.Linear(8, 24)

    def forward(self, hidden_states, causal_mask, cache_position, past_key_value):
        q_len = hidden_states.shape[1]
        query_states, key_states, value_states = self.qkv(hidden_states)[:, None].chunk(3, dim=-1)
        key_states, value_states = past_key_value.update(key_states, value_states, self.layer_idx)
        if FIXED:  # #30437: the static cache's empty slots cropped before SDPA
            key_states = key_states[:, :, : cache_position[-1] + 1]
            value_states = value_states[:, :, : cache_position[-1] + 1]
        return F.scaled_dot_product_attention(query_states, key_states, value_states, attn_mask=causal_mask,
                                              is_causal=causal_mask is None and q_len > 1)


class LlamaModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(16, 8)
        self.self_attn = LlamaSdpaAttention()

    def forward(self, input_ids, past_key_values):
        past_seen_tokens = past_key_values.get_seq_length()
        cache_position = torch.arange(past_seen_tokens, past_seen_tokens + input_ids.shape[1])
        causal_mask = None  # no padding: SDPA's own causal mask "is enough"
        return self.self_attn(self.embed_tokens(input_ids), causal_mask, cache_position, past_key_values)


torch.manual_seed(0)
model = LlamaModel().eval()
cache = StaticCache(config=config, max_cache_len=8)
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]), past_key_values=cache)
    model(torch.tensor([[4]]), past_key_values=cache)
    model(torch.tensor([[5]]), past_key_values=cache)
