"""ExLlama (v1) batched `generate_simple`: left-padded prompts attend their pad tokens, in the
prefill and in every single-token step.

Citation: turboderp/exllama commits a2e0c3c ("Force zero embedding vector for padding tokens /
Fix input mask shape when chunking") and 899aaa0 ("Apply input mask to batched generations"),
both 2023-07-23, following the revert 9359a82 of automatic pad masking (diffs read).

Bug: `ExLlamaTokenizer.encode(list, return_mask=True)` left-pads a batch with pad id 0 and can
return a padding mask, but `ExLlamaGenerator.generate_simple` called `encode(prompt)` and
`gen_begin(ids)` / `gen_single_token()` without it, so `ExLlama.forward` got `input_mask=None`.
Even with a mask, `_forward` only built `attn_mask` when `seq_len > 1`: single-token steps ran
with `buffer.attn_mask = None` over the whole cache, pads included.

Fix: `generate_simple` gets `ids, mask = encode(prompt, return_mask=True)` and passes `mask` to
`gen_begin` and each `gen_single_token`; `_forward` builds the mask when
`seq_len > 1 or input_mask is not None`, slicing `input_mask[:, :past_len + seq_len]`; the pad
row of `embed_tokens` is zeroed.

Reproduction: a 2-layer llama in ExLlama's structure (preallocated ExLlamaCache, matmul attention
path with an additive -65504 mask and softmax). The SentencePiece tokenizer is replaced by a word
list (no model files); its `encode` keeps ExLlama's left padding and mask layout. Two prompts of
3 and 6 tokens, 3 new tokens each, float32 on CPU.
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class ExLlamaConfig:
    def __init__(self):
        self.vocab_size = 48
        self.hidden_size = 32
        self.num_attention_heads = 4
        self.num_key_value_heads = 4
        self.num_key_value_groups = 1
        self.head_dim = 8
        self.intermediate_size = 64
        self.num_hidden_layers = 2
        self.rms_norm_eps = 1e-6
        self.max_seq_len = 32
        self.max_input_len = 32
        self.pad_token_id = 0
        self.sdp_thd = 0  # 0: always the HF-style matmul attention


class ExLlamaTokenizer:
    """ExLlama's encode() on a toy vocabulary in place of SentencePiece."""

    def __init__(self, words):
        self.vocab = {w: i + 3 for i, w in enumerate(words)}
        self.pad_token_id = 0
        self.eos_token_id = 2

    def EncodeAsIds(self, texts):
        return [[1] + [self.vocab[w] for w in t.split()] for t in texts]

    def encode(self, text, return_mask=False, max_seq_len=32):
        list_ids = self.EncodeAsIds(text)
        max_length = max([len(ids) for ids in list_ids])
        needs_mask = False
        padded_ids = []
        for ids in list_ids:
            if len(ids) != len(list_ids[0]):
                needs_mask = True
            padding = torch.full((max_length - len(ids),), self.pad_token_id)
            padded_ids.append(torch.cat((padding, torch.tensor(ids)), dim=0).long())
        stacked_ids = torch.stack(padded_ids, dim=0)
        if return_mask:
            if needs_mask:
                mask_padding = torch.full((stacked_ids.shape[0], max_seq_len - stacked_ids.shape[1]), True, dtype=torch.bool)
                mask = stacked_ids != 0
                mask = torch.cat((mask, mask_padding), dim=1)
                return stacked_ids, mask
            return stacked_ids, None
        return stacked_ids


class ExLlamaCache:
    def __init__(self, model, batch_size=1):
        cfg = model.config
        self.current_seq_len = 0
        self.key_states = [torch.zeros(batch_size, cfg.num_key_value_heads, cfg.max_seq_len, cfg.head_dim)
                           for _ in range(cfg.num_hidden_layers)]
        self.value_states = [torch.zeros_like(k) for k in self.key_states]


class ExLlamaBuffer:
    attn_mask: torch.Tensor = None


