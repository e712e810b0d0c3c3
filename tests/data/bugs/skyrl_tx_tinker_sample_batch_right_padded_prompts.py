# NovaSky-AI/SkyRL#747 (commit 6ecf878, "[tx] Fix sampling bug where prompts were right-padded instead of
# left-padded"), skyrl-tx/tx/tinker/engine.py TinkerEngine.process_sample_batch, feeding
# tx/utils/generator.py GeneratorMixin.generate and tx/models/qwen3.py (JAX, ported to torch here).
# The sampler batches the prompts of several requests, pads them to a bucketed length with pad_batch and builds the
# attention mask the same way. pad_batch wrote each sequence at the start of its row (right padding), but the
# generator is written for left padding: positions come from the first 1 of the mask, the first token is sampled
# from the logits at the last column, and decode writes every row's new key at the shared cache_position. So a
# shorter prompt is continued from a pad slot's logits, and its new tokens sit after a masked gap at positions that
# count the pads.
# Fix: pad_batch(..., left=True) for both input_ids and attention_mask, so each prompt ends in the last column.
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import Qwen3Config

FIXED = "--fixed" in sys.argv


# ---- tx/models/qwen3.py -------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, size: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.randn(size) * 0.1 + 1.0)

    def forward(self, x):
        rms = torch.sqrt(torch.mean(x**2, dim=-1, keepdim=True) + self.eps)
        return self.weight * x / rms


