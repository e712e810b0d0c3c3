# Blaizzy/mlx-audio commit 7a9ded7f ("Fix cache prefill."), Fish Speech S2 Pro
# (mlx_audio/tts/models/fish_qwen3_omni/fish_speech.py, Model._generate_codes_for_text_batch and
# DualARTransformer.fast_forward_cached). The dual-AR decoder's slow transformer runs the left-padded prompt batch
# (its own causal + padding mask from attention_mask), then for every frame the fast transformer decodes the residual
# codebooks one token at a time over a fresh KVCache. That cache is meant to start with the slow model's last
# hidden state (position 0), so every codebook step attends to it; batched generation made the fresh fast cache and
# fed the semantic code's embedding straight in, so the codebook steps never saw the slow hidden state and sat one
# RoPE position early. Fix: keep hidden_state = result.hidden_states[:, -1] after the prefill and after every slow
# step, and run fast_forward_cached(hidden_state, fast_cache) on the new cache before the codebook loop.
# Ported to torch (mlx_lm KVCache and create_attention_mask, mx.fast.scaled_dot_product_attention), tiny sizes,
# greedy sampling; the tokenizer / Conversation encoding and the DAC codec are left out (prompts are given as
# (num_codebooks + 1, T) id arrays, the output is the codes).
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

RAS_WIN_SIZE = 10
IM_END_TOKEN_ID = 3


@dataclass
class FishTextConfig:
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    dim: int = 32
    intermediate_size: int = 64
    n_local_heads: int = 2
    head_dim: int = 8
    rope_base: float = 1000000.0
    norm_eps: float = 1e-6
    max_seq_len: int = 128
    attention_qkv_bias: bool = False
    attention_o_bias: bool = False
    attention_qk_norm: bool = True


@dataclass
class FishAudioDecoderConfig:
    vocab_size: int = 20
    n_layer: int = 2
    n_head: int = 2
    dim: int = 16
    intermediate_size: int = 32
    n_local_heads: int = 1
    head_dim: int = 8
    rope_base: float = 1000000.0
    norm_eps: float = 1e-6
    attention_qkv_bias: bool = False
    attention_o_bias: bool = False
    attention_qk_norm: bool = False
    num_codebooks: int = 4


@dataclass
class ModelConfig:
    semantic_start_token_id: int = 40
    semantic_end_token_id: int = 59
    text_config: FishTextConfig = field(default_factory=FishTextConfig)
    audio_decoder_config: FishAudioDecoderConfig = field(default_factory=FishAudioDecoderConfig)


@dataclass
class ForwardResult:
    logits: torch.Tensor
    hidden_states: torch.Tensor


class KVCache:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset += keys.shape[2]
        return self.keys, self.values


def create_additive_causal_mask(N: int, offset: int = 0):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    mask = linds[:, None] < rinds[None]
    return mask.float() * -1e9


def create_attention_mask(h, cache=None):
    T = h.shape[1]
    if T > 1:
        offset = cache.offset if cache is not None else 0
        return create_additive_causal_mask(T, offset).to(h.dtype)
    return None


class Identity(nn.Module):
    def forward(self, x):
        return x


