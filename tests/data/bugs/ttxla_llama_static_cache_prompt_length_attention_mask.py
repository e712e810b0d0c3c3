"""tt-xla Llama generation example: a prompt-length attention_mask against a max_cache_len static cache.

Citation: tenstorrent/tt-xla#2953 (commit 026fd037f), "Fix llama generative example attention
mask issue", for issue tenstorrent/tt-xla#2919 (degenerate output since the transformers uplift).
In examples/pytorch/llama.py, `construct_inputs` left-pads the prompts to max_length, allocates a
`StaticCache(max_cache_len=...)` and passes the tokenizer's `attention_mask` (prompt length); the
generation loop `run_generate` then updates only `input_ids` and `cache_position`. The keys span
max_cache_len, so transformers' `prepare_padding_mask` pads the short 2-D mask with zeros up to
the key length: every generated token's key is treated as padding, and each decode query sees
the prompt but neither the tokens generated before it nor itself. The fix pre-allocates
`full_attention_mask = ones(batch_size, max_cache_len)` with the prompt's mask copied into its
first prompt_len columns.

This program: a byte tokenizer (pad = eos, left padding to max_length), `construct_inputs` and
`run_generate` as the example has them, and a small Llama in plain torch with a preallocated
static cache whose mask follows transformers' sdpa_mask: causal over cache positions AND the
2-D padding mask zero-padded by `prepare_padding_mask`; F.scaled_dot_product_attention with the
boolean mask. Batch of 2 (one prompt left-padded), max_length 8, max_cache_len 16, 4 new tokens.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class ByteTokenizer:
    eos_token_id = 2

    def __init__(self):
        self.pad_token = self.eos_token_id

    def __call__(self, prompts, max_length, padding_side="left"):
        ids = [[3 + (b % 60) for b in p.encode()][:max_length] for p in prompts]
        input_ids = [[self.pad_token] * (max_length - len(x)) + x for x in ids]
        mask = [[0] * (max_length - len(x)) + [1] * len(x) for x in ids]
        return SimpleNamespace(input_ids=torch.tensor(input_ids), attention_mask=torch.tensor(mask))


class StaticCache:
    def __init__(self, config, max_batch_size, max_cache_len):
        head_dim = config.hidden_size // config.num_attention_heads
        shape = (max_batch_size, config.num_key_value_heads, max_cache_len, head_dim)
        self.max_cache_len = max_cache_len
        self.keys = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]

    def update(self, key_states, value_states, layer_idx, cache_position):
        self.keys[layer_idx].index_copy_(2, cache_position, key_states)
        self.values[layer_idx].index_copy_(2, cache_position, value_states)
        return self.keys[layer_idx], self.values[layer_idx]


def prepare_padding_mask(attention_mask, kv_length, kv_offset):
    local_padding_mask = attention_mask
    if attention_mask is not None:
        if (padding_length := kv_length + kv_offset - attention_mask.shape[-1]) > 0:
            local_padding_mask = F.pad(attention_mask, (0, padding_length))
    return local_padding_mask


def create_causal_mask(attention_mask, cache_position, kv_length):
    kv_idx = torch.arange(kv_length)
    causal = kv_idx[None, :] <= cache_position[:, None]
    padding = prepare_padding_mask(attention_mask, kv_length, 0)[:, :kv_length].bool()
    return causal[None, None] & padding[:, None, None, :]


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, past_key_values, cache_position):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k, v = past_key_values.update(k, v, self.layer_idx, cache_position)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaAttention(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values, cache_position, use_cache=True, attention_mask=None):
        h = self.embed_tokens(input_ids)
        mask = create_causal_mask(attention_mask, cache_position, past_key_values.max_cache_len)
        # As transformers' sdpa_mask does for torch versions that return NaN: a fully masked row
        # (a left-pad query) attends everywhere instead.
        mask = mask | torch.all(~mask, dim=-1, keepdim=True)
        for layer in self.layers:
            h = h + layer(h, mask, past_key_values, cache_position)
        return SimpleNamespace(logits=self.lm_head(h))


def construct_inputs(input_prompt, tokenizer, model_config, batch_size, max_cache_len):
    inputs = tokenizer(input_prompt, max_length=8, padding_side="left")
    static_cache = StaticCache(config=model_config, max_batch_size=batch_size, max_cache_len=max_cache_len)
    cache_position = torch.arange(0, inputs.input_ids.shape[1])
    if FIXED:
        prompt_len = inputs.input_ids.shape[1]
        full_attention_mask = torch.ones((batch_size, max_cache_len), dtype=inputs.attention_mask.dtype)
        full_attention_mask[:, :prompt_len] = inputs.attention_mask
        attention_mask = full_attention_mask
    else:
        attention_mask = inputs.attention_mask
    return {
        "input_ids": inputs.input_ids,
        "past_key_values": static_cache,
        "cache_position": cache_position,
        "use_cache": True,
        "attention_mask": attention_mask,
    }


def run_generate(compiled_model, input_args, tokenizer, max_tokens_to_generate=4):
    num_users = input_args["input_ids"].shape[0]
    output_tokens = [[] for _ in range(num_users)]
    with torch.no_grad():
        for step in range(max_tokens_to_generate):
            output = compiled_model(**input_args)
            next_token_id = output.logits[:, -1].argmax(dim=-1)
            for i, toks in enumerate(output_tokens):
                toks.append(next_token_id[i].item())
            if torch.all(next_token_id == tokenizer.eos_token_id):
                break
            input_args["input_ids"] = next_token_id.unsqueeze(-1)
            host_cache_pos = input_args["cache_position"]
            input_args["cache_position"] = torch.tensor([host_cache_pos[-1:] + 1]).view(1)
    return output_tokens


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=64, hidden_size=32, num_attention_heads=4, num_key_value_heads=4,
                             num_hidden_layers=2)
    model = LlamaForCausalLM(config).eval()
    tokenizer = ByteTokenizer()
    input_args = construct_inputs(["Hi there", "Yo"], tokenizer, config, batch_size=2, max_cache_len=16)
    print("fixed" if FIXED else "buggy", run_generate(model, input_args, tokenizer))


if __name__ == "__main__":
    main()