def apply_rope(inputs, position_ids, head_dim: int, theta: int):
    fraction = 2 * torch.arange(0, head_dim // 2, dtype=torch.float32) / head_dim
    timescale = torch.pow(theta, fraction)
    x = (position_ids[..., None] / timescale[None, None, :])[..., None, :]
    sin, cos = torch.sin(x), torch.cos(x)
    a, b = torch.chunk(inputs, 2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(inputs.dtype)


def dot_product_attention(query, key, value, *, scale, mask, is_causal):
    """jax.nn.dot_product_attention (xla implementation): [B, T, N, H] layout, GQA by grouping query heads,
    `mask` True where attention is allowed, `is_causal` adds a lower-triangular mask; masked logits are set to a
    large negative value before the softmax."""
    B, T, N, H = query.shape
    S, K = key.shape[1], key.shape[2]
    G = N // K
    q = query.reshape(B, T, K, G, H)
    logits = torch.einsum("btkgh,bskh->bkgts", q, key) * scale
    combined = mask[:, :, None, :, :]  # [B, 1, 1, T or 1, S]
    if is_causal:
        combined = combined & torch.tril(torch.ones(T, S, dtype=torch.bool))
    large_negative = torch.finfo(logits.dtype).min * 0.7
    logits = torch.where(combined, logits, torch.full_like(logits, large_negative))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bkgts,bskh->btkgh", probs, value)
    return out.reshape(B, T, N, H)


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, x, *, attention_mask, positions, kv_cache=None):
        B, T, _ = x.shape

        # Project and reshape to [B, T, num_heads, head_dim]
        q = self.q_norm(self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)

        # Apply RoPE
        q = apply_rope(q, positions, self.head_dim, self.config.rope_theta)
        k = apply_rope(k, positions, self.head_dim, self.config.rope_theta)

        # Handle KV cache
        if kv_cache is not None:
            k_cache, v_cache, cache_position = kv_cache
            # jax.lax.dynamic_update_slice(k_cache, k, (0, cache_position, 0, 0))
            k = torch.cat([k_cache[:, :cache_position], k, k_cache[:, cache_position + T:]], dim=1)
            v = torch.cat([v_cache[:, :cache_position], v, v_cache[:, cache_position + T:]], dim=1)

        updated_cache = (k, v)

        # Attention (causal only during prefill, GQA handled natively by dot_product_attention)
        attn_output = dot_product_attention(
            q,
            k,
            v,
            scale=1.0 / self.head_dim**0.5,
            mask=attention_mask[:, None, None, :].bool(),
            is_causal=kv_cache is None,
        )

        output = attn_output.reshape(B, T, self.num_heads * self.head_dim)
        return self.o_proj(output), updated_cache


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config)
        self.mlp = Qwen3MLP(config)

    def forward(self, hidden_states, *, attention_mask, positions, kv_cache=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, updated_cache = self.self_attn(
            hidden_states, attention_mask=attention_mask, positions=positions, kv_cache=kv_cache
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + self.mlp(hidden_states)
        return hidden_states, updated_cache


@dataclass
class KVCache:
    """Key-value cache for all layers, each entry in the list corresponds to one layer."""

    keys: list
    values: list
    cache_position: int

    def pad_to_length(self, max_length: int) -> "KVCache":
        # k and v have shape [B, T, num_heads, head_dim]
        cache_pad_length = max_length - self.keys[0].shape[1]
        return KVCache(
            keys=[F.pad(k, (0, 0, 0, 0, 0, cache_pad_length)) for k in self.keys],
            values=[F.pad(v, (0, 0, 0, 0, 0, cache_pad_length)) for v in self.values],
            cache_position=self.cache_position,
        )


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids, *, attention_mask, positions, kv_cache=None):
        hidden_states = self.embed_tokens(input_ids)
        updated_keys, updated_values = [], []
        for layer_idx, layer in enumerate(self.layers):
            hidden_states, (k, v) = layer(
                hidden_states,
                attention_mask=attention_mask,
                positions=positions,
                kv_cache=kv_cache and (kv_cache.keys[layer_idx], kv_cache.values[layer_idx], kv_cache.cache_position),
            )
            updated_keys.append(k)
            updated_values.append(v)
        hidden_states = self.norm(hidden_states)

        # Increment cache_position if cache exists, or use sequence length for new cache
        new_cache_position = kv_cache.cache_position + 1 if kv_cache is not None else input_ids.shape[1]
        return hidden_states, KVCache(keys=updated_keys, values=updated_values, cache_position=new_cache_position)


# ---- tx/utils/generator.py ------------------------------------------------------------------------------------
def compute_positions(attention_mask):
    """Compute positions from attention mask.

    Positions start at 0 from the first non-zero value in the attention mask
    and increment sequentially.
    """
    first_token_idx = torch.argmax(attention_mask, dim=1, keepdim=True)
    return torch.arange(attention_mask.shape[1])[None, :] - first_token_idx


@dataclass
class SamplingParams:
    temperature: float
    max_tokens: int
    seed: int
    stop: list | None = None


@dataclass
class GenerateOutput:
    generated_ids: list
    stop_reasons: list
    logprobs: list


def round_up_seq_len(seq_len: int) -> int:
    """Rounds a sequence length up to roughly two significant binary digits."""
    if seq_len <= 32:
        return 32
    msb_pos = seq_len.bit_length() - 1
    mask = (1 << msb_pos) | (1 << (msb_pos - 1))
    result = seq_len & mask
    if result < seq_len:
        result += 1 << (msb_pos - 1)
    return result


class GeneratorMixin:
    """Adds autoregressive generation with KV caching to causal language models."""

    @torch.no_grad()
    def _prefill_and_decode(self, input_ids, attention_mask, max_length, max_new_tokens, temperatures, rngs,
                            stop_tokens):
        # Compute positions from attention mask
        positions = compute_positions(attention_mask)

        # Prefill: process full prompt
        logits, kv_cache = self(input_ids, attention_mask=attention_mask, positions=positions)

        # Pad KV cache and attention mask
        kv_cache = kv_cache.pad_to_length(max_length)
        decode_attention_mask = F.pad(attention_mask, (0, max_length - attention_mask.shape[1]))

        s_attention_mask = decode_attention_mask
        s_last_positions = positions[:, -1:]
        s_logits = logits[:, -1, :]
        s_stop_pos = torch.full((input_ids.shape[0],), -1)
        tokens, logprobs = [], []
        for step in range(max_new_tokens):
            # Sample next token
            zero_temp_mask = temperatures == 0.0
            scaled_logits = s_logits / torch.where(zero_temp_mask, 1.0, temperatures)[:, None]
            sampled = torch.stack([
                torch.multinomial(torch.softmax(scaled_logits[i], -1), 1, generator=rngs[i])[0]
                for i in range(scaled_logits.shape[0])
            ])
            greedy = torch.argmax(s_logits, dim=-1)
            next_token = torch.where(zero_temp_mask[:, None], greedy[:, None], sampled[:, None])
            log_probs = torch.log_softmax(s_logits, dim=-1)
            sampled_logprob = torch.take_along_dim(log_probs, next_token, dim=-1)

            # Track first stop token position (-1 means not stopped yet)
            is_stop = torch.any(next_token == stop_tokens, dim=1)
            s_stop_pos = torch.where((s_stop_pos == -1) & is_stop, step + 1, s_stop_pos)

            # Update attention mask: set next position to 1
            next_attention_mask = s_attention_mask.clone()
            next_attention_mask[:, kv_cache.cache_position] = 1

            logits, kv_cache = self(
                next_token, attention_mask=next_attention_mask, positions=s_last_positions + 1, kv_cache=kv_cache
            )
            s_attention_mask = next_attention_mask
            s_last_positions = s_last_positions + 1
            s_logits = logits[:, -1, :]
            tokens.append(next_token)
            logprobs.append(sampled_logprob)

        new_tokens = torch.cat(tokens, dim=1)
        new_logprobs = torch.cat(logprobs, dim=1)
        return new_tokens, new_logprobs, s_stop_pos

    def generate(self, input_ids, attention_mask, *, sampling_params):
        batch_size, prompt_length = input_ids.shape
        assert len(sampling_params) == batch_size
        max_new_tokens = max(sampling_param.max_tokens for sampling_param in sampling_params)
        max_length = round_up_seq_len(prompt_length + max_new_tokens)
        temperatures = torch.tensor([sampling_param.temperature for sampling_param in sampling_params])

        # One PRNGKey per provided seed
        rngs = [torch.Generator().manual_seed(sp.seed) for sp in sampling_params]

        # Extract stop tokens and pad to same length
        max_stop_tokens = max(len(sp.stop) if sp.stop else 0 for sp in sampling_params)
        stop_tokens = []
        for sp in sampling_params:
            stop = sp.stop or []
            stop_tokens.append(stop + [-1] * (max_stop_tokens - len(stop)))
        stop_tokens = torch.tensor(stop_tokens, dtype=torch.long)

        new_tokens, new_logprobs, stop_pos = self._prefill_and_decode(
            input_ids, attention_mask, max_length, max_new_tokens, temperatures, rngs, stop_tokens
        )

        max_tokens = torch.tensor([sp.max_tokens for sp in sampling_params])
        # stop_pos is -1 if no stop token found; has_stop is true only if found within limit
        has_stop = (stop_pos != -1) & (stop_pos <= max_tokens)
        end_positions = torch.where(has_stop, stop_pos, max_tokens)

        return GenerateOutput(
            generated_ids=[new_tokens[i][: end_positions[i]].tolist() for i in range(batch_size)],
            stop_reasons=["stop" if has_stop[i] else "length" for i in range(batch_size)],
            logprobs=[new_logprobs[i][: end_positions[i]].tolist() for i in range(batch_size)],
        )


class Qwen3ForCausalLM(nn.Module, GeneratorMixin):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, *, attention_mask, positions=None, kv_cache=None):
        if positions is None:
            positions = compute_positions(attention_mask)
        hidden_states, kv_cache = self.model(input_ids, attention_mask=attention_mask, positions=positions,
                                             kv_cache=kv_cache)
        return self.lm_head(hidden_states), kv_cache


