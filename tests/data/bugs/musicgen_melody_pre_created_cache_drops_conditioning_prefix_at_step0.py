# huggingface/transformers#48679 (fixes #45647; root cause analysed in #48664)
# MusicgenMelody fuses the text + chroma conditioning as a prefix of the decoder's self-attention. After generation
# started pre-creating an empty DynamicCache, prepare_inputs_for_generation's `past_key_values is not None` guard
# dropped encoder_hidden_states already at step 0: no decoder token (conditional or CFG half) ever attended to the prefix.
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class MusicgenMelodyDecoderConfig:
    vocab_size: int = 32
    max_position_embeddings: int = 64
    num_hidden_layers: int = 2
    ffn_dim: int = 128
    num_attention_heads: int = 4
    hidden_size: int = 64
    num_codebooks: int = 4
    audio_channels: int = 1
    pad_token_id: int = 32
    decoder_start_token_id: int = 32
    max_length: int = 12
    guidance_scale: float = 3.0


class DynamicCache:
    def __init__(self):
        self.key_cache = []
        self.value_cache = []

    def get_seq_length(self, layer_idx=0):
        if len(self.key_cache) <= layer_idx:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def update(self, key_states, value_states, layer_idx):
        if len(self.key_cache) <= layer_idx:
            self.key_cache.append(key_states)
            self.value_cache.append(value_states)
        else:
            self.key_cache[layer_idx] = torch.cat([self.key_cache[layer_idx], key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([self.value_cache[layer_idx], value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]


class MusicgenMelodySinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions: int, embedding_dim: int):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.register_buffer("weights", self.get_embedding(num_positions, embedding_dim), persistent=False)

    @staticmethod
    def get_embedding(num_embeddings: int, embedding_dim: int):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.int64).float() * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.int64).float().unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.cos(emb), torch.sin(emb)], dim=1).view(num_embeddings, -1)
        return emb.to(torch.get_default_dtype())

    def forward(self, inputs_embeds: torch.Tensor, cache_length: int = 0):
        bsz, seq_len, _ = inputs_embeds.size()
        position_ids = torch.arange(seq_len, device=inputs_embeds.device) + cache_length
        return self.weights.index_select(0, position_ids.view(-1)).detach()


def create_causal_mask(inputs_embeds, attention_mask, cache):
    bsz, tgt_len = inputs_embeds.shape[:2]
    past_key_values_length = cache.get_seq_length() if cache is not None else 0
    dtype = inputs_embeds.dtype
    kv_len = past_key_values_length + tgt_len
    q_idx = torch.arange(tgt_len)[:, None] + past_key_values_length
    kv_idx = torch.arange(kv_len)[None, :]
    allowed = kv_idx <= q_idx
    if attention_mask is not None:
        allowed = allowed[None] & attention_mask[:, None, :kv_len].bool()
    else:
        allowed = allowed[None].expand(bsz, -1, -1)
    causal_mask = torch.zeros(bsz, 1, tgt_len, kv_len, dtype=dtype)
    causal_mask = causal_mask.masked_fill(~allowed[:, None], torch.finfo(dtype).min)
    return causal_mask


def eager_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0):
    if scaling is None:
        scaling = query.size(-1) ** -0.5
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value)
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, attn_weights


class MusicgenMelodyAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, layer_idx):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.layer_idx = layer_idx
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, hidden_states, attention_mask=None, cache=None):
        bsz, tgt_len = hidden_states.shape[:-1]
        hidden_shape = (bsz, tgt_len, -1, self.head_dim)
        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx)
        attn_output, attn_weights = eager_attention_forward(
            self, query_states, key_states, value_states, attention_mask, scaling=self.scaling
        )
        attn_output = attn_output.reshape(bsz, tgt_len, -1).contiguous()
        return self.out_proj(attn_output), attn_weights


class MusicgenMelodyDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.embed_dim = config.hidden_size
        self.self_attn = MusicgenMelodyAttention(self.embed_dim, config.num_attention_heads, layer_idx)
        self.activation_fn = nn.GELU()
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.ffn_dim, bias=False)
        self.fc2 = nn.Linear(config.ffn_dim, self.embed_dim, bias=False)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, cache=None):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states, attention_mask=attention_mask, cache=cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc2(self.activation_fn(self.fc1(hidden_states)))
        return residual + hidden_states


class MusicgenMelodyDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_codebooks = config.num_codebooks
        embed_dim = config.vocab_size + 1
        self.embed_tokens = nn.ModuleList([nn.Embedding(embed_dim, config.hidden_size) for _ in range(config.num_codebooks)])
        self.embed_positions = MusicgenMelodySinusoidalPositionalEmbedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([MusicgenMelodyDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.layer_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                cache=None, use_cache=True):
        input = input_ids.reshape(-1, self.num_codebooks, input_ids.shape[-1])
        bsz, num_codebooks, seq_len = input.shape
        if use_cache and cache is None:
            cache = DynamicCache()
        cache_length = cache.get_seq_length() if cache is not None else 0
        inputs_embeds = sum(self.embed_tokens[codebook](input[:, codebook]) for codebook in range(num_codebooks))

        if encoder_hidden_states is not None:
            if encoder_attention_mask is not None and attention_mask is None:
                attention_mask = torch.ones(inputs_embeds.shape[:2], device=inputs_embeds.device)
            if attention_mask is not None:
                if encoder_attention_mask is None:
                    encoder_attention_mask = torch.ones(encoder_hidden_states.shape[:2], device=attention_mask.device)
                attention_mask = torch.cat([encoder_attention_mask, attention_mask], dim=1)
            inputs_embeds = torch.cat([encoder_hidden_states, inputs_embeds], dim=1)

        attention_mask = create_causal_mask(inputs_embeds=inputs_embeds, attention_mask=attention_mask, cache=cache)

        positions = self.embed_positions(inputs_embeds, cache_length)
        hidden_states = inputs_embeds + positions.to(inputs_embeds.device)
        for decoder_layer in self.layers:
            hidden_states = decoder_layer(hidden_states, attention_mask=attention_mask, cache=cache)
        return self.layer_norm(hidden_states), cache


class MusicgenMelodyForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_codebooks = config.num_codebooks
        self.model = MusicgenMelodyDecoder(config)
        self.lm_heads = nn.ModuleList([nn.Linear(config.hidden_size, config.vocab_size, bias=False)
                                       for _ in range(config.num_codebooks)])

    def forward(self, input_ids=None, attention_mask=None, encoder_hidden_states=None, encoder_attention_mask=None,
                cache=None, use_cache=True):
        hidden_states, cache = self.model(input_ids, attention_mask=attention_mask,
                                          encoder_hidden_states=encoder_hidden_states,
                                          encoder_attention_mask=encoder_attention_mask, cache=cache,
                                          use_cache=use_cache)
        lm_logits = torch.stack([head(hidden_states) for head in self.lm_heads], dim=1)
        lm_logits = lm_logits.reshape(-1, *lm_logits.shape[2:])
        return lm_logits, cache

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, encoder_hidden_states=None,
                                      encoder_attention_mask=None, past_key_values=None, use_cache=True,
                                      delay_pattern_mask=None, guidance_scale=None, next_sequence_length=None,
                                      is_first_iteration=False):
        if delay_pattern_mask is None:
            input_ids, delay_pattern_mask = self.build_delay_pattern_mask(
                input_ids, pad_token_id=self.config.pad_token_id, max_length=self.config.max_length)

        input_ids = self.apply_delay_pattern_mask(input_ids, delay_pattern_mask)

        if guidance_scale is not None and guidance_scale > 1:
            input_ids = input_ids.repeat((2, 1))
            if attention_mask is not None:
                attention_mask = attention_mask.repeat((2, 1))
            if encoder_hidden_states is not None:
                encoder_hidden_states = torch.concatenate(
                    [encoder_hidden_states, torch.zeros_like(encoder_hidden_states)], dim=0)
            if encoder_attention_mask is not None:
                encoder_attention_mask = torch.concatenate(
                    [encoder_attention_mask, torch.zeros_like(encoder_attention_mask)], dim=0)

        if FIXED:
            input_ids = input_ids[:, -next_sequence_length:] if next_sequence_length is not None else input_ids
            if not is_first_iteration and use_cache:
                encoder_hidden_states = None
        else:
            if past_key_values is not None:
                input_ids = input_ids[:, -1:]
                encoder_hidden_states = None

        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "encoder_hidden_states": encoder_hidden_states,
            "encoder_attention_mask": encoder_attention_mask,
            "cache": past_key_values,
            "use_cache": use_cache,
        }

    def build_delay_pattern_mask(self, input_ids, pad_token_id, max_length=None):
        input_ids = input_ids.reshape(-1, self.num_codebooks, input_ids.shape[-1])
        bsz, num_codebooks, seq_len = input_ids.shape
        input_ids_shifted = torch.ones((bsz, num_codebooks, max_length), dtype=torch.long) * -1
        channel_codebooks = num_codebooks
        for codebook in range(channel_codebooks):
            input_ids_shifted[:, codebook, codebook: seq_len + codebook] = input_ids[:, codebook]
        delay_pattern = torch.triu(
            torch.ones((channel_codebooks, max_length), dtype=torch.bool), diagonal=max_length - channel_codebooks + 1)
        delay_pattern = delay_pattern + torch.tril(torch.ones((channel_codebooks, max_length), dtype=torch.bool))
        mask = ~delay_pattern
        input_ids = mask * input_ids_shifted + ~mask * pad_token_id
        first_codebook_ids = input_ids[:, 0, :]
        start_ids = (first_codebook_ids == -1).nonzero()[:, 1]
        first_start_id = min(start_ids) if len(start_ids) > 0 else seq_len
        pattern_mask = input_ids.reshape(bsz * num_codebooks, -1)
        input_ids = input_ids[..., :first_start_id].reshape(bsz * num_codebooks, -1)
        return input_ids, pattern_mask

    @staticmethod
    def apply_delay_pattern_mask(input_ids, decoder_pad_token_mask):
        seq_len = input_ids.shape[-1]
        decoder_pad_token_mask = decoder_pad_token_mask[..., :seq_len]
        return torch.where(decoder_pad_token_mask == -1, input_ids, decoder_pad_token_mask)

    @torch.no_grad()
    def generate(self, encoder_hidden_states, guidance_scale):
        bsz = encoder_hidden_states.shape[0]
        input_ids = torch.full((bsz * self.num_codebooks, 1), self.config.decoder_start_token_id, dtype=torch.long)
        input_ids, delay_pattern_mask = self.build_delay_pattern_mask(
            input_ids, pad_token_id=self.config.pad_token_id, max_length=self.config.max_length)
        past_key_values = DynamicCache()
        is_first_iteration = True
        next_sequence_length = None
        while input_ids.shape[-1] < self.config.max_length:
            model_inputs = self.prepare_inputs_for_generation(
                input_ids, encoder_hidden_states=encoder_hidden_states, past_key_values=past_key_values,
                delay_pattern_mask=delay_pattern_mask, guidance_scale=guidance_scale,
                next_sequence_length=next_sequence_length, is_first_iteration=is_first_iteration)
            logits, past_key_values = self(**model_inputs)
            next_token_logits = logits[:, -1, :]
            if guidance_scale is not None and guidance_scale > 1:
                cond_logits, uncond_logits = next_token_logits.split(input_ids.shape[0], dim=0)
                next_token_logits = uncond_logits + (cond_logits - uncond_logits) * guidance_scale
            next_tokens = next_token_logits.argmax(-1)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            is_first_iteration = False
            next_sequence_length = 1
        output_ids = self.apply_delay_pattern_mask(input_ids, delay_pattern_mask)
        return output_ids.reshape(bsz, self.num_codebooks, -1), next_token_logits


torch.manual_seed(0)
config = MusicgenMelodyDecoderConfig()
model = MusicgenMelodyForCausalLM(config).eval()
# text-encoder states (projected) + chroma states (projected), fused as the conditioning prefix
text_hidden_states = torch.randn(2, 5, config.hidden_size)
audio_hidden_states = torch.randn(2, 8, config.hidden_size)
encoder_hidden_states = torch.cat([audio_hidden_states, text_hidden_states], dim=1)
audio_codes, last_logits = model.generate(encoder_hidden_states, guidance_scale=config.guidance_scale)
print("codes", audio_codes[0, 0].tolist())
print("last logits norm %.4f" % last_logits.norm().item())
