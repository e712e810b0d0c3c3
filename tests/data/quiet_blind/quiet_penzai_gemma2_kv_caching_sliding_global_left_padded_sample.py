"""Penzai's Gemma 2 in KV-caching sampling mode over a left-padded batch, ported from JAX to torch.

Correct program (quiet batch quiet-r151a). Ported from google-deepmind/penzai
@5bdc18f331b11dbc49ed71cd59671340cb0176f6:
  penzai/nn/attention.py               ApplyCausalAttentionMask,
                                       ApplyCausalSlidingWindowAttentionMask (mask from
                                       query / kv token positions, kv_positions >= 0 drops
                                       padding and unwritten cache slots, jnp.where with a
                                       finite masked_out_value), Attention,
                                       KVCachingAttention (dynamic_update_slice of the
                                       keys and values at cache_end_index, attention over
                                       the whole fixed-length cache)
  penzai/models/transformer/sampling_mode.py
                                       KVCachingTransformerLM.__call__ (positions from the
                                       cumsum of non-pad tokens of previous_tokens, -1 on
                                       pads), from_uncached (maskers switched to
                                       kv_positions_input_name="kv_token_positions")
  penzai/models/transformer/simple_decoding_loop.py
                                       temperature_sample_pyloop (next log-probs taken at
                                       each row's last non-pad token; greedy argmax here
                                       in place of jax.random.categorical)
and, from penzai's main branch, penzai/models/transformer/variants/gemma.py
(_GEMMA_PRESETS["gemma2_2b"]: attention_type=(AttentionTypeSlidingWindowCausal(4096),
AttentionTypeGlobalCausal()), post-attn / post-ffw norms, final_logit_softcap=30,
attn_logits_soft_cap=50) and llamalike_common.build_llamalike_attention (the attention
type picked as attention_type[block_index % len(attention_type)]; softcap before the
masker; RoPE on "token_positions", query rescaled by projection_dim ** -0.5).

Tiny sizes: 4 blocks alternating sliding (window 4) and global, 2 KV head groups of 2 query
heads. Prompts are left padded with pad_id = 0; the whole prompt is run in one call, then
one token per call until the cache (cache_len = 16) or the step budget is used up.

Check: for each row, the log-probs of every sampling step equal those of the uncached
TransformerLM run on that row's unpadded tokens alone with token_positions = arange (the
same maskers reading "token_positions" for both queries and keys), and the greedy
continuations agree.
"""
import dataclasses
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


# ---------------------------------------------------------------- penzai/nn/attention.py


class ApplyCausalAttentionMask(nn.Module):
    def __init__(self, masked_out_value, query_positions_input_name="token_positions",
                 kv_positions_input_name="token_positions"):
        super().__init__()
        self.masked_out_value = masked_out_value
        self.query_positions_input_name = query_positions_input_name
        self.kv_positions_input_name = kv_positions_input_name

    def forward(self, x, **side_inputs):
        # x: [batch, seq, head_groups, query_heads, kv_seq]
        query_positions = side_inputs[self.query_positions_input_name][:, :, None, None, None]
        kv_positions = side_inputs[self.kv_positions_input_name][:, None, None, None, :]
        mask = (query_positions >= kv_positions) & (kv_positions >= 0)
        return torch.where(mask, x, self.masked_out_value)


class ApplyCausalSlidingWindowAttentionMask(nn.Module):
    def __init__(self, masked_out_value, sliding_window_size,
                 query_positions_input_name="token_positions",
                 kv_positions_input_name="token_positions"):
        super().__init__()
        self.masked_out_value = masked_out_value
        self.sliding_window_size = sliding_window_size
        self.query_positions_input_name = query_positions_input_name
        self.kv_positions_input_name = kv_positions_input_name

    def forward(self, x, **side_inputs):
        query_positions = side_inputs[self.query_positions_input_name][:, :, None, None, None]
        kv_positions = side_inputs[self.kv_positions_input_name][:, None, None, None, :]
        mask = (
            (query_positions >= kv_positions)
            & (query_positions - kv_positions < self.sliding_window_size)
            & (kv_positions >= 0)
        )
        return torch.where(mask, x, self.masked_out_value)