class FishRotaryEmbedding(nn.Module):
    def __init__(self, head_dim, rope_base, max_position_embeddings):
        super().__init__()
        freqs = 1.0 / (rope_base ** (torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim))
        positions = torch.arange(max_position_embeddings, dtype=torch.float32)
        angles = positions[:, None] * freqs[None, :]
        self._cos = torch.cos(angles)
        self._sin = torch.sin(angles)

    def forward(self, x, offset: int = 0):
        seqlen = x.shape[2]
        cos = self._cos[offset : offset + seqlen][None, None, :, :]
        sin = self._sin[offset : offset + seqlen][None, None, :, :]
        x_float = x.float().reshape(*x.shape[:-1], -1, 2)
        x_even = x_float[..., 0]
        x_odd = x_float[..., 1]
        rotated = torch.stack([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1)
        return rotated.reshape(x.shape).to(x.dtype)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, rope_base, max_position_embeddings, attention_qkv_bias,
                 attention_o_bias, attention_qk_norm, norm_eps):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim ** -0.5
        total_head_dim = (n_heads + 2 * n_kv_heads) * head_dim
        self.wqkv = nn.Linear(dim, total_head_dim, bias=attention_qkv_bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=attention_o_bias)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps) if attention_qk_norm else Identity()
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps) if attention_qk_norm else Identity()
        self.rope = FishRotaryEmbedding(head_dim=head_dim, rope_base=rope_base,
                                        max_position_embeddings=max_position_embeddings)

    def forward(self, x, mask=None, cache: Optional[KVCache] = None):
        bsz, seqlen, _ = x.shape
        q_size = self.n_heads * self.head_dim
        kv_size = self.n_kv_heads * self.head_dim
        qkv = self.wqkv(x)
        q, k, v = torch.split(qkv, [q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(bsz, seqlen, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = self.q_norm(q)
        k = self.k_norm(k)
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q = self.rope(q)
            k = self.rope(k)
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
        output = output.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(output)


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, head_dim, intermediate_size, rope_base, max_position_embeddings,
                 attention_qkv_bias, attention_o_bias, attention_qk_norm, norm_eps):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads, head_dim, rope_base, max_position_embeddings,
                                   attention_qkv_bias, attention_o_bias, attention_qk_norm, norm_eps)
        self.feed_forward = FeedForward(dim, intermediate_size)
        self.attention_norm = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = nn.RMSNorm(dim, eps=norm_eps)

    def forward(self, x, mask=None, cache=None):
        h = x + self.attention(self.attention_norm(x), mask=mask, cache=cache)
        return h + self.feed_forward(self.ffn_norm(h))


class DualARTransformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        tc = config.text_config
        ac = config.audio_decoder_config
        self.embeddings = nn.Embedding(tc.vocab_size, tc.dim)
        self.codebook_embeddings = nn.Embedding(ac.vocab_size * ac.num_codebooks, tc.dim)
        self.layers = nn.ModuleList([
            TransformerBlock(tc.dim, tc.n_head, tc.n_local_heads, tc.head_dim, tc.intermediate_size, tc.rope_base,
                             tc.max_seq_len, tc.attention_qkv_bias, tc.attention_o_bias, tc.attention_qk_norm,
                             tc.norm_eps)
            for _ in range(tc.n_layer)
        ])
        self.norm = nn.RMSNorm(tc.dim, eps=tc.norm_eps)
        self.fast_project_in = nn.Linear(tc.dim, ac.dim, bias=False) if tc.dim != ac.dim else Identity()
        self.fast_embeddings = nn.Embedding(ac.vocab_size, ac.dim)
        self.fast_layers = nn.ModuleList([
            TransformerBlock(ac.dim, ac.n_head, ac.n_local_heads, ac.head_dim, ac.intermediate_size, ac.rope_base,
                             ac.num_codebooks, ac.attention_qkv_bias, ac.attention_o_bias, ac.attention_qk_norm,
                             ac.norm_eps)
            for _ in range(ac.n_layer)
        ])
        self.fast_norm = nn.RMSNorm(ac.dim, eps=ac.norm_eps)
        self.fast_output = nn.Linear(ac.dim, ac.vocab_size, bias=False)

    @property
    def num_codebooks(self):
        return self.config.audio_decoder_config.num_codebooks

    def make_cache(self):
        return [KVCache() for _ in self.layers]

    def make_fast_cache(self):
        return [KVCache() for _ in self.fast_layers]

    def _embed(self, inp):
        semantic_ids = inp[:, 0]
        codebook_rows = inp[:, 1:]
        vq_embeds = []
        for i in range(self.num_codebooks):
            vq_embeds.append(self.codebook_embeddings(codebook_rows[:, i] + i * self.config.audio_decoder_config.vocab_size))
        vq_sum = torch.stack(vq_embeds, dim=0).sum(dim=0)
        semantic_mask = (semantic_ids >= self.config.semantic_start_token_id) & (
            semantic_ids <= self.config.semantic_end_token_id
        )
        vq_sum = torch.where(semantic_mask[:, :, None], vq_sum, torch.zeros_like(vq_sum))
        x = self.embeddings(semantic_ids) + vq_sum
        scale = math.sqrt(self.num_codebooks + 1)
        return torch.where(semantic_mask[:, :, None], x / scale, x)

    def forward(self, inp, cache=None, attention_mask=None):
        x = self._embed(inp)
        if cache is None:
            cache = [None] * len(self.layers)
        if attention_mask is not None:
            seq_len = x.shape[1]
            total_len = attention_mask.shape[-1]
            if seq_len > 1:
                if total_len == seq_len:
                    causal = create_additive_causal_mask(seq_len)
                else:
                    query_pos = torch.arange(total_len - seq_len, total_len)[:, None]
                    key_pos = torch.arange(total_len)[None, :]
                    causal = torch.where(key_pos > query_pos, -1e9, 0.0)
                causal = causal.to(x.dtype)[None, None, :, :]
                pad_mask = (1 - attention_mask[:, None, None, :].to(x.dtype)) * -1e9
                mask = causal + pad_mask
            else:
                mask = (1 - attention_mask[:, None, None, :].to(x.dtype)) * -1e9
        else:
            mask = create_attention_mask(x, cache[0])
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, mask=mask, cache=layer_cache)
        slow_out = self.norm(x)
        logits = slow_out @ self.embeddings.weight.T
        return ForwardResult(logits=logits, hidden_states=self.fast_project_in(slow_out))

    def fast_forward_cached(self, x, cache=None):
        if x.ndim == 2:
            x = x[:, None, :]
        elif x.ndim == 3:
            x = x[:, -1:]
        if cache is None:
            cache = [None] * len(self.fast_layers)
        mask = create_attention_mask(x, cache[0])
        for layer, layer_cache in zip(self.fast_layers, cache):
            x = layer(x, mask=mask, cache=layer_cache)
        x = self.fast_norm(x)
        return self.fast_output(x[:, -1])