def rope(x, past_len, head_dim):
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(past_len, past_len + x.shape[2]).float(), inv)
    emb = torch.cat((ang, ang), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


class ExLlamaAttention(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.config, self.index = config, index
        h = config.hidden_size
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, hidden_states, cache, buffer):
        cfg = self.config
        bsz, q_len, _ = hidden_states.size()
        past_len = cache.current_seq_len
        query_states = self.q_proj(hidden_states).view(bsz, q_len, cfg.num_attention_heads, cfg.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, cfg.num_key_value_heads, cfg.head_dim).transpose(1, 2)
        query_states = rope(query_states, past_len, cfg.head_dim)
        key_states = rope(key_states, past_len, cfg.head_dim)

        # Add keys and values to cache
        cache.key_states[self.index].narrow(2, past_len, q_len).narrow(0, 0, bsz).copy_(key_states)
        cache.value_states[self.index].narrow(2, past_len, q_len).narrow(0, 0, bsz).copy_(value_states)
        key_states = cache.key_states[self.index].narrow(2, 0, past_len + q_len).narrow(0, 0, bsz)
        value_states = cache.value_states[self.index].narrow(2, 0, past_len + q_len).narrow(0, 0, bsz)

        # -- HF Transformers regular attention
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        attn_weights /= math.sqrt(cfg.head_dim)
        if buffer.attn_mask is not None:
            attn_weights = attn_weights + buffer.attn_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2)
        return self.o_proj(attn_output.reshape(bsz, q_len, cfg.hidden_size))


class ExLlamaDecoderLayer(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.self_attn = ExLlamaAttention(config, index)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size, bias=False), nn.SiLU(),
                                 nn.Linear(config.intermediate_size, config.hidden_size, bias=False))

    def forward(self, hidden_states, cache, buffer):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cache, buffer)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class ExLlama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        # checkpoint weights overwrite the padding_idx row, as loading a state dict does
        nn.init.normal_(self.embed_tokens.weight)
        if FIXED:
            with torch.no_grad():
                self.embed_tokens.weight[config.pad_token_id] = 0
        self.layers = nn.ModuleList(ExLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.no_grad()
    def forward(self, input_ids, cache, last_id_only=True, preprocess_only=False, input_mask=None):
        batch_size, seq_len = input_ids.shape
        past_len = cache.current_seq_len
        buffer = ExLlamaBuffer()

        build = (seq_len > 1 or input_mask is not None) if FIXED else seq_len > 1
        if build:
            attn_mask = torch.zeros(batch_size, 1, seq_len, past_len + seq_len)
            attn_mask_triu = torch.triu(torch.full((seq_len - 1, seq_len - 1), -65504.))
            attn_mask[:, :, : seq_len - 1, past_len + 1: past_len + seq_len] = attn_mask_triu
            if input_mask is not None:
                if FIXED:
                    input_mask = input_mask[:, :past_len + seq_len]
                input_mask = torch.where(input_mask, 0, -65504.)
                input_mask = input_mask.unsqueeze(1).unsqueeze(2)
                attn_mask = torch.minimum(attn_mask, input_mask)
        else:
            attn_mask = None
        buffer.attn_mask = attn_mask

        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cache, buffer)
        cache.current_seq_len += seq_len
        if preprocess_only:
            return None
        if last_id_only:
            hidden_states = hidden_states[:, -1:, :]
        return self.lm_head(self.norm(hidden_states))


class ExLlamaGenerator:
    def __init__(self, model, tokenizer, cache):
        self.model, self.tokenizer, self.cache = model, tokenizer, cache
        self.sequence = None

    def gen_begin(self, in_tokens, mask=None):
        self.sequence = in_tokens.clone()
        self.cache.current_seq_len = 0
        self.model.forward(self.sequence[:, :-1], self.cache, preprocess_only=True, input_mask=mask)

    def gen_single_token(self, mask=None):
        logits = self.model.forward(self.sequence[:, -1:], self.cache, input_mask=mask)
        token = logits[:, -1, :].argmax(-1, keepdim=True)  # greedy (top_k = 1)
        self.sequence = torch.cat((self.sequence, token), dim=1)
        return token

    def generate_simple(self, prompt, max_new_tokens=128):
        if FIXED:
            ids, mask = self.tokenizer.encode(prompt, return_mask=True)
        else:
            ids, mask = self.tokenizer.encode(prompt), None
        self.gen_begin(ids, mask=mask)
        for _ in range(max_new_tokens):
            self.gen_single_token(mask=mask)
        return self.sequence


if __name__ == "__main__":
    torch.manual_seed(0)
    config = ExLlamaConfig()
    model = ExLlama(config).eval()
    tokenizer = ExLlamaTokenizer("once upon a time there was little llama who lived in the hills".split())
    prompts = ["once upon", "there was a little llama who"]
    cache = ExLlamaCache(model, batch_size=len(prompts))
    generator = ExLlamaGenerator(model, tokenizer, cache)
    out = generator.generate_simple(prompts, max_new_tokens=3)
    print("fixed" if FIXED else "buggy", out[:, -3:].tolist())
