"""HF GPT-2 batched generation with left padding: absolute learned position embeddings (wpe) indexed by
position_ids = attention_mask.cumsum(-1) - 1 (padding slots set to 1), the registered `bias` tril
buffer sliced for the cached keys, plus an additive padding mask; past_key_values as per-layer
(key, value) tuples over several decode steps.

Follows huggingface/transformers src/transformers/models/gpt2/modeling_gpt2.py as of v4.2x:
GPT2Attention._attn (`causal_mask = self.bias[:, :, key_length - query_length : key_length,
:key_length]`, torch.where(causal_mask, w, finfo.min), then `+ attention_mask`), GPT2Model.forward
(`attention_mask[:, None, None, :]`, `(1.0 - attention_mask) * finfo.min`) and
GPT2LMHeadModel.prepare_inputs_for_generation (cumsum position_ids, `masked_fill_(attention_mask == 0,
1)`, only the last position once past is given).  Plain torch, a GPT2Config-like class.

Mask meant: causal over the cache AND only real (non-left-padding) keys; a real token's position is
its index among the row's real tokens, so the padded batch reproduces unpadded generation.
"""
import torch
import torch.nn as nn


class GPT2Config:
    def __init__(self, vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                 scale_attn_weights=True, pad_token_id=63, eos_token_id=63):
        self.vocab_size, self.n_positions, self.n_embd = vocab_size, n_positions, n_embd
        self.n_layer, self.n_head = n_layer, n_head
        self.scale_attn_weights = scale_attn_weights
        self.pad_token_id, self.eos_token_id = pad_token_id, eos_token_id


class GPT2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        max_positions = config.n_positions
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(1, 1, max_positions, max_positions),
            persistent=False,
        )
        self.embed_dim, self.num_heads = config.n_embd, config.n_head
        self.head_dim = self.embed_dim // self.num_heads
        self.scale_attn_weights = config.scale_attn_weights
        self.c_attn = nn.Linear(self.embed_dim, 3 * self.embed_dim)
        self.c_proj = nn.Linear(self.embed_dim, self.embed_dim)

    def _attn(self, query, key, value, attention_mask=None):
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        if self.scale_attn_weights:
            attn_weights = attn_weights / torch.full([], value.size(-1) ** 0.5, dtype=attn_weights.dtype)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length:key_length, :key_length]
        mask_value = torch.full([], torch.finfo(attn_weights.dtype).min, dtype=attn_weights.dtype)
        attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value)

    def _split_heads(self, tensor):
        return tensor.view(tensor.size()[:-1] + (self.num_heads, self.head_dim)).permute(0, 2, 1, 3)

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        query, key, value = self._split_heads(query), self._split_heads(key), self._split_heads(value)
        if layer_past is not None:
            past_key, past_value = layer_past
            key = torch.cat((past_key, key), dim=-2)
            value = torch.cat((past_value, value), dim=-2)
        present = (key, value) if use_cache else None
        attn_output = self._attn(query, key, value, attention_mask)
        attn_output = attn_output.permute(0, 2, 1, 3).contiguous()
        attn_output = attn_output.view(attn_output.size()[:-2] + (self.embed_dim,))
        return self.c_proj(attn_output), present


class GPT2Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = GPT2Attention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * config.n_embd, config.n_embd))

    def forward(self, hidden_states, layer_past=None, attention_mask=None, use_cache=False):
        attn_output, present = self.attn(self.ln_1(hidden_states), layer_past=layer_past,
                                         attention_mask=attention_mask, use_cache=use_cache)
        hidden_states = attn_output + hidden_states
        return hidden_states + self.mlp(self.ln_2(hidden_states)), present


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, position_ids=None, use_cache=True):
        batch_size = input_ids.shape[0]
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.h))
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = attention_mask.to(dtype=self.wte.weight.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(self.wte.weight.dtype).min
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        presents = ()
        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(hidden_states, layer_past=layer_past, attention_mask=attention_mask, use_cache=use_cache)
            presents = presents + (present,)
        hidden_states = self.ln_f(hidden_states)
        return hidden_states @ self.wte.weight.T, presents

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, **kwargs):
        if past_key_values:
            input_ids = input_ids[:, -1].unsqueeze(-1)
        attention_mask = kwargs.get("attention_mask", None)
        position_ids = kwargs.get("position_ids", None)
        if attention_mask is not None and position_ids is None:
            # create position_ids on the fly for batch generation
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            if past_key_values:
                position_ids = position_ids[:, -1].unsqueeze(-1)
        return {"input_ids": input_ids, "past_key_values": past_key_values, "position_ids": position_ids,
                "attention_mask": attention_mask, "use_cache": True}

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, max_new_tokens):
        past_key_values = None
        for _ in range(max_new_tokens):
            model_inputs = self.prepare_inputs_for_generation(input_ids, past_key_values, attention_mask=attention_mask)
            logits, past_key_values = self(**model_inputs)
            next_tokens = logits[:, -1, :].argmax(-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        return input_ids


if __name__ == "__main__":
    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).eval()
    prompts = [[5, 17, 22, 9, 31, 2], [40, 3], [12]]
    width = max(map(len, prompts))
    # tokenizer.padding_side = "left"; pad_token = eos_token
    input_ids = torch.tensor([[config.pad_token_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(input_ids, attention_mask, max_new_tokens=5)
    for i, p in enumerate(prompts):
        single = model.generate(torch.tensor([p]), torch.ones(1, len(p), dtype=torch.long), max_new_tokens=5)
        assert torch.equal(single[0, len(p):], out[i, width:]), (single, out[i])
    print("continuations", out[:, width:].tolist())
