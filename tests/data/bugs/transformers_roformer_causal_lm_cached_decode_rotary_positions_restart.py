# huggingface/transformers#22416 ("[Roformer] Fixing a bug in RoFormerEncoder where it was ignoring the length of
# past_key_values when generating as a decoder"); modeling_roformer.py read in v4.27.4 (before) and v4.28.1 (after).
# With a KV cache, RoFormerSelfAttention took the `past_key_value is not None` branch, which concatenated the new
# key onto the cache without applying the rotary embedding, and RoFormerEncoder built sinusoidal_pos from position 0
# for every step; cached decoding therefore compared an unrotated query/key against rotated cached keys, so the
# relative offsets the decode token sees differ from a full forward. The fix rotates first, then concatenates, with
# positions starting at past_key_values_length.
import math
import sys

import numpy as np
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RoFormerConfig:
    vocab_size = 100
    embedding_size = 64
    hidden_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 128
    hidden_act = "gelu"
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    max_position_embeddings = 128
    type_vocab_size = 2
    layer_norm_eps = 1e-12
    pad_token_id = 0
    rotary_value = False
    is_decoder = True
    use_cache = True


class RoFormerSinusoidalPositionalEmbedding(nn.Embedding):
    def __init__(self, num_positions, embedding_dim):
        super().__init__(num_positions, embedding_dim)
        self.weight = self._init_weight(self.weight)

    @staticmethod
    def _init_weight(out):
        n_pos, dim = out.shape
        position_enc = np.array(
            [[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_pos)]
        )
        out.requires_grad = False
        sentinel = dim // 2 if dim % 2 == 0 else (dim // 2) + 1
        out[:, 0:sentinel] = torch.FloatTensor(np.sin(position_enc[:, 0::2]))
        out[:, sentinel:] = torch.FloatTensor(np.cos(position_enc[:, 1::2]))
        out.detach_()
        return out

    @torch.no_grad()
    def forward(self, input_ids_shape, past_key_values_length=0):
        bsz, seq_len = input_ids_shape[:2]
        positions = torch.arange(
            past_key_values_length, past_key_values_length + seq_len, dtype=torch.long, device=self.weight.device
        )
        return super().forward(positions)


class RoFormerEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.embedding_size, padding_idx=config.pad_token_id)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.embedding_size)
        self.LayerNorm = nn.LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None):
        inputs_embeds = self.word_embeddings(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros(input_ids.size(), dtype=torch.long, device=inputs_embeds.device)
        embeddings = inputs_embeds + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(embeddings))


class RoFormerSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.is_decoder = config.is_decoder
        self.rotary_value = config.rotary_value

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(*new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, past_key_value=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        if not FIXED and past_key_value is not None:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
            key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
            value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        else:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
            if sinusoidal_pos is not None:
                if self.rotary_value:
                    query_layer, key_layer, value_layer = self.apply_rotary_position_embeddings(
                        sinusoidal_pos, query_layer, key_layer, value_layer
                    )
                else:
                    query_layer, key_layer = self.apply_rotary_position_embeddings(
                        sinusoidal_pos, query_layer, key_layer
                    )
            if FIXED and past_key_value is not None:
                key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
                value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        if self.is_decoder:
            past_key_value = (key_layer, value_layer)

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        context_layer = context_layer.view(*(context_layer.size()[:-2] + (self.all_head_size,)))
        return context_layer, past_key_value

    @staticmethod
    def apply_rotary_position_embeddings(sinusoidal_pos, query_layer, key_layer, value_layer=None):
        sin, cos = sinusoidal_pos.chunk(2, dim=-1)
        sin_pos = torch.stack([sin, sin], dim=-1).reshape_as(sinusoidal_pos)
        cos_pos = torch.stack([cos, cos], dim=-1).reshape_as(sinusoidal_pos)
        rotate_half_query_layer = torch.stack([-query_layer[..., 1::2], query_layer[..., ::2]], dim=-1).reshape_as(
            query_layer
        )
        query_layer = query_layer * cos_pos + rotate_half_query_layer * sin_pos
        rotate_half_key_layer = torch.stack([-key_layer[..., 1::2], key_layer[..., ::2]], dim=-1).reshape_as(key_layer)
        key_layer = key_layer * cos_pos + rotate_half_key_layer * sin_pos
        return query_layer, key_layer


class RoFormerLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = RoFormerSelfAttention(config)
        self.attn_dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn_LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, past_key_value=None):
        context, present_key_value = self.self(hidden_states, attention_mask, sinusoidal_pos, past_key_value)
        attention_output = self.attn_LayerNorm(self.attn_dense(context) + hidden_states)
        intermediate_output = nn.functional.gelu(self.intermediate(attention_output))
        layer_output = self.output_LayerNorm(self.output_dense(intermediate_output) + attention_output)
        return layer_output, present_key_value


class RoFormerEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_positions = RoFormerSinusoidalPositionalEmbedding(
            config.max_position_embeddings, config.hidden_size // config.num_attention_heads
        )
        self.layer = nn.ModuleList([RoFormerLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, use_cache=None):
        if FIXED:
            past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
            sinusoidal_pos = self.embed_positions(hidden_states.shape[:-1], past_key_values_length)[None, None, :, :]
        else:
            sinusoidal_pos = self.embed_positions(hidden_states.shape[:-1])[None, None, :, :]
        next_decoder_cache = () if use_cache else None
        for i, layer_module in enumerate(self.layer):
            past_key_value = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = layer_module(hidden_states, attention_mask, sinusoidal_pos, past_key_value)
            if use_cache:
                next_decoder_cache += (present,)
        return hidden_states, next_decoder_cache


def create_extended_attention_mask_for_decoder(input_shape, attention_mask):
    device = attention_mask.device
    batch_size, seq_length = input_shape
    seq_ids = torch.arange(seq_length, device=device)
    causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
    causal_mask = causal_mask.to(attention_mask.dtype)
    if causal_mask.shape[1] < attention_mask.shape[1]:
        prefix_seq_len = attention_mask.shape[1] - causal_mask.shape[1]
        causal_mask = torch.cat(
            [torch.ones((batch_size, seq_length, prefix_seq_len), device=device, dtype=causal_mask.dtype), causal_mask],
            axis=-1,
        )
    return causal_mask[:, None, :, :] * attention_mask[:, None, None, :]


class RoFormerForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = RoFormerEmbeddings(config)
        self.encoder = RoFormerEncoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True):
        batch_size, seq_length = input_ids.size()
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones(((batch_size, seq_length + past_key_values_length)))
        extended_attention_mask = create_extended_attention_mask_for_decoder(input_ids.size(), attention_mask)
        extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(torch.float32).min
        embedding_output = self.embeddings(input_ids=input_ids)
        sequence_output, past = self.encoder(embedding_output, extended_attention_mask, past_key_values, use_cache)
        return self.lm_head(sequence_output), past

    @torch.no_grad()
    def generate(self, input_ids, max_new_tokens):
        past_key_values = None
        step_input = input_ids
        generated = input_ids
        step_logits = []
        for _ in range(max_new_tokens):
            attention_mask = torch.ones_like(generated, dtype=torch.float32)
            logits, past_key_values = self(step_input, attention_mask, past_key_values)
            next_token = logits[:, -1].argmax(-1, keepdim=True)
            step_logits.append(logits[:, -1])
            generated = torch.cat([generated, next_token], dim=-1)
            step_input = next_token
        return generated, torch.stack(step_logits, 1)


config = RoFormerConfig()
model = RoFormerForCausalLM(config).eval()
input_ids = torch.randint(1, config.vocab_size, (2, 12))
generated, step_logits = model.generate(input_ids, max_new_tokens=10)
with torch.no_grad():
    full_logits, _ = model(generated[:, :-1], use_cache=False)
drift = (full_logits[:, input_ids.shape[1] - 1:] - step_logits).abs().max().item()
print("generated", generated[:, input_ids.shape[1]:].tolist())
print("cached vs full forward max logit diff %.6f" % drift)