def _sample_logits(logits, temperature, top_p, top_k):
    if temperature <= 0:
        return torch.argmax(logits, dim=-1).to(torch.int32)
    raise NotImplementedError("greedy only in this port")


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = DualARTransformer(config)
        semantic_bias = torch.full((1, config.text_config.vocab_size), -1e9)
        semantic_bias[:, config.semantic_start_token_id : config.semantic_end_token_id + 1] = 0.0
        semantic_bias[:, IM_END_TOKEN_ID] = 0.0
        self.semantic_logit_bias = semantic_bias

    def _sample_semantic_batch(self, logits, previous_semantic_tokens, top_p, top_k, temperature):
        biased_logits = logits + self.semantic_logit_bias.to(logits.dtype)
        return _sample_logits(biased_logits, temperature=temperature, top_p=top_p, top_k=top_k)

    def _prepare_batched_prompt_inputs(self, encoded_prompts):
        prompt_lengths = [p.shape[1] for p in encoded_prompts]
        max_prompt_len = max(prompt_lengths)
        padded_prompts = []
        mask_rows = []
        for prompt, prompt_len in zip(encoded_prompts, prompt_lengths):
            pad_len = max_prompt_len - prompt_len
            if pad_len > 0:
                padding = torch.zeros((prompt.shape[0], pad_len), dtype=torch.int32)
                prompt = torch.cat([padding, prompt], dim=1)
                mask = torch.cat([torch.zeros((1, pad_len)), torch.ones((1, prompt_len))], dim=1)
            else:
                mask = torch.ones((1, prompt_len))
            padded_prompts.append(prompt[None, :, :])
            mask_rows.append(mask)
        return torch.cat(padded_prompts, dim=0).long(), torch.cat(mask_rows, dim=0)

    @torch.no_grad()
    def _generate_codes_for_text_batch(self, encoded_prompts, max_new_tokens, top_p=0.9, top_k=30,
                                       temperature=0.0):
        batch_size = len(encoded_prompts)
        prompt, attention_mask = self._prepare_batched_prompt_inputs(encoded_prompts)
        cache = self.model.make_cache()
        result = self.model(prompt, cache=cache, attention_mask=attention_mask)
        logits = result.logits[:, -1]
        if FIXED:
            hidden_state = result.hidden_states[:, -1]

        previous_semantic_tokens = [[] for _ in range(batch_size)]
        generated_steps = [[] for _ in range(batch_size)]
        finished = [False] * batch_size
        im_end_id = IM_END_TOKEN_ID
        token_budgets = [max_new_tokens] * batch_size
        max_budget = max(token_budgets)
        im_end_tokens = torch.full((batch_size,), im_end_id, dtype=torch.int32)

        for step in range(max_budget):
            active = [(not finished[idx]) and step < token_budgets[idx] for idx in range(batch_size)]
            if not any(active):
                break
            sampled_semantic = self._sample_semantic_batch(logits, previous_semantic_tokens, top_p, top_k,
                                                           temperature)
            active_mask = torch.tensor(active, dtype=torch.bool)
            semantic_token = torch.where(active_mask, sampled_semantic, im_end_tokens)
            semantic_token_ids = semantic_token.tolist()
            should_continue = []
            for idx, token_id in enumerate(semantic_token_ids):
                keep_generating = active[idx] and token_id != im_end_id
                should_continue.append(keep_generating)
                if active[idx] and not keep_generating:
                    finished[idx] = True
            if not any(should_continue):
                break

            continue_mask = torch.tensor(should_continue, dtype=torch.bool)
            semantic_code = (semantic_token - self.config.semantic_start_token_id).to(torch.int32)
            semantic_code = torch.clamp(semantic_code, 0, self.config.audio_decoder_config.vocab_size - 1)
            semantic_code = torch.where(continue_mask, semantic_code, torch.zeros_like(semantic_code))
            previous_codebooks = semantic_code[:, None]

            fast_cache = self.model.make_fast_cache()
            if FIXED:
                self.model.fast_forward_cached(hidden_state, fast_cache)
            fast_hidden = self.model.fast_embeddings(semantic_code.long())
            for _ in range(self.model.num_codebooks - 1):
                residual_logits = self.model.fast_forward_cached(fast_hidden, fast_cache)
                residual_token = _sample_logits(residual_logits, temperature=temperature, top_p=top_p, top_k=top_k)
                residual_token = torch.where(continue_mask, residual_token, torch.zeros_like(residual_token))
                previous_codebooks = torch.cat([previous_codebooks, residual_token[:, None]], dim=1)
                fast_hidden = self.model.fast_embeddings(residual_token.long())

            for idx, keep_generating in enumerate(should_continue):
                if not keep_generating:
                    continue
                previous_semantic_tokens[idx].append(semantic_token_ids[idx])
                previous_semantic_tokens[idx] = previous_semantic_tokens[idx][-RAS_WIN_SIZE:]
                generated_steps[idx].append(previous_codebooks[idx])
                if step + 1 >= token_budgets[idx]:
                    finished[idx] = True

            next_input = torch.cat([semantic_token[:, None].to(torch.int32), previous_codebooks], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones((batch_size, 1), dtype=attention_mask.dtype)],
                                       dim=1)
            next_result = self.model(next_input[:, :, None].long(), cache=cache, attention_mask=attention_mask)
            logits = next_result.logits[:, -1]
            if FIXED:
                hidden_state = next_result.hidden_states[:, -1]
            if all(finished):
                break

        return [torch.stack(s, dim=1).to(torch.int32) if s else torch.zeros((self.model.num_codebooks, 0))
                for s in generated_steps]


def encode_prompt(text_ids, num_codebooks):
    # (num_codebooks + 1, T): text rows carry no codebook values
    ids = torch.tensor(text_ids, dtype=torch.int32)
    return torch.cat([ids[None], torch.zeros((num_codebooks, len(text_ids)), dtype=torch.int32)], dim=0)


def main():
    config = ModelConfig()
    model = Model(config).eval()
    nc = config.audio_decoder_config.num_codebooks
    prompts = [
        encode_prompt([1, 5, 9, 12, 7, 22, 31, 2], nc),
        encode_prompt([1, 17, 8, 2], nc),
    ]
    codes = model._generate_codes_for_text_batch(prompts, max_new_tokens=5)
    for i, c in enumerate(codes):
        print(f"row {i} codes (codebooks x frames):")
        print(c.tolist())


if __name__ == "__main__":
    main()
