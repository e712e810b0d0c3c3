"""transformers BertGeneration: with use_cache=True the decoder builds no attention mask at all.

Citation: huggingface/transformers PR #35043 ("Fix `BertGeneration`", merged; description read:
"`BertGeneration` doesn't prepare the attention mask correctly when it is used as a decoder +
`use_cache=True`", shown with a left-padded `attention_mask[0, :3] = 0`). The pre-fix
`BertGenerationEncoder.forward` lines were read in stored copies of that file; the fixed line (compute
`get_extended_attention_mask` whatever `use_cache` is) is reconstructed from the description.

Bug: `extended_attention_mask = None; if not use_cache: extended_attention_mask = self.get_extended_attention_mask(
attention_mask, input_shape)`. For a decoder config `use_cache` defaults to True, so in cached generation
the prompt pass gets neither the causal mask nor the padding mask: prompt tokens see later prompt tokens
and the left pads, and every decode step sees the pads.

Fix: always `extended_attention_mask = self.get_extended_attention_mask(attention_mask, input_shape)`
(for a decoder: causal rows over the new tokens, ones over the cached prefix, times the padding mask).

Reproduction: a 2-layer BertGeneration-style decoder (`config.is_decoder = True`, `use_cache=True`,
eager softmax attention with the additive extended mask, `past_key_value` tuples); batch of 2 prompts,
the second left-padded by 3; prefill then 3 cached greedy steps with the 2-D mask extended by ones.
"""
import math
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def get_extended_attention_mask(attention_mask, input_shape, is_decoder, dtype=torch.float32):
    """ModuleUtilsMixin.get_extended_attention_mask for a 2-D mask."""
    if is_decoder:
        batch_size, seq_length = input_shape
        seq_ids = torch.arange(seq_length)
        causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        causal_mask = causal_mask.to(attention_mask.dtype)
        if causal_mask.shape[1] < attention_mask.shape[1]:
            prefix_seq_len = attention_mask.shape[1] - causal_mask.shape[1]
            causal_mask = torch.cat(
                [torch.ones((batch_size, seq_length, prefix_seq_len), dtype=causal_mask.dtype), causal_mask],
                dim=-1)
        extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
    else:
        extended_attention_mask = attention_mask[:, None, None, :]
    return (1.0 - extended_attention_mask.to(dtype)) * torch.finfo(dtype).min


class BertGenerationSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.output = nn.Linear(config.hidden_size, config.hidden_size)

    def transpose_for_scores(self, x):
        return x.view(x.shape[0], x.shape[1], self.num_attention_heads, self.attention_head_size).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if past_key_value is not None:
            key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
            value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        past_key_value = (key_layer, value_layer)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2)) / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context = torch.matmul(attention_probs, value_layer).permute(0, 2, 1, 3).flatten(2)
        return hidden_states + self.output(context), past_key_value


class BertGenerationEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layer = nn.ModuleList([BertGenerationSelfAttention(config) for _ in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=None):
        use_cache = use_cache if use_cache is not None else self.config.use_cache
        input_shape = input_ids.size()
        batch_size, seq_length = input_shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length + past_key_values_length))
        if FIXED:
            extended_attention_mask = get_extended_attention_mask(attention_mask, input_shape, self.config.is_decoder)
        else:
            extended_attention_mask = None
            if not use_cache:
                extended_attention_mask = get_extended_attention_mask(attention_mask, input_shape, self.config.is_decoder)
        position_ids = torch.arange(past_key_values_length, past_key_values_length + seq_length)
        hidden_states = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        next_cache = ()
        for i, layer in enumerate(self.layer):
            hidden_states, present = layer(hidden_states, extended_attention_mask,
                                           past_key_values[i] if past_key_values is not None else None)
            next_cache += (present,)
        return self.lm_head(hidden_states), (next_cache if use_cache else None)


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=40, hidden_size=32, num_attention_heads=4, num_hidden_layers=2,
                             max_position_embeddings=32, is_decoder=True, use_cache=True)
    model = BertGenerationEncoder(config).eval()
    pad = 0
    input_ids = torch.tensor([[5, 9, 13, 2, 7, 21], [pad, pad, pad, 11, 4, 30]])
    attention_mask = (input_ids != pad).long()
    generated = []
    with torch.no_grad():
        logits, past = model(input_ids, attention_mask=attention_mask)
        for _ in range(3):
            nxt = logits[:, -1:].argmax(-1)
            generated.append(nxt[:, 0].tolist())
            attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=1)
            logits, past = model(nxt, attention_mask=attention_mask, past_key_values=past)
    print("generated per step:", generated)


if __name__ == "__main__":
    main()
