# huggingface/transformers#15751 ("[M2M100, XGLM] fix create_position_ids_from_inputs_embeds", fixes #15736,
# "XGLMForCausalLM does not compute position_ids correctly when using inputs_embeds").
#
# XGLM (transformers v4.16/v4.17) ported as it was written: XGLMSinusoidalPositionalEmbedding builds the positions
# from input_ids (cumsum over non-pad tokens + past_key_values_length) or, when the caller hands inputs_embeds, from
# create_position_ids_from_inputs_embeds(inputs_embeds), a plain arange starting at padding_idx + 1. The driver is a
# soft-prompt generator (as KoboldAI, the reporter, feeds XGLM): soft prompt vectors are prepended to the prompt's
# token embeddings and every step, cached ones included, goes in as inputs_embeds with the legacy tuple cache.
#
# Before the fix the inputs_embeds branch ignored past_key_values_length, so each cached decode step got the
# position of the first token again. The fix passes past_key_values_length into
# create_position_ids_from_inputs_embeds and adds it to the arange.
import math
import sys

import torch
from torch import nn

from transformers import XGLMConfig
from transformers.activations import ACT2FN

FIXED = "--fixed" in sys.argv


def _make_causal_mask(input_ids_shape, dtype, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), float("-inf"))
    mask_cond = torch.arange(mask.size(-1))
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.bool(), torch.finfo(dtype).min)


def create_position_ids_from_input_ids(input_ids, padding_idx, past_key_values_length=0):
    mask = input_ids.ne(padding_idx).int()
    incremental_indices = (torch.cumsum(mask, dim=1).type_as(mask) + past_key_values_length) * mask
    return incremental_indices.long() + padding_idx


class XGLMSinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, num_positions, embedding_dim, padding_idx=None):
        super().__init__()
        self.offset = 2
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.make_weights(num_positions + self.offset, embedding_dim, padding_idx)

    def make_weights(self, num_embeddings, embedding_dim, padding_idx=None):
        emb_weights = self.get_embedding(num_embeddings, embedding_dim, padding_idx)
        if hasattr(self, "weights"):
            emb_weights = emb_weights.to(dtype=self.weights.dtype, device=self.weights.device)
        self.weights = nn.Parameter(emb_weights)
        self.weights.requires_grad = False
        self.weights.detach_()

    @staticmethod
    def get_embedding(num_embeddings, embedding_dim, padding_idx=None):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(num_embeddings, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(num_embeddings, -1)
        if embedding_dim % 2 == 1:
            emb = torch.cat([emb, torch.zeros(num_embeddings, 1)], dim=1)
        if padding_idx is not None:
            emb[padding_idx, :] = 0
        return emb

    @torch.no_grad()
    def forward(self, input_ids=None, inputs_embeds=None, past_key_values_length=0):
        if input_ids is not None:
            bsz, seq_len = input_ids.size()
            position_ids = create_position_ids_from_input_ids(input_ids, self.padding_idx, past_key_values_length)
        else:
            bsz, seq_len = inputs_embeds.size()[:-1]
            if FIXED:
                position_ids = self.create_position_ids_from_inputs_embeds(inputs_embeds, past_key_values_length)
            else:
                position_ids = self.create_position_ids_from_inputs_embeds(inputs_embeds)

        max_pos = self.padding_idx + 1 + seq_len + past_key_values_length
        if max_pos > self.weights.size(0):
            self.make_weights(max_pos + self.offset, self.embedding_dim, self.padding_idx)

        return self.weights.index_select(0, position_ids.view(-1)).view(bsz, seq_len, -1).detach()

    if FIXED:

        def create_position_ids_from_inputs_embeds(self, inputs_embeds, past_key_values_length):
            input_shape = inputs_embeds.size()[:-1]
            sequence_length = input_shape[1]
            position_ids = torch.arange(
                self.padding_idx + 1, sequence_length + self.padding_idx + 1, dtype=torch.long
            )
            return position_ids.unsqueeze(0).expand(input_shape).contiguous() + past_key_values_length

    else:

        def create_position_ids_from_inputs_embeds(self, inputs_embeds):
            input_shape = inputs_embeds.size()[:-1]
            sequence_length = input_shape[1]
            position_ids = torch.arange(
                self.padding_idx + 1, sequence_length + self.padding_idx + 1, dtype=torch.long
            )
            return position_ids.unsqueeze(0).expand(input_shape).contiguous()


class XGLMAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, is_decoder=False, bias=True):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.is_decoder = is_decoder
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    def _shape(self, tensor, seq_len, bsz):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, past_key_value=None, attention_mask=None):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if past_key_value is not None:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        if self.is_decoder:
            past_key_value = (key_states, value_states)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.embed_dim)
        return self.out_proj(attn_output), past_key_value


class XGLMDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_dim = config.d_model
        self.self_attn = XGLMAttention(
            self.embed_dim, config.attention_heads, dropout=config.attention_dropout, is_decoder=True
        )
        self.dropout = config.dropout
        self.activation_fn = ACT2FN[config.activation_function]
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.fc1 = nn.Linear(self.embed_dim, config.ffn_dim)
        self.fc2 = nn.Linear(config.ffn_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, use_cache=True):
        residual = hidden_states
        hidden_states = self.self_attn_layer_norm(hidden_states)
        self_attn_past_key_value = past_key_value[:2] if past_key_value is not None else None
        hidden_states, present_key_value = self.self_attn(
            hidden_states=hidden_states, past_key_value=self_attn_past_key_value, attention_mask=attention_mask
        )
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.activation_fn(self.fc1(hidden_states))
        hidden_states = self.fc2(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states, (present_key_value if use_cache else None)


class XGLMModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.embed_scale = math.sqrt(config.d_model) if config.scale_embedding else 1.0
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model, self.padding_idx)
        self.embed_positions = XGLMSinusoidalPositionalEmbedding(
            config.max_position_embeddings, config.d_model, config.pad_token_id
        )
        self.layers = nn.ModuleList([XGLMDecoderLayer(config) for _ in range(config.num_layers)])
        self.layer_norm = nn.LayerNorm(config.d_model)

    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, inputs_embeds.dtype, past_key_values_length)
        if attention_mask is not None:
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype, tgt_len=input_shape[-1])
            combined_attention_mask = (
                expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask + combined_attention_mask
            )
        return combined_attention_mask

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, use_cache=True):
        if input_ids is not None and inputs_embeds is not None:
            raise ValueError("You cannot specify both input_ids and inputs_embeds at the same time")
        elif input_ids is not None:
            input_shape = input_ids.size()
            input_ids = input_ids.view(-1, input_shape[-1])
        else:
            input_shape = inputs_embeds.size()[:-1]

        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids) * self.embed_scale

        attention_mask = self._prepare_decoder_attention_mask(
            attention_mask, input_shape, inputs_embeds, past_key_values_length
        )

        positions = self.embed_positions(input_ids, inputs_embeds, past_key_values_length)
        hidden_states = inputs_embeds + positions
        hidden_states = nn.functional.dropout(hidden_states, p=float(self.config.dropout), training=self.training)

        next_decoder_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = decoder_layer(
                hidden_states, attention_mask=attention_mask, past_key_value=past_key_value, use_cache=use_cache
            )
            if use_cache:
                next_decoder_cache += (present,)
        hidden_states = self.layer_norm(hidden_states)
        return hidden_states, next_decoder_cache


class XGLMForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = XGLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, inputs_embeds=None, use_cache=True):
        hidden_states, cache = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
        )
        return self.lm_head(hidden_states), cache


def soft_prompt_generate(model, softprompt, input_ids, max_new_tokens):
    """Greedy generation with a soft prompt, every step fed as inputs_embeds (the KoboldAI way)."""
    embed_scale = model.model.embed_scale
    wte = model.get_input_embeddings()
    bsz = input_ids.shape[0]
    inputs_embeds = torch.cat(
        [softprompt.unsqueeze(0).expand(bsz, -1, -1), wte(input_ids) * embed_scale], dim=1
    )
    attention_mask = torch.ones(bsz, inputs_embeds.shape[1], dtype=torch.long)
    past_key_values = None
    generated = []
    for _ in range(max_new_tokens):
        logits, past_key_values = model(
            attention_mask=attention_mask, past_key_values=past_key_values, inputs_embeds=inputs_embeds
        )
        next_tokens = logits[:, -1, :].argmax(-1)
        generated.append(next_tokens)
        inputs_embeds = wte(next_tokens[:, None]) * embed_scale
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(bsz, 1)], dim=-1)
    return torch.stack(generated, dim=1), logits


def main():
    torch.manual_seed(0)
    config = XGLMConfig(
        vocab_size=96,
        max_position_embeddings=64,
        d_model=64,
        ffn_dim=128,
        num_layers=2,
        attention_heads=4,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        scale_embedding=True,
        pad_token_id=1,
    )
    model = XGLMForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dim() > 1:
                p.normal_(0.0, 0.3)
        model.model.embed_tokens.weight.normal_(0.0, 0.08)

    softprompt = torch.randn(4, config.d_model) * 2.0
    input_ids = torch.tensor([[5, 17, 33, 8, 61, 12], [40, 9, 22, 71, 3, 50]])
    with torch.no_grad():
        tokens, last_logits = soft_prompt_generate(model, softprompt, input_ids, max_new_tokens=8)
    print("generated:", tokens.tolist())
    print("last step logits[0, :4]:", [round(v, 4) for v in last_logits[0, -1, :4].tolist()])


if __name__ == "__main__":
    main()