class Attention(nn.Module):
    def __init__(self, input_to_query, input_to_key, input_to_value, query_key_to_attn,
                 attn_value_to_output):
        super().__init__()
        self.input_to_query = input_to_query
        self.input_to_key = input_to_key
        self.input_to_value = input_to_value
        self.query_key_to_attn = query_key_to_attn
        self.attn_value_to_output = attn_value_to_output

    def forward(self, x, **side_inputs):
        query = self.input_to_query(x, **side_inputs)
        key = self.input_to_key(x, **side_inputs)
        value = self.input_to_value(x, **side_inputs)
        attn = self.query_key_to_attn((query, key), **side_inputs)
        return self.attn_value_to_output((attn, value), **side_inputs)


class KVCachingAttention(nn.Module):
    def __init__(self, original, cache_len, cache_end_index_key, batch_size):
        super().__init__()
        self.input_to_query = original.input_to_query
        self.input_to_key = original.input_to_key
        self.input_to_value = original.input_to_value
        self.query_key_to_attn = original.query_key_to_attn
        self.attn_value_to_output = original.attn_value_to_output
        self.kv_cache_end_index_key = cache_end_index_key
        kv = original.input_to_key.linear
        shape = (batch_size, cache_len, kv.num_kv_heads, kv.projection_dim)
        # penzai initializes both caches to zeros.
        self.kv_cache = (torch.zeros(shape), torch.zeros(shape))

    def forward(self, x, **side_inputs):
        kvc_end_index = side_inputs[self.kv_cache_end_index_key]
        key_cache, value_cache = self.kv_cache
        query = self.input_to_query(x, **side_inputs)
        key = self.input_to_key(x, **side_inputs)
        value = self.input_to_value(x, **side_inputs)
        # jax.lax.dynamic_update_slice along the sequence axis.
        new_key_cache = key_cache.clone()
        new_key_cache[:, kvc_end_index:kvc_end_index + key.shape[1]] = key
        new_value_cache = value_cache.clone()
        new_value_cache[:, kvc_end_index:kvc_end_index + value.shape[1]] = value
        self.kv_cache = (new_key_cache, new_value_cache)
        attn = self.query_key_to_attn((query, new_key_cache), **side_inputs)
        return self.attn_value_to_output((attn, new_value_cache), **side_inputs)


# ------------------------------------------ llamalike_common building blocks (torch names)


@dataclasses.dataclass(frozen=True)
class AttentionTypeGlobalCausal:
    pass


@dataclasses.dataclass(frozen=True)
class AttentionTypeSlidingWindowCausal:
    window_size: int


@dataclasses.dataclass(kw_only=True)
class LlamalikeTransformerConfig:
    num_kv_heads: int
    query_head_multiplier: int
    embedding_dim: int
    projection_dim: int
    mlp_hidden_dim: int
    num_decoder_blocks: int
    vocab_size: int
    mlp_variant: str
    tie_embedder_and_logits: bool
    rope_wavelength: float = 10_000
    rms_norm_eps: float = 1e-6
    attention_type: Any = AttentionTypeGlobalCausal()
    use_post_attn_norm: bool = False
    use_post_ffw_norm: bool = False
    final_logit_softcap: float | None = None
    attn_logits_soft_cap: float | None = None
    query_scaling_factor: Any = "default"
    activation_dtype: torch.dtype = torch.float32


class RMSLayerNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x, **side_inputs):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class KVLinear(nn.Module):
    def __init__(self, embedding_dim, num_kv_heads, projection_dim):
        super().__init__()
        self.num_kv_heads, self.projection_dim = num_kv_heads, projection_dim
        self.weight = nn.Parameter(torch.randn(embedding_dim, num_kv_heads, projection_dim)
                                   / math.sqrt(embedding_dim))

    def forward(self, x, **side_inputs):
        return torch.einsum("bse,egp->bsgp", x, self.weight)


class QueryLinear(nn.Module):
    def __init__(self, embedding_dim, num_kv_heads, query_head_multiplier, projection_dim):
        super().__init__()
        self.weight = nn.Parameter(
            torch.randn(embedding_dim, num_kv_heads, query_head_multiplier, projection_dim)
            / math.sqrt(embedding_dim))

    def forward(self, x, **side_inputs):
        return torch.einsum("bse,eghp->bsghp", x, self.weight)