# ---- tx/tinker/engine.py --------------------------------------------------------------------------------------
def pad(xs, pad_to: int, *, fill):
    """Pad a list to a specified length with a fill value."""
    return xs + ([fill] * (pad_to - len(xs)))


def pad_batch(sequences, max_length: int, dtype, left: bool = False):
    """Pad a batch of sequences to max_length."""
    batch_size = len(sequences)
    padded = np.zeros((batch_size, max_length), dtype=dtype)
    for i, seq in enumerate(sequences):
        if left:
            padded[i, max_length - len(seq):] = seq
        else:
            padded[i, : len(seq)] = seq
    return torch.from_numpy(padded).long()


def process_sample_batch(model, requests, sample_max_num_sequences=0):
    """TinkerEngine.process_sample_batch, without the database, LoRA adapters and prompt logprobs."""
    all_prompts = []
    all_sampling_params = []
    request_batch_slices = []
    for request_id, request_data in requests.items():
        request_start = len(all_prompts)
        for _ in range(request_data["num_samples"]):
            prompt_tokens = [token for chunk in request_data["prompt_chunks"] for token in chunk]
            all_prompts.append(prompt_tokens)
            all_sampling_params.append(request_data["sampling_params"])
        request_batch_slices.append((request_id, request_start, len(all_prompts)))

    total_batch_size = len(all_prompts)
    max_batch_size = sample_max_num_sequences if sample_max_num_sequences > 0 else total_batch_size
    all_sequences = []
    for batch_start in range(0, total_batch_size, max_batch_size):
        batch_end = min(batch_start + max_batch_size, total_batch_size)
        batch_prompts = pad(all_prompts[batch_start:batch_end], max_batch_size, fill=[])
        sampling_params = pad(
            all_sampling_params[batch_start:batch_end], max_batch_size, fill=all_sampling_params[batch_start]
        )

        # Pad sequences to same length within the batch to minimize memory usage.
        # Also bin it so the JIT has to compile fewer kernels.
        max_len = round_up_seq_len(max((len(seq) for seq in batch_prompts), default=0))
        if FIXED:
            # Use left-padding for sampling so the last position is always the last real token.
            input_ids = pad_batch(batch_prompts, max_len, np.int32, left=True)
            attention_mask = pad_batch([[1] * len(seq) for seq in batch_prompts], max_len, np.int32, left=True)
        else:
            input_ids = pad_batch(batch_prompts, max_len, np.int32)
            attention_mask = pad_batch([[1] * len(seq) for seq in batch_prompts], max_len, np.int32)

        result = model.generate(input_ids, attention_mask, sampling_params=sampling_params)
        batch_size = batch_end - batch_start
        all_sequences.extend(
            dict(stop_reason=stop_reason, tokens=tokens, logprobs=logprobs)
            for stop_reason, tokens, logprobs in zip(
                result.stop_reasons[:batch_size], result.generated_ids[:batch_size], result.logprobs[:batch_size]
            )
        )

    results = {}
    for request_id, start_idx, end_idx in request_batch_slices:
        results[request_id] = [all_sequences[i] for i in range(start_idx, end_idx)]
    return results


