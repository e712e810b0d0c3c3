"""ExLlama generate_simple() on a list of prompts never passes the padding mask to the model.

Citation: turboderp/exllama commit 899aaa03874297d0cc9f158032247aefe8669e29 ("Apply input mask to batched
generations").  Only the commit was read; no issue thread is linked to it.

Bug: ``ExLlama._forward(..., input_mask=None)`` already folded a boolean ``input_mask`` into its additive
``attn_mask`` (``torch.where(input_mask, 0, -65504.)``, ``torch.minimum`` with the causal part), and
``ExLlamaTokenizer.encode(list, return_mask=True)`` left-pads the prompts and returns that mask.  But
``ExLlamaGenerator.generate_simple`` called ``ids = self.tokenizer.encode(prompt)`` and then
``gen_begin(ids)`` / ``gen_single_token()``, which call ``model.forward`` without ``input_mask``: the
prefill got only the causal mask and every decode step (``seq_len == 1``) got no mask at all, so the shorter
prompts' rows attended to their left padding.
Fix: ``ids, mask = self.tokenizer.encode(prompt, return_mask=True)`` and thread ``mask`` through
``gen_begin`` / ``gen_single_token`` (and the other ``gen_*`` helpers) into ``model.forward(input_mask=mask)``.

This program: the ExLlama pieces involved, in plain torch on CPU (float32 instead of the fp16 CUDA kernels):
``ExLlamaCache`` (preallocated keys/values with ``current_seq_len``), ``ExLlama._forward``'s mask build,
the attention's "regular attention" path (``q @ k.T / sqrt(d) + buffer.attn_mask``, softmax), a character
tokenizer standing in for SentencePiece, and ``ExLlamaGenerator.generate_simple`` with greedy sampling.
Two prompts of different lengths, 4 new tokens.  ``--fixed`` is the generator after 899aaa0.
"""
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class ExLlamaConfig:
    def __init__(self):
        self.vocab_size = 64
        self.hidden_size = 32
        self.num_attention_heads = 4
        self.head_dim = self.hidden_size // self.num_attention_heads
        self.num_hidden_layers = 2
        self.intermediate_size = 64
        self.max_seq_len = 32
        self.rms_norm_eps = 1e-6


class ExLlamaTokenizer:
    pad_token_id = 0
    eos_token_id = 2

    def EncodeAsIds(self, text):
        return [[3 + (ord(c) % 61) for c in t] for t in text]

    def encode(self, text, return_mask=False, max_seq_len=2048):
        list_ids = self.EncodeAsIds(text)
        max_length = max([len(ids) for ids in list_ids])
        needs_mask = False
        padded_ids = []
        for ids in list_ids:
            if len(ids) != len(list_ids[0]): needs_mask = True
            padding = torch.full((max_length - len(ids),), self.pad_token_id)
            sequence = torch.tensor(ids)
            padded_ids.append(torch.cat((padding, sequence), dim=0).long())
        stacked_ids = torch.stack(padded_ids, dim=0)
        if return_mask:
            if needs_mask:
                mask_padding = torch.full((stacked_ids.shape[0], max_seq_len - stacked_ids.shape[1]), True, dtype=torch.bool)
                mask = stacked_ids != 0
                mask = torch.cat((mask, mask_padding), dim=1)
                return stacked_ids, mask
            else:
                return stacked_ids, None
        else:
            return stacked_ids


class ExLlamaCache:
    def __init__(self, model, batch_size=1):
        self.config = model.config
        self.current_seq_len = 0
        shape = (batch_size, self.config.num_attention_heads, self.config.max_seq_len, self.config.head_dim)
        self.key_states = [torch.zeros(shape) for _ in range(self.config.num_hidden_layers)]
        self.value_states = [torch.zeros(shape) for _ in range(self.config.num_hidden_layers)]


class ExLlamaBuffer:
    def __init__(self, config):
        self.config = config
        self.attn_mask = None


class ExLlamaAttention(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.config, self.index = config, index
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, cache, buffer):
        bsz, q_len, _ = hidden_states.size()
        past_len = cache.current_seq_len
        h, d = self.config.num_attention_heads, self.config.head_dim
        query_states = self.q_proj(hidden_states).view(bsz, q_len, h, d).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, h, d).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, h, d).transpose(1, 2)
        new_keys = cache.key_states[self.index].narrow(2, past_len, q_len).narrow(0, 0, bsz)
        new_values = cache.value_states[self.index].narrow(2, past_len, q_len).narrow(0, 0, bsz)
        new_keys.copy_(key_states)
        new_values.copy_(value_states)
        # Key/value tensors with past
        key_states = cache.key_states[self.index].narrow(2, 0, past_len + q_len).narrow(0, 0, bsz)
        value_states = cache.value_states[self.index].narrow(2, 0, past_len + q_len).narrow(0, 0, bsz)
        # -- HF Transformers regular attention, faster on shorter sequences, same VRAM usage
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3))
        attn_weights /= math.sqrt(self.config.head_dim)
        if buffer.attn_mask is not None: attn_weights = attn_weights + buffer.attn_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2)
        return self.o_proj(attn_output.reshape(bsz, q_len, self.config.hidden_size))


class ExLlamaDecoderLayer(nn.Module):
    def __init__(self, config, index):
        super().__init__()
        self.self_attn = ExLlamaAttention(config, index)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, cache, buffer):
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), cache, buffer)
        x = self.post_attention_layernorm(hidden_states)
        return hidden_states + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExLlama(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([ExLlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, cache, last_id_only=True, preprocess_only=False, input_mask=None):
        with torch.no_grad():
            batch_size, seq_len = input_ids.shape
            past_len = cache.current_seq_len
            buffer = ExLlamaBuffer(self.config)
            if seq_len > 1 or input_mask is not None:
                attn_mask = torch.zeros(batch_size, 1, seq_len, past_len + seq_len)
                attn_mask_triu = torch.triu(torch.full((seq_len - 1, seq_len - 1), -65504.))
                attn_mask[:, :, : seq_len - 1, past_len + 1: past_len + seq_len] = attn_mask_triu
                if input_mask is not None:
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
            if preprocess_only: return None
            if last_id_only: hidden_states = hidden_states[:, -1:, :]
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
        token = logits[:, -1, :].argmax(-1, keepdim=True)  # greedy in place of the sampler
        self.sequence = torch.cat((self.sequence, token), dim=1)
        return token

    def generate_simple(self, prompt, max_new_tokens=128):
        if FIXED:
            ids, mask = self.tokenizer.encode(prompt, return_mask=True, max_seq_len=self.model.config.max_seq_len)
        else:
            ids, mask = self.tokenizer.encode(prompt), None
        self.gen_begin(ids, mask=mask)
        max_new_tokens = min(max_new_tokens, self.model.config.max_seq_len - ids.shape[1])
        for i in range(max_new_tokens):
            self.gen_single_token(mask=mask)
        return self.sequence


def main():
    torch.manual_seed(0)
    config = ExLlamaConfig()
    model = ExLlama(config).eval()
    tokenizer = ExLlamaTokenizer()
    prompts = ["Hi there", "When you have eliminated"]
    cache = ExLlamaCache(model, batch_size=len(prompts))
    generator = ExLlamaGenerator(model, tokenizer, cache)
    out = generator.generate_simple(prompts, max_new_tokens=4)
    print("fixed" if FIXED else "buggy", "new tokens:", out[:, -4:].tolist())


if __name__ == "__main__":
    main()