class ApplyRoPE(nn.Module):
    """penzai.nn.ApplyRoPE: rotate the two halves of the projection axis."""

    def __init__(self, positions_input_name, max_wavelength):
        super().__init__()
        self.positions_input_name = positions_input_name
        self.max_wavelength = max_wavelength

    def forward(self, x, **side_inputs):
        positions = side_inputs[self.positions_input_name].to(torch.float32)
        half = x.shape[-1] // 2
        freq_exponents = 2.0 * torch.arange(half, dtype=torch.float32) / x.shape[-1]
        timescale = self.max_wavelength ** freq_exponents
        sinusoid = positions[..., None] / timescale  # [batch, seq, half]
        while sinusoid.dim() < x.dim():
            sinusoid = sinusoid.unsqueeze(-2)
        sin, cos = torch.sin(sinusoid), torch.cos(sinusoid)
        first_half, second_half = x[..., :half], x[..., half:]
        return torch.cat([first_half * cos - second_half * sin,
                          second_half * cos + first_half * sin], dim=-1).to(x.dtype)


class Sequential(nn.Module):
    def __init__(self, sublayers):
        super().__init__()
        self.sublayers = nn.ModuleList(sublayers)

    def forward(self, x, **side_inputs):
        for layer in self.sublayers:
            x = layer(x, **side_inputs)
        return x


class ConstantRescale(nn.Module):
    def __init__(self, by):
        super().__init__()
        self.by = by

    def forward(self, x, **side_inputs):
        return x * self.by


class QueryKeyEinsum(nn.Module):
    def forward(self, qk, **side_inputs):
        query, key = qk
        return torch.einsum("bqghp,bkgp->bqghk", query, key)


class TanhSoftCap(nn.Module):
    def __init__(self, soft_cap):
        super().__init__()
        self.soft_cap = soft_cap

    def forward(self, x, **side_inputs):
        return torch.tanh(x / self.soft_cap) * self.soft_cap


class Softmax(nn.Module):
    def forward(self, x, **side_inputs):
        return torch.softmax(x, dim=-1)


class AttnValueToOutput(nn.Module):
    def __init__(self, embedding_dim, num_kv_heads, query_head_multiplier, projection_dim):
        super().__init__()
        self.weight = nn.Parameter(
            torch.randn(num_kv_heads, query_head_multiplier, projection_dim, embedding_dim)
            / math.sqrt(num_kv_heads * query_head_multiplier * projection_dim))

    def forward(self, attn_value, **side_inputs):
        attn, value = attn_value
        heads = torch.einsum("bqghk,bkgp->bqghp", attn, value)
        return torch.einsum("bqghp,ghpe->bqe", heads, self.weight)


class KeyPipeline(Sequential):
    @property
    def linear(self):
        return self.sublayers[0]


def build_llamalike_attention(config: LlamalikeTransformerConfig, block_index: int) -> Attention:
    # As used in https://github.com/google-deepmind/gemma.
    masked_out_value = torch.tensor(-2.3819763e38, dtype=config.activation_dtype)
    if isinstance(config.attention_type, (AttentionTypeGlobalCausal,
                                          AttentionTypeSlidingWindowCausal)):
        attention_type = config.attention_type
    else:
        attention_type = config.attention_type[block_index % len(config.attention_type)]

    if config.query_scaling_factor == "default":
        query_scaling_factor = config.projection_dim ** -0.5
    else:
        query_scaling_factor = config.query_scaling_factor

    if isinstance(attention_type, AttentionTypeSlidingWindowCausal):
        attn_masker = ApplyCausalSlidingWindowAttentionMask(
            sliding_window_size=attention_type.window_size,
            masked_out_value=masked_out_value,
        )
    elif isinstance(attention_type, AttentionTypeGlobalCausal):
        attn_masker = ApplyCausalAttentionMask(masked_out_value=masked_out_value)
    else:
        raise ValueError(f"Unsupported attention type {attention_type}")

    query_key_to_attn_sublayers = [QueryKeyEinsum()]
    if config.attn_logits_soft_cap is not None:
        query_key_to_attn_sublayers.append(TanhSoftCap(config.attn_logits_soft_cap))
    query_key_to_attn_sublayers.extend([attn_masker, Softmax()])

    return Attention(
        input_to_query=Sequential([
            QueryLinear(config.embedding_dim, config.num_kv_heads,
                        config.query_head_multiplier, config.projection_dim),
            ApplyRoPE("token_positions", config.rope_wavelength),
            ConstantRescale(query_scaling_factor),
        ]),
        input_to_key=KeyPipeline([
            KVLinear(config.embedding_dim, config.num_kv_heads, config.projection_dim),
            ApplyRoPE("token_positions", config.rope_wavelength),
        ]),
        input_to_value=Sequential([
            KVLinear(config.embedding_dim, config.num_kv_heads, config.projection_dim),
        ]),
        query_key_to_attn=Sequential(query_key_to_attn_sublayers),
        attn_value_to_output=AttnValueToOutput(config.embedding_dim, config.num_kv_heads,
                                               config.query_head_multiplier,
                                               config.projection_dim),
    )


class GeGLUFeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        e, n = config.embedding_dim, config.mlp_hidden_dim
        self.gating_linear = nn.Parameter(torch.randn(e, n) / math.sqrt(e))
        self.value_linear = nn.Parameter(torch.randn(e, n) / math.sqrt(e))
        self.out_linear = nn.Parameter(torch.randn(n, e) / math.sqrt(n))

    def forward(self, x, **side_inputs):
        gate = F.gelu(x @ self.gating_linear, approximate="tanh")
        return (gate * (x @ self.value_linear)) @ self.out_linear


class TransformerBlock(nn.Module):
    def __init__(self, config, block_index):
        super().__init__()
        eps = config.rms_norm_eps
        self.pre_attention_norm = RMSLayerNorm(config.embedding_dim, eps)
        self.attention = build_llamalike_attention(config, block_index)
        self.post_attention_norm = (RMSLayerNorm(config.embedding_dim, eps)
                                    if config.use_post_attn_norm else None)
        self.pre_ffw_norm = RMSLayerNorm(config.embedding_dim, eps)
        self.mlp = GeGLUFeedForward(config)
        self.post_ffw_norm = (RMSLayerNorm(config.embedding_dim, eps)
                              if config.use_post_ffw_norm else None)

    def forward(self, x, **side_inputs):
        h = self.attention(self.pre_attention_norm(x), **side_inputs)
        if self.post_attention_norm is not None:
            h = self.post_attention_norm(h)
        x = x + h
        h = self.mlp(self.pre_ffw_norm(x))
        if self.post_ffw_norm is not None:
            h = self.post_ffw_norm(h)
        return x + h