def main():
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    config.rope_theta = 10000  # a top-level attribute in the transformers 4.x Qwen3Config tx wrapped
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0, 1.0)
        model.lm_head.weight.normal_(0, 0.3)

    g = torch.Generator().manual_seed(1)
    requests = {
        "req-a": dict(prompt_chunks=[torch.randint(1, 64, (11,), generator=g).tolist()], num_samples=1,
                      sampling_params=SamplingParams(temperature=0.0, max_tokens=8, seed=1, stop=[3])),
        "req-b": dict(prompt_chunks=[torch.randint(1, 64, (4,), generator=g).tolist(),
                                     torch.randint(1, 64, (3,), generator=g).tolist()], num_samples=2,
                      sampling_params=SamplingParams(temperature=1.0, max_tokens=8, seed=7)),
        "req-c": dict(prompt_chunks=[torch.randint(1, 64, (17,), generator=g).tolist()], num_samples=1,
                      sampling_params=SamplingParams(temperature=0.0, max_tokens=8, seed=2)),
    }
    results = process_sample_batch(model, requests)
    for request_id, sequences in results.items():
        for seq in sequences:
            print(request_id, seq["stop_reason"], seq["tokens"], [round(x, 3) for x in seq["logprobs"]])


if __name__ == "__main__":
    main()