class TransformerLM(nn.Module):
    """model_parts.TransformerLM: embeddings, blocks, final norm, tied logits."""

    def __init__(self, config: LlamalikeTransformerConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Parameter(
            torch.randn(config.vocab_size, config.embedding_dim) / math.sqrt(config.embedding_dim))
        self.blocks = nn.ModuleList(TransformerBlock(config, i)
                                    for i in range(config.num_decoder_blocks))
        self.final_norm = RMSLayerNorm(config.embedding_dim, config.rms_norm_eps)

    def forward(self, tokens, **side_inputs):
        x = self.embeddings[tokens] * math.sqrt(self.config.embedding_dim)
        for block in self.blocks:
            x = block(x, **side_inputs)
        x = self.final_norm(x)
        logits = x @ self.embeddings.T
        if self.config.final_logit_softcap is not None:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return torch.log_softmax(logits, dim=-1)


# ------------------------------------------------- penzai/models/transformer/sampling_mode.py


class KVCachingTransformerLM(nn.Module):
    def __init__(self, body, cache_len, batch_size, pad_id):
        super().__init__()
        self.body = body
        self.cache_len = cache_len
        self.pad_id = pad_id
        self.previous_tokens = torch.zeros(batch_size, cache_len, dtype=torch.long)
        self.cache_end_index = 0

    def forward(self, tokens, **extra_side_inputs):
        seq = tokens.shape[1]
        updated_tokens = self.previous_tokens.clone()
        updated_tokens[:, self.cache_end_index:self.cache_end_index + seq] = tokens
        # Query position and key position are both based on the number of preceding
        # padding tokens (after updating the written tokens).
        kv_nonpad_mask = updated_tokens != self.pad_id
        kv_nonpad_so_far_inclusive = torch.cumsum(kv_nonpad_mask, dim=1)
        key_value_positions = torch.where(kv_nonpad_mask, kv_nonpad_so_far_inclusive - 1, -1)
        query_positions = key_value_positions[:, self.cache_end_index:self.cache_end_index + seq]
        outs = self.body(
            tokens,
            token_positions=query_positions,
            kv_token_positions=key_value_positions,
            cache_end_index=self.cache_end_index,
            **extra_side_inputs,
        )
        self.previous_tokens = updated_tokens
        self.cache_end_index = self.cache_end_index + seq
        return outs

    @classmethod
    def from_uncached(cls, uncached: TransformerLM, cache_len: int, batch_size: int,
                      pad_id: int = 0):
        for block in uncached.blocks:
            attn = block.attention
            for sub in attn.query_key_to_attn.sublayers:
                if isinstance(sub, (ApplyCausalAttentionMask,
                                    ApplyCausalSlidingWindowAttentionMask)):
                    if sub.kv_positions_input_name != "token_positions":
                        raise ValueError("Could not automatically convert attention mask "
                                         f"layer with non-standard positions input name: {sub}")
                    sub.kv_positions_input_name = "kv_token_positions"
            block.attention = KVCachingAttention(attn, cache_len=cache_len,
                                                 cache_end_index_key="cache_end_index",
                                                 batch_size=batch_size)
        return cls(uncached, cache_len, batch_size, pad_id)


# ----------------------------------------- penzai/models/transformer/simple_decoding_loop.py


def greedy_sample_pyloop(model: KVCachingTransformerLM, prompt, max_sampling_steps=None):
    if max_sampling_steps is None:
        max_sampling_steps = model.cache_len
    all_log_probs = model(prompt)
    non_padding_mask = prompt != model.pad_id
    positions = torch.arange(prompt.shape[1])
    max_non_padding_index = torch.where(non_padding_mask, positions, -1).argmax(dim=1)
    next_log_probs = all_log_probs[torch.arange(prompt.shape[0]), max_non_padding_index]

    step_log_probs = []
    sampled_count = 0
    initial_cache_index = model.cache_end_index
    while True:
        step_log_probs.append(next_log_probs)
        next_token = next_log_probs.argmax(dim=-1)
        sampled_count += 1
        if model.cache_end_index >= model.cache_len or sampled_count >= max_sampling_steps:
            break
        next_log_probs = model(next_token[:, None])[:, 0]
    final_written = torch.cat(
        [model.previous_tokens[:, initial_cache_index:model.cache_end_index],
         next_token[:, None]], dim=1)
    return final_written, torch.stack(step_log_probs, dim=1)


# ------------------------------------------------------------------------------------ main


def main():
    torch.manual_seed(0)
    pad_id = 0
    # A gemma2-style preset at tiny sizes (see _GEMMA_PRESETS["gemma2_2b"]).
    config = LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=32,
        projection_dim=8,
        mlp_hidden_dim=64,
        num_decoder_blocks=4,
        vocab_size=50,
        mlp_variant="geglu_approx",
        tie_embedder_and_logits=True,
        rope_wavelength=10_000,
        attention_type=(AttentionTypeSlidingWindowCausal(4), AttentionTypeGlobalCausal()),
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
        final_logit_softcap=30.0,
        attn_logits_soft_cap=50.0,
    )
    model = TransformerLM(config).eval()

    prompts = [[2, 17, 5, 33, 8, 41, 12], [2, 9, 27], [2, 44, 6, 19, 30]]
    width = max(len(p) for p in prompts)
    prompt = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    cache_len, steps = 16, 8

    # Reference: each prompt alone, unpadded, no cache, recomputed from scratch every step.
    ref_tokens, ref_log_probs = [], []
    with torch.no_grad():
        for p in prompts:
            seq, rows = list(p), []
            for _ in range(steps):
                toks = torch.tensor([seq])
                log_probs = model(toks, token_positions=torch.arange(len(seq))[None])[0, -1]
                rows.append(log_probs)
                seq.append(int(log_probs.argmax()))
            ref_tokens.append(seq[len(p):])
            ref_log_probs.append(torch.stack(rows))

    sampler = KVCachingTransformerLM.from_uncached(model, cache_len=cache_len,
                                                   batch_size=len(prompts), pad_id=pad_id)
    with torch.no_grad():
        written, log_probs = greedy_sample_pyloop(sampler, prompt, max_sampling_steps=steps)

    continuations = written  # the tokens after the prompt
    assert (continuations != pad_id).all(), "sampled the pad token"
    max_err = 0.0
    for i in range(len(prompts)):
        max_err = max(max_err, (log_probs[i] - ref_log_probs[i]).abs().max().item())
        assert continuations[i].tolist() == ref_tokens[i], (i, continuations[i], ref_tokens[i])
    assert max_err < 1e-4, max_err
    print("continuations:", continuations.tolist())
    print(f"max |log-prob diff| vs per-row uncached run: {max_err:.2e}")


if __name__ == "__main__":
    main()
